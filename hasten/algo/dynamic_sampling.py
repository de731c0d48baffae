"""Dynamic sampling (algo.dynamic_sampling, DAPO): never train on a group whose rewards are all equal.

A group whose G samples all got the same reward has advantage 0 everywhere:
it adds no policy-gradient signal, yet it still dilutes token-normalized
losses and costs a learning pass. DAPO drops such groups and generates more
prompts until the batch is full again. Here each refill round generates and
scores just the missing number of prompts (the next rows of the same
stream), at most algo.dynamic_sampling_max_rounds rounds per step: the cap
on extra generation. What is still missing after the cap stays missing (the
step trains on fewer groups), and a step left with no group skips its update.

This changes what is learned (that is DAPO's point: every trained group
carries signal) and makes a step cost more generation when many groups are
flat. Metrics: dynamic/rounds, dynamic/dropped_groups, dynamic/groups.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..rewards import RewardScores
from ..rollout import Rollout
from ..rewards.batch import RewardInputs, ScoredBatch

FLAT = 1e-8  # a group is flat when max - min of its rewards is below this


def informative_groups(total: torch.Tensor, num_generations: int) -> list[int]:
    """Indices of groups whose rewards are not all equal."""
    grouped = total.view(-1, num_generations)  # (B, G)
    spread = grouped.max(dim=1).values - grouped.min(dim=1).values  # (B,)
    return [int(i) for i in (spread >= FLAT).nonzero().flatten()]


def select_groups(batch: ScoredBatch, groups: list[int]) -> ScoredBatch:
    """The groups `groups` of `batch`, in that order."""
    size = batch.rollout.num_generations
    samples = [g * size + j for g in groups for j in range(size)]
    index = torch.tensor(samples, dtype=torch.long)
    rollout = batch.rollout
    width = int(rollout.completion_mask[index].sum(1).max()) if samples else 0
    picked = Rollout(
        prompt_ids=rollout.prompt_ids[groups], prompt_mask=rollout.prompt_mask[groups],
        completion_ids=rollout.completion_ids[index, :width], completion_mask=rollout.completion_mask[index, :width],
        sampling_logprobs=rollout.sampling_logprobs[index, :width], ended_with_eos=rollout.ended_with_eos[index],
        num_generations=size, sampling=rollout.sampling,
    )
    inputs = batch.inputs
    chosen = RewardInputs(
        prompts=[inputs.prompts[i] for i in samples], completions=[inputs.completions[i] for i in samples],
        texts=[inputs.texts[i] for i in samples],
        columns={key: [values[i] for i in samples] for key, values in inputs.columns.items()},
        completion_ids=[inputs.completion_ids[i] for i in samples],
    )
    scores = RewardScores(batch.scores.per_function[index], batch.scores.total[index], batch.scores.names)
    return ScoredBatch([batch.rows[g] for g in groups], picked, chosen, scores, batch.metrics)


def _pad_left(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (width - tensor.shape[1], 0), value=value)


def _pad_right(tensor: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)


def concat(batches: list[ScoredBatch], pad_token_id: int) -> ScoredBatch:
    """One batch holding every group of `batches`, re-padded to common widths."""
    rollouts = [b.rollout for b in batches]
    prompt_width = max(r.prompt_ids.shape[1] for r in rollouts)
    width = max(r.completion_ids.shape[1] for r in rollouts)
    rollout = Rollout(
        prompt_ids=torch.cat([_pad_left(r.prompt_ids, prompt_width, pad_token_id) for r in rollouts]),
        prompt_mask=torch.cat([_pad_left(r.prompt_mask, prompt_width, 0) for r in rollouts]),
        completion_ids=torch.cat([_pad_right(r.completion_ids, width, pad_token_id) for r in rollouts]),
        completion_mask=torch.cat([_pad_right(r.completion_mask, width, 0) for r in rollouts]),
        sampling_logprobs=torch.cat([_pad_right(r.sampling_logprobs, width, 0.0) for r in rollouts]),
        ended_with_eos=torch.cat([r.ended_with_eos for r in rollouts]),
        num_generations=rollouts[0].num_generations, sampling=rollouts[0].sampling,
    )
    keys = list(dict.fromkeys(key for b in batches for key in b.inputs.columns))
    inputs = RewardInputs(
        prompts=[p for b in batches for p in b.inputs.prompts],
        completions=[c for b in batches for c in b.inputs.completions],
        texts=[t for b in batches for t in b.inputs.texts],
        columns={key: [v for b in batches for v in b.inputs.columns.get(key, [None] * len(b.inputs.texts))]
                 for key in keys},
        completion_ids=[ids for b in batches for ids in b.inputs.completion_ids],
    )
    scores = RewardScores(torch.cat([b.scores.per_function for b in batches]),
                          torch.cat([b.scores.total for b in batches]), batches[0].scores.names)
    return ScoredBatch([row for b in batches for row in b.rows], rollout, inputs, scores, batches[-1].metrics)


def refill(first: ScoredBatch, draw: Callable[[int, int], ScoredBatch], max_rounds: int,
           pad_token_id: int) -> tuple[ScoredBatch | None, dict[str, float]]:
    """Keep `first`'s informative groups and draw(count, round) more until full or out of rounds.

    Returns (the batch to train on, or None when no group is informative; metrics).
    """
    size = first.rollout.num_generations
    target = first.num_groups
    kept = [select_groups(first, informative_groups(first.scores.total, size))]
    have, dropped, rounds = kept[0].num_groups, target - kept[0].num_groups, 0
    while have < target and rounds < max_rounds:
        rounds += 1
        extra = draw(target - have, rounds)
        useful = select_groups(extra, informative_groups(extra.scores.total, size))
        dropped += extra.num_groups - useful.num_groups
        have += useful.num_groups
        kept.append(useful)
    kept = [b for b in kept if b.num_groups]
    metrics = {"dynamic/rounds": rounds, "dynamic/dropped_groups": dropped, "dynamic/groups": have}
    if not kept:
        return None, metrics
    return concat(kept, pad_token_id), metrics
