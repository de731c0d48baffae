"""A plain GRPO loop, built from hasten's own parts, short enough to read in one sitting.

It computes what `hasten train --profile baseline` computes, with every speed feature off:
transformers' forward with a KV cache for sampling, one padded log-prob pass for learning,
torch's for-loop AdamW, rewards called inline. tests/test_reference_grpo.py checks that the two
give the same losses, rewards and weights on the tiny model. Left out on purpose, because they
do not change what is learned: evals, checkpoints and resume, the NaN guard (a run whose losses
stay finite never needs it), torchrun, log files, and the trainer_state / log_metric arguments
reward functions may take (TRL's other arguments are passed). What the loop does not do (gradient
accumulation, stop strings, reward weights, ...) is refused rather than ignored.

One step:
    prompts --engine--> num_generations completions each, seeded by (train.seed, step)
            --rewards--> one score per completion
            --groups--> advantage = (score - group mean) / (group std + 1e-4)
            --loss--> clipped policy gradient (+ beta x KL to the starting model) --> AdamW

Run it with any hasten config (the speed: section is always the baseline's):
    python examples/grpo_reference.py --model.name=tiny --task.name=jsonl --task.path=prompts.jsonl \
        --rewards.extra=[rewards.py:letters] --algo.loss=grpo --train.steps=3
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from hasten.algo import LOSSES, LossInputs, LossSettings, group_advantages
from hasten.config import Config, ConfigError, load_config, parse_overrides
from hasten.device import resolve_device
from hasten.errors import UserError
from hasten.models import Policy, Reference, load_policy
from hasten.rewards import load_reward
from hasten.rewards.batch import reward_inputs
from hasten.rewards.runner import score_rewards
from hasten.rollout import KVCacheEngine, SamplingParams
from hasten.rollout.prompts import encode_prompt
from hasten.tasks import make_task
from hasten.tasks.sampler import PromptSampler
from hasten.train.logprobs import completion_logprobs
from hasten.train.optimization import lr_factor


def check_supported(cfg: Config) -> None:
    """Refuse the settings this loop leaves out, rather than train something the config did not ask for."""
    left_out = {"train.gradient_accumulation_steps": cfg.train.gradient_accumulation_steps != 1,
                "algo.mask_truncated_completions": cfg.algo.mask_truncated_completions,
                "generation.stop_strings": bool(cfg.generation.stop_strings),
                "rewards.weights": cfg.rewards.weights is not None}
    for key, asked in left_out.items():
        if asked:
            raise ConfigError(f"config error: {key} is not in the reference loop (use hasten train)")


def sequence_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """Log-prob of every completion token under `model`, (B*G, T): the plain padded pass."""
    prompt_of_sample = torch.arange(rollout.num_samples) // rollout.num_generations  # (B*G,)
    return completion_logprobs(model, rollout.prompt_ids[prompt_of_sample], rollout.prompt_mask[prompt_of_sample],
                               rollout.completion_ids, rollout.completion_mask, temperature=temperature).logps


def train(cfg: Config, log: Callable[[str], None] = print) -> tuple[Policy, list[dict[str, float]]]:
    """GRPO on cfg's model, task and rewards; returns (policy, one metrics record per step)."""
    check_supported(cfg)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.train.seed)  # LoRA's initial adapters; sampling has its own seeds
    task = make_task(cfg.task, cfg)
    reward_functions = list(task.reward_functions) if cfg.rewards.task_rewards else []
    reward_functions += [load_reward(spec) for spec in cfg.rewards.extra]
    policy = load_policy(cfg.model, log)  # transformers' classes: speed.model_impl=hf
    model, tokenizer = policy.model.to(resolve_device(cfg.model.device)), policy.tokenizer
    reference = Reference(policy) if cfg.algo.beta > 0 else None  # a frozen copy of the starting weights

    generation, algo = cfg.generation, cfg.algo
    group_size = generation.num_generations
    sampling = SamplingParams(generation.max_new_tokens, generation.temperature, generation.top_p,
                              generation.top_k, generation.min_p, generation.repetition_penalty)
    engine = KVCacheEngine(model, policy.pad_token_id, policy.eos_token_ids)  # samples from the live weights
    sampler = PromptSampler(task.train_rows, cfg.train.seed)  # a seeded shuffle, epoch after epoch
    loss_function, loss_settings = LOSSES[algo.loss], LossSettings(algo.epsilon, algo.epsilon_high, algo.beta)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(parameters, lr=cfg.train.lr, betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
                                  weight_decay=cfg.train.weight_decay, foreach=False)
    total_updates = cfg.train.steps * algo.num_iterations  # the lr schedule's length
    updates = 0
    records = []
    for step in range(1, cfg.train.steps + 1):
        # 1. Sample: num_generations completions for each prompt, with the trainer's seed for this step.
        rows = sampler.next(cfg.train.prompts_per_step)
        prompts = [encode_prompt(tokenizer, row["prompt"], **generation.chat_template_kwargs) for row in rows]
        rollout = engine.generate(prompts, group_size, sampling, seed=cfg.train.seed * 1_000_003 + step)

        # 2. Score, and compare each completion with the others of its group.
        inputs = reward_inputs(tokenizer, rows, rollout)  # texts in TRL's reward-function layout
        scores = score_rewards(reward_functions, inputs.prompts, inputs.completions, inputs.columns,
                               inputs.completion_ids)
        rewards = scores.scored_total  # (B*G,) NaN where no reward function applied
        advantages = group_advantages(rewards, group_size, algo.scale_rewards)  # (B*G,) 0 for NaN rewards

        # 3. Learn: num_iterations updates on this batch, the ratio taken against the sampling weights.
        mask = rollout.completion_mask  # (B*G, T) 1 = generated token, on the model's device
        advantages = advantages.to(mask.device)
        reference_logps = None
        if reference is not None:
            with torch.no_grad(), reference.active() as reference_model:
                reference_logps = sequence_logprobs(reference_model, rollout, sampling.temperature)  # (B*G, T)
        old_logps = None
        for _ in range(algo.num_iterations):
            logps = sequence_logprobs(model, rollout, sampling.temperature)  # (B*G, T) with grad
            if old_logps is None:  # before any update on this batch: the policy that sampled it
                old_logps = logps.detach()
            batch = LossInputs(logps=logps, old_logps=old_logps, ref_logps=reference_logps, advantages=advantages,
                               completion_mask=mask, total_tokens=float(mask.sum()),
                               total_sequences=rollout.num_samples, max_completion_length=sampling.max_new_tokens)
            loss, _ = loss_function(batch, loss_settings)  # (the clip and KL metrics are left out here)
            loss.backward()
            for parameter_group in optimizer.param_groups:  # warmup, then cosine/linear decay
                parameter_group["lr"] = cfg.train.lr * lr_factor(
                    updates, cfg.train.warmup_steps, total_updates, cfg.train.lr_schedule, cfg.train.min_lr_ratio,
                    cfg.train.warmup_from_zero)
            max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            updates += 1

        record = {"step": step, "reward_mean": float(torch.nanmean(rewards)),
                  "loss": float(loss.detach()), "grad_norm": float(grad_norm)}  # the last iteration's, as hasten logs
        log(" ".join(f"{key}={value:.4g}" for key, value in record.items()))
        records.append(record)
    return policy, records


def main(arguments: list[str]) -> None:
    path = arguments[0] if arguments and not arguments[0].startswith("--") else None
    overrides = parse_overrides(arguments[1:] if path else arguments)
    train(load_config(path, overrides, profile="baseline"))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except UserError as error:  # bad config, data or reward file: one line naming it, exit 2 (as hasten's CLI)
        print(error, file=sys.stderr)
        sys.exit(2)
