"""TRL's GRPO evaluation: sampled groups, their rewards, and the loss without an update.

TRL's `GRPOTrainer.evaluate()` runs its training step's first half on the
eval rows (`_generate_and_score_completions`: num_generations sampled
completions per prompt, rewards, group-relative advantages) and its loss
under `torch.no_grad()` (`prediction_step`), batch by batch
(per_device_eval_batch_size completions), and reports the batches' mean loss
as eval_loss beside the reward metrics. `sampled_eval` does the same over
hasten's pieces: the run's engine and sampling settings, reward functions,
advantages, log-prob pass and loss function (algo/losses.py's LOSSES).

What it leaves alone on purpose: the training RNG streams. The engine draws
from its own generator seeded by `seed` (rollout/decode.py); the prompt feed,
the curriculum's success rates and the optimizer are not touched, so a run
with evals takes the same steps as one without (tests/conformance/
test_grpo_eval_loss.py checks it). The model is scored on-policy: the old
log-probs are the current ones, so every ratio is 1 and the loss is the
advantage-weighted term plus beta x KL, as TRL's eval loss is.

hasten's own greedy eval (train/evaluate.py: accuracy, answer rate) is the
CLI's and stays as it is; the API reports both (grpo_trainer.py).
"""

from __future__ import annotations

from typing import Any

import torch

from ..algo import LOSSES, LossInputs, group_advantages, zero_variance_fraction
from ..algo.advantages import nanstd, normalized_sum_advantages
from ..rewards import score_rewards
from ..rewards.batch import reward_inputs
from ..rollout import RowRange, SamplingParams
from ..rollout.prompts import encode_prompt
from ..rollout.stops import apply_stop_strings


def sampled_eval(session: Any, engine: Any, rows: list[dict[str, Any]], batch_size: int, num_generations: int,
                 seed: int, reference: Any = None) -> dict[str, float]:
    """The eval record (hasten's metric names, as a training step's) of `rows`: `num_generations` sampled
    completions per prompt, drawn by `engine`, in batches of `batch_size` completions; "loss" is the mean
    of the batches' losses (TRL's eval_loss). reference: the KL reference (models.Reference) when
    algo.beta > 0."""
    from ..train.learner import LearnerSettings, LogprobPass

    cfg, policy = session.cfg, session.policy
    generation = cfg.generation
    sampling = SamplingParams(generation.max_new_tokens, generation.temperature, generation.top_p, generation.top_k,
                              generation.min_p, generation.repetition_penalty)
    device = next(policy.model.parameters()).device
    settings = LearnerSettings.from_config(cfg, False, policy.model.config, str(device))
    loss_fn, logprob_pass = LOSSES[settings.loss], LogprobPass.choose(cfg)
    prompts_per_batch = max(1, batch_size // num_generations)  # e.g. 3 completions / 3 generations = 1 prompt
    losses: list[float] = []
    totals: list[torch.Tensor] = []  # (B*G,) per batch
    per_function: list[torch.Tensor] = []  # (B*G, F) per batch
    lengths: list[torch.Tensor] = []  # (B*G,) per batch
    step_metrics: dict[str, list[float]] = {}  # the loss function's own metrics (kl, clip ratios), per batch
    entropy = entropy_tokens = 0.0
    names: list[str] = []
    for index, start in enumerate(range(0, len(rows), prompts_per_batch)):
        batch = rows[start:start + prompts_per_batch]
        rollout, inputs = _sample(session, engine, batch, num_generations, sampling, seed + index)
        scores = score_rewards(session.rewards, inputs.prompts, inputs.completions, inputs.columns,
                               inputs.completion_ids, session.reward_logs.kwargs())
        names = scores.names
        total = scores.scored_total  # (B*G,) NaN where no function applied
        if cfg.rewards.aggregation == "normalize_then_sum":
            weights = torch.tensor([function.weight for function in session.rewards], dtype=torch.float32)
            advantages = normalized_sum_advantages(scores.per_function, weights, num_generations)
        else:
            advantages = group_advantages(total, num_generations, cfg.algo.scale_rewards)  # (B*G,)
        mask = rollout.loss_mask(cfg.algo.mask_truncated_completions)
        mask = rollout.completion_mask if mask is None else mask  # (B*G, T)
        every = torch.arange(rollout.num_samples)
        with torch.no_grad():
            stats = logprob_pass(policy.model, rollout, every, with_entropy=True)
            ref_logps = None
            if reference is not None and settings.loss_settings.beta > 0:
                with reference.active() as reference_model:
                    ref_logps = logprob_pass(reference_model, rollout, every, False).logps  # (B*G, T)
            mask = mask.to(stats.logps.device)
            # on-policy: the old log-probs are the current ones (ratio 1), as TRL's eval without an update
            loss, metrics = loss_fn(LossInputs(
                logps=stats.logps, old_logps=stats.logps, ref_logps=ref_logps, advantages=advantages.to(device),
                completion_mask=mask, total_tokens=float(mask.sum()), total_sequences=rollout.num_samples,
                max_completion_length=sampling.max_new_tokens), settings.loss_settings)
        losses.append(float(loss))
        for key, value in metrics.items():
            step_metrics.setdefault(key, []).append(float(value))
        entropy += float((stats.entropy * mask).sum())
        entropy_tokens += float(mask.sum())
        totals.append(total)
        per_function.append(scores.per_function)
        lengths.append(rollout.model_lengths.float())
    record = _record(torch.cat(totals), torch.cat(per_function), names, torch.cat(lengths), num_generations)
    record["loss"] = sum(losses) / len(losses)
    record.update({key: sum(values) / len(values) for key, values in step_metrics.items()})
    if entropy_tokens:
        record["entropy"] = entropy / entropy_tokens
    return record


def _sample(session: Any, engine: Any, batch: list[dict[str, Any]], num_generations: int,
            sampling: SamplingParams, seed: int):
    """(rollout, reward inputs) for `batch`: a group per prompt, drawn as a training step draws them."""
    policy, generation = session.policy, session.cfg.generation
    draws = RowRange(0, len(batch) * num_generations)
    if session.agent is not None:  # tools, environments, rollout_func: their loop generates, as in training
        agentic = session.agent.generate(engine, batch, num_generations, sampling, seed, draws)
        return agentic.rollout, agentic.inputs
    prompts = [encode_prompt(policy.tokenizer, row["prompt"], **(generation.chat_template_kwargs or {}))
               for row in batch]
    rollout = engine.generate(prompts, num_generations, sampling, seed=seed, rows=draws)
    rollout = apply_stop_strings(rollout, policy.tokenizer, generation.stop_strings, policy.pad_token_id)
    return rollout, reward_inputs(policy.tokenizer, batch, rollout)


def _record(total: torch.Tensor, per_function: torch.Tensor, names: list[str], lengths: torch.Tensor,
            num_generations: int) -> dict[str, float]:
    """The reward and length metrics of every batch together, under a training step's names.
    total: (N*G,) NaN where unscored; per_function: (N*G, F) NaN where a function did not apply."""
    record = {
        "reward_mean": float(torch.nanmean(total)),
        "reward_std": float(nanstd(total)),
        "zero_variance_groups": zero_variance_fraction(total, num_generations),
        "completion_length": float(lengths.mean()),
        "completion_length_max": float(lengths.max()),
    }
    for column, name in enumerate(names):
        values = per_function[:, column]  # (N*G,)
        if bool((~torch.isnan(values)).any()):
            record[f"rewards/{name}"] = float(torch.nanmean(values))
            record[f"rewards/{name}/std"] = float(nanstd(values))
    return record
