"""One-step off-policy pipeline (algo.async_steps=1): generate step t+1 while step t learns.

The "Async-GRPO" row of the code-GRPO seed: generation, rewards and
learning overlap. At step t:

    1. take batch t (started during step t-1 in the background; step 1 and the
       first step after a resume generate it here)
    2. copy the policy's current weights (after step t-1's update) into the
       sampling copy, and start generating + scoring batch t+1 from them on a
       background thread
    3. learn on batch t, which was sampled from the weights after step t-2:
       one update stale. The clipped ratio is taken against the batch's own
       sampling log-probs (off-policy PPO), and the mismatch is logged
       (async/logp_abs_diff, async/ratio_mean, async/ratio_max, async/staleness)

Why a second copy of the weights: the optimizer updates the policy in place
while batch t+1 is being sampled, and the lean engine shares tensors
(norms, embeddings) with the policy; sampling from a frozen copy keeps
every draw exact. It costs one model's memory and one weight copy per step.

What it buys depends on the hardware. On a GPU with a second device or a
vLLM server the halves run on different silicon and overlap; on a 2-core
CPU they compete for the same cores (docs/results/speedups-notes.md has the measurement).
What it changes: learning is one update off-policy, so it is not the
synchronous run's result (algo.async_steps=0 is, bit for bit).

Checkpoints stay exact: `state_dict()` waits for the batch in flight and
stores it (rows as indices, rollout, scores), so a resumed run learns from
the very batch the uninterrupted run would have.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
from typing import Any, Callable

import torch

from ..models import Policy
from ..rewards import RewardScores
from ..rewards.batch import ScoredBatch, reward_inputs
from ..rollout import Engine, Rollout, SamplingParams


class AsyncRollouts:
    """The sampling copy of the policy, its engine, and the batch being generated in the background."""

    def __init__(self, policy: Policy, make_engine: Callable[[Policy], Engine],
                 collect: Callable[[Engine, int], Any], rows: list[dict]):
        self.policy = policy
        self.shadow = copy.deepcopy(policy.model).eval()  # the weights the next batch is sampled from
        for parameter in self.shadow.parameters():
            parameter.requires_grad_(False)
        self.engine = make_engine(dataclasses.replace(policy, model=self.shadow))
        self.collect = collect  # collect(engine, step) -> trainer.Collected
        self.rows = rows  # the task's training rows: batches are checkpointed as indices into them
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "hasten-async")
        self.pending: tuple[int, concurrent.futures.Future] | None = None

    def take(self, step: int):
        """Batch `step`: the background one if it was started for this step, else generated now."""
        if self.pending is not None:
            pending_step, future = self.pending
            self.pending = None
            if pending_step != step:
                raise RuntimeError(f"async pipeline: batch for step {pending_step} in flight, step {step} asked")
            return future.result()
        self._sync_weights()
        return self.collect(self.engine, step)

    def start(self, step: int) -> None:
        """Sample and score batch `step` in the background from the policy's weights as they are now."""
        self._sync_weights()
        self.pending = (step, self.executor.submit(self.collect, self.engine, step))

    @torch.no_grad()
    def _sync_weights(self) -> None:
        for shadow, current in zip(self.shadow.parameters(), self.policy.model.parameters()):
            shadow.copy_(current)
        self.engine.weights_changed()

    def state_dict(self, tokenizer) -> dict[str, Any]:
        """The batch in flight (waited for), as plain tensors and row indices; {} when none."""
        if self.pending is None:
            return {}
        step, future = self.pending
        collected = future.result()
        self.pending = (step, future)
        index = {id(row): i for i, row in enumerate(self.rows)}
        return {"step": step, "rounds": [_batch_state(b, index) for b in collected.rounds],
                "batch": None if collected.batch is None else _batch_state(collected.batch, index),
                "dynamic": dict(collected.dynamic)}

    def load_state_dict(self, state: dict[str, Any], tokenizer, make_collected: Callable) -> None:
        if not state:
            return
        rounds = [_batch_from_state(b, self.rows, tokenizer) for b in state["rounds"]]
        batch = None if state["batch"] is None else _batch_from_state(state["batch"], self.rows, tokenizer)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(make_collected(rounds, batch, dict(state["dynamic"])))
        self.pending = (int(state["step"]), done)

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_logprobs",
                   "ended_with_eos")


def _batch_state(batch: ScoredBatch, index: dict[int, int]) -> dict[str, Any]:
    rollout = batch.rollout
    return {"rows": [index[id(row)] for row in batch.rows],
            "rollout": {name: getattr(rollout, name) for name in ROLLOUT_TENSORS},
            "num_generations": rollout.num_generations,
            "sampling": dataclasses.asdict(rollout.sampling),
            "scores": {"per_function": batch.scores.per_function, "total": batch.scores.total,
                       "names": list(batch.scores.names)},
            "metrics": dict(batch.metrics)}


def _batch_from_state(state: dict[str, Any], rows: list[dict], tokenizer) -> ScoredBatch:
    batch_rows = [rows[i] for i in state["rows"]]
    rollout = Rollout(**state["rollout"], num_generations=int(state["num_generations"]),
                      sampling=SamplingParams(**state["sampling"]))
    scores = RewardScores(state["scores"]["per_function"], state["scores"]["total"], list(state["scores"]["names"]))
    return ScoredBatch(batch_rows, rollout, reward_inputs(tokenizer, batch_rows, rollout), scores,
                       dict(state["metrics"]))
