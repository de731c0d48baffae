"""The GRPO loop: generate, score, compare within groups, update. Run it with
`hasten train --config run.yaml` (see cli.py).

One step takes prompts_per_step prompts, samples num_generations completions
for each (the engine shares each prompt's prefill across its group), scores
them with the reward functions, turns scores into group-relative advantages,
and hands the batch to the learner for num_iterations optimizer steps. The
engine works on the policy's own weights, so "handing the new weights to the
engine" costs nothing here; a vLLM engine will need an explicit sync.

Everything that can fail on user input (config, task data, reward files,
model name) is resolved before the run directory is created, so a bad
invocation leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..algo import group_advantages, zero_variance_fraction
from ..config import Config, ConfigError
from ..models import Policy, Reference, load_policy
from ..rewards import RewardFunction, load_reward, score_rewards
from ..rollout import Engine, KVCacheEngine, SamplingParams
from ..tasks import Task, make_task
from .episodes import PromptSampler, encode_prompt, reward_inputs
from .evaluate import evaluate
from .learner import Learner
from .outputs import RunDir
from .progress import Progress
from .runtime import configure_threads, keep_freed_memory


@dataclass
class Session:
    """Everything a run needs, resolved and checked before anything is written."""

    cfg: Config
    task: Task
    rewards: list[RewardFunction]
    policy: Policy
    engine: Engine  # KVCacheEngine or LeanEngine (speed.engine)


def build_rewards(cfg: Config, task: Task) -> list[RewardFunction]:
    functions = list(task.reward_functions) if cfg.rewards.task_rewards else []
    functions += [load_reward(spec) for spec in cfg.rewards.extra]
    if not functions:
        raise ConfigError(
            f"config error: no reward functions (task '{task.name}' has none built in; add --reward file.py:function)"
        )
    if cfg.rewards.weights is not None:
        if len(cfg.rewards.weights) != len(functions):
            names = ", ".join(f.name for f in functions)
            raise ConfigError(
                f"config error: rewards.weights has {len(cfg.rewards.weights)} values for "
                f"{len(functions)} reward functions ({names})"
            )
        functions = [dataclasses.replace(f, weight=w) for f, w in zip(functions, cfg.rewards.weights)]
    return functions


def prepare(cfg: Config, log: Callable[[str], None] = print) -> Session:
    configure_threads(cfg.train.num_threads)
    if cfg.speed.keep_freed_memory:
        keep_freed_memory()
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    task = make_task(cfg.task, cfg)
    rewards = build_rewards(cfg, task)
    policy = load_policy(cfg.model, log)
    return Session(cfg, task, rewards, policy, make_engine(cfg, policy, log))


def make_engine(cfg: Config, policy: Policy, log: Callable[[str], None] = print):
    """speed.engine: the lean engine where it supports the model, else transformers' forward.

    Both sample the same distribution with the same seeded draws; the lean one
    is a faster forward (tests/test_lean_engine.py checks they agree).
    """
    from ..rollout.lean import LeanEngine, check_supported

    choice = cfg.speed.engine
    if choice in ("auto", "lean"):
        try:
            check_supported(policy.model)
        except ValueError as reason:
            if choice == "lean":
                raise ConfigError(f"config error: speed.engine=lean cannot run this model ({reason})") from None
            log(f"speed.engine=auto: using the hf engine ({reason})")
        else:
            return LeanEngine(policy.model, policy.pad_token_id, policy.eos_token_ids)
    return KVCacheEngine(policy.model, policy.pad_token_id, policy.eos_token_ids)


def run_eval(session: Session, run: RunDir, progress: Progress, step: int) -> dict[str, float]:
    cfg = session.cfg
    started = time.perf_counter()
    metrics, samples = evaluate(
        session.task, session.engine, session.policy.tokenizer, session.rewards,
        min(cfg.eval.num_examples, len(session.task.eval_rows)), cfg.eval.max_new_tokens, cfg.eval.batch_size,
    )
    metrics["seconds"] = time.perf_counter() - started
    run.log_eval(step, metrics)
    run.save_samples(f"eval-step{step}", samples)
    progress.set_eval(step, metrics)
    return metrics


def grpo_step(session: Session, learner: Learner, sampler: PromptSampler, step: int) -> dict[str, float]:
    """One GRPO step; returns its metrics record."""
    cfg, tokenizer = session.cfg, session.policy.tokenizer
    group = cfg.generation.num_generations
    sampling = SamplingParams(
        cfg.generation.max_new_tokens, cfg.generation.temperature, cfg.generation.top_p, cfg.generation.top_k
    )
    rows = sampler.next(cfg.train.prompts_per_step)

    started = time.perf_counter()
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    rollout = session.engine.generate(prompts, group, sampling, seed=cfg.train.seed * 1_000_003 + step)
    generated = time.perf_counter()

    inputs = reward_inputs(tokenizer, rows, rollout)
    scores = score_rewards(session.rewards, inputs.prompts, inputs.completions, inputs.columns,
                           inputs.completion_ids)
    advantages = group_advantages(scores.total, group, cfg.algo.scale_rewards)  # (B*G,)
    scored = time.perf_counter()

    learned_metrics = learner.step(rollout, advantages)
    finished = time.perf_counter()

    lengths = rollout.completion_lengths.float()
    prompt_tokens = int(rollout.prompt_mask.sum())
    completion_tokens = int(lengths.sum())
    record = {
        "step": step,
        "reward_mean": float(scores.total.mean()),
        "reward_std": float(scores.total.std()),
        **{f"rewards/{name}": value for name, value in scores.means().items()},
        **{f"rewards/{name}/std": value for name, value in scores.stds().items()},
        "zero_variance_groups": zero_variance_fraction(scores.total, group),
        "completion_length": float(lengths.mean()),
        "completion_length_max": float(lengths.max()),
        "eos_fraction": float(rollout.ended_with_eos.float().mean()),
        **learned_metrics,
        "time/generate": generated - started,
        "time/reward": scored - generated,
        "time/learn": finished - scored,
        "time/step": finished - started,
        "tokens_per_second": (prompt_tokens + completion_tokens) / (finished - started),
    }
    return record


def train(cfg: Config, log: Callable[[str], None] = print) -> dict:
    from ..games import GAMES

    if cfg.task.name in GAMES:  # a tensor policy, not a language model: the small loop in policy_loop.py
        from .policy_loop import train_policy

        return train_policy(cfg, log)
    session = prepare(cfg, log)  # raises on bad input before anything is written
    reference = Reference(session.policy) if cfg.algo.beta > 0 else None
    learner = Learner(session.policy, cfg, reference)
    sampler = PromptSampler(session.task.train_rows, cfg.train.seed)
    run = RunDir.create(cfg)
    progress = Progress(cfg.train.steps, cfg.output.progress)
    progress.message(f"run directory: {run.path}")

    evals = {}
    if cfg.eval.at_start and cfg.eval.num_examples:
        evals[0] = run_eval(session, run, progress, 0)
    for step in range(1, cfg.train.steps + 1):
        record = grpo_step(session, learner, sampler, step)
        run.log_step(record)
        progress.update(step, record)
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps and cfg.eval.num_examples:
            evals[step] = run_eval(session, run, progress, step)
        if cfg.output.save_every and step % cfg.output.save_every == 0 and step != cfg.train.steps:
            run.save_checkpoint(session.policy.model, session.policy.tokenizer, step)
    if cfg.eval.num_examples and cfg.train.steps not in evals:
        evals[cfg.train.steps] = run_eval(session, run, progress, cfg.train.steps)
    checkpoint = run.save_checkpoint(session.policy.model, session.policy.tokenizer, None)
    progress.close()

    summary = {"run_dir": str(run.path), "checkpoint": str(checkpoint), "steps": cfg.train.steps}
    if evals:
        first, last = evals[min(evals)], evals[max(evals)]
        summary["eval_before"], summary["eval_after"] = first, last
    run.write_summary(summary)
    if cfg.output.plot:
        run.plot()
    return summary
