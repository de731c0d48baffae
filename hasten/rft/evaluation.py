"""`hasten rft test`: held-out accuracy and answer rate, greedy and batched.

The same measurement as `hasten eval` (train/evaluate.py: the task's checker
on greedy completions of the first `eval.num_examples` held-out questions),
with the RFT defaults: 100 held-out questions, LoRA adapters merged into the
base weights first so the lean engine generates (a peft model would fall
back to the slower transformers forward; merging does not change the
function the model computes beyond float rounding). A tool task (calculator)
is evaluated through its tool loop, as `hasten eval` does.
"""

from __future__ import annotations

import time
from typing import Callable

from .. import ticker
from ..agent import make_agent
from ..config import Config
from ..tasks import Task, make_task
from ..train.evaluate import evaluate
from ..rollout.factory import make_engine
from .prompts import load_generator


def evaluate_policy(cfg: Config, policy, task: Task, log: Callable[[str], None], engine=None) -> dict[str, float]:
    """Greedy held-out metrics of an in-memory policy (merged in place if it carries LoRA adapters).

    engine: one already made on this policy's merged weights (load_generator's), so its choices are made
    and said once (issue 56: `rft test` printed the engine_weights line twice)."""
    if hasattr(policy.model, "merge_and_unload"):
        policy.model = policy.model.merge_and_unload()
        engine = None  # made on the adapters' wrapper: the merged model needs its own
    ticker.configure(cfg.output.progress)  # the eval's count (train/evaluate.py) in the run's progress mode
    policy.model.eval()
    engine = engine if engine is not None else make_engine(cfg, policy, log)
    parts = make_agent(cfg, task)  # a tool task: the tool loop generates, as in `hasten train`'s evals
    agent = parts.build(policy.tokenizer, policy.pad_token_id) if parts is not None else None
    started = time.perf_counter()
    count = min(cfg.eval.num_examples, len(task.eval_rows))
    try:
        metrics, _ = evaluate(task, engine, policy.tokenizer, [], count, cfg.eval.max_new_tokens,
                              cfg.eval.batch_size, agent=agent)
    finally:
        if agent is not None:
            agent.close()
    metrics["seconds"] = time.perf_counter() - started
    return metrics


def run_test(cfg: Config, log: Callable[[str], None] = print) -> dict[str, float]:
    task = make_task(cfg.task)
    policy, engine = load_generator(cfg, log)  # merged already: its engine serves the eval
    return evaluate_policy(cfg, policy, task, log, engine)
