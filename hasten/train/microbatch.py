"""Micro-batches by token budget (speed.token_budget).

The learner splits a generation batch into train.gradient_accumulation_steps
chunks of whole samples; with a token budget each chunk is split further so
that no micro-batch holds more than `budget` tokens of model input. The
budget bounds peak activation memory by what it actually depends on, the
tokens in one forward, rather than by a sample count that is too small for
short completions and too large for long ones. On a CPU the biggest batch
that fits is the fastest, so the default is off (0).

Tokens are counted as the forward will see them:
- packed pass (speed.packed_learning): each group's prompt once, plus each
  completion's length - 1 (its last token is only a target);
- padded pass: samples x (longest prompt + longest completion) in the piece.

Samples stay in rollout order, so a group's completions stay together and
its prompt is encoded once per micro-batch. A single sample over the budget
gets a micro-batch of its own rather than an error: the budget is a memory
target, not a correctness condition. The losses are scaled by the whole
batch's token and sequence counts (algo/losses.py), so grpo, dr_grpo, dapo
and gspo give the same gradient however the batch is split; bnpo
normalizes per micro-batch, as TRL's does per device batch.
"""

from __future__ import annotations

import torch

from ..rollout import Rollout


def micro_batches(rollout: Rollout, accumulation_steps: int, budget: int, packed: bool) -> list[torch.Tensor]:
    """Sample indices of each micro-batch, in order; every sample appears exactly once."""
    chunks = list(torch.arange(rollout.num_samples).tensor_split(accumulation_steps))
    if budget <= 0:
        return chunks
    prompt_lengths = rollout.prompt_mask.sum(dim=1).tolist()  # (B,)
    completion_lengths = rollout.completion_mask.sum(dim=1).tolist()  # (N,)
    group_size = rollout.num_generations
    pieces: list[torch.Tensor] = []
    for chunk in chunks:
        current: list[int] = []
        for sample in chunk.tolist():
            if current and _tokens(current + [sample], prompt_lengths, completion_lengths, group_size,
                                   packed) > budget:
                pieces.append(torch.tensor(current))
                current = []
            current.append(sample)
        if current:
            pieces.append(torch.tensor(current))
    return pieces


def _tokens(samples: list[int], prompt_lengths: list[int], completion_lengths: list[int], group_size: int,
            packed: bool) -> int:
    groups = {sample // group_size for sample in samples}
    if packed:
        return sum(prompt_lengths[g] for g in groups) + sum(max(completion_lengths[s] - 1, 0) for s in samples)
    width = max(prompt_lengths[s // group_size] for s in samples) + max(completion_lengths[s] for s in samples)
    return len(samples) * width


def count_tokens(rollout: Rollout, samples: torch.Tensor, packed: bool) -> int:
    """Model-input tokens of one micro-batch, counted as micro_batches counts them."""
    return _tokens(samples.tolist(), rollout.prompt_mask.sum(dim=1).tolist(),
                   rollout.completion_mask.sum(dim=1).tolist(), rollout.num_generations, packed)
