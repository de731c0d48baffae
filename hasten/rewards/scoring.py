"""Reward scoring with the pool, the cache and the gate: `RewardScorer.start(...).join()`.

The contract is runner.score_rewards': every function is called with TRL's
arguments, returns one float or None per sample, and the total is the
weighted nansum. Without a gate the scores are exactly score_rewards'
(tests/test_speed_rewards.py checks it); the order of work is what changes:

    1. the gate function, if any, on every sample (inline; cached if deterministic)
    2. cache lookups for deterministic functions: only misses are computed
    3. slow functions' misses submitted to the pool, in slices
    4. fast functions' misses called inline (async ones concurrently), while 3 runs
    5. join: slices in order, scores validated, cache filled, totals formed

Flags come from RewardFunction.slow / .deterministic (set by hasten's own
rewards), the same attributes on a user's function (`my_reward.slow = True`
in the reward file), or speed.slow_rewards / speed.cache_rewards by name.

A function that is not called on every sample (cache hits, gated samples) is
called on the subset, which assumes each sample is scored on its own: true of
per-sample rewards, and declared by flagging a function slow or
deterministic. Unflagged functions always see the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import AlgoConfig, ConfigError, SpeedConfig
from .runner import (
    RewardBatch,
    RewardError,
    RewardFunction,
    RewardScores,
    call_all,
    locate_failure,
    score_rewards,
    validate_scores,
)
from .early_stop import apply_gate, passed_samples
from .reward_cache import MISSING, RewardCache, sample_key
from .reward_pool import RewardPool, Slice, join, slice_batch


@dataclass
class PendingScores:
    """Scores being computed; `join()` returns RewardScores (and fills `metrics`)."""

    scorer: RewardScorer
    batch: RewardBatch
    values: list[list[float]]  # (F, N) scores so far, NaN = None or not scored
    slices: dict[int, list[Slice]]  # function index -> pool slices in flight
    passed: list[bool] | None  # gate verdict per sample, None = no gate
    keys: list[list[tuple] | None] = field(default_factory=list)  # per function: cache keys, None = not cached
    metrics: dict[str, float] = field(default_factory=dict)
    result: RewardScores | None = None

    def join(self) -> RewardScores:
        if self.result is None:
            self.result = self.scorer._finish(self)
        return self.result


def flagged(function: RewardFunction, flag: str) -> bool:
    """RewardFunction.<flag>, or the same attribute set on the user's function (`my_reward.slow = True`)."""
    return bool(getattr(function, flag)) or getattr(function.fn, flag, False) is True


class RewardScorer:
    """Scores reward functions per speed.* settings and algo's gate; one per run (it owns the pool and the cache).

    The gate (algo.gate_reward) changes what is learned, so it is an `algo` key; None = no gate."""

    def __init__(self, functions: list[RewardFunction], speed: SpeedConfig, algo: AlgoConfig | None = None):
        algo = algo if algo is not None else AlgoConfig()
        self.functions = functions
        names = [f.name for f in functions]
        for key in ("slow_rewards", "cache_rewards"):
            unknown = [name for name in getattr(speed, key) if name not in names]
            if unknown:
                raise ConfigError(f"config error: speed.{key} names {', '.join(unknown)}, "
                                  f"not a reward function of this run ({', '.join(names)})")
        if algo.gate_reward is not None and algo.gate_reward not in names:
            raise ConfigError(f"config error: algo.gate_reward '{algo.gate_reward}' is not a reward function "
                              f"of this run ({', '.join(names)})")
        self.speed, self.algo = speed, algo
        self.gate = names.index(algo.gate_reward) if algo.gate_reward is not None else None
        self.slow = [speed.reward_workers > 0 and (flagged(f, "slow") or f.name in speed.slow_rewards)
                     for f in functions]
        self.cached = [speed.reward_cache and (flagged(f, "deterministic") or f.name in speed.cache_rewards)
                       for f in functions]
        self.pool = RewardPool(speed.reward_workers, speed.reward_pool) if any(self.slow) else None
        for function, slow in zip(functions, self.slow):
            if slow:
                self.pool.check(function)
        self.cache = RewardCache(speed.reward_cache_size) if any(self.cached) else None

    @property
    def plain(self) -> bool:
        """True when nothing here applies: score_rewards is the whole story."""
        return self.gate is None and not any(self.slow) and not any(self.cached)

    def start(self, prompts: list, completions: list, columns: dict[str, list],
              completion_ids: list[list[int]], extra: dict | None = None) -> PendingScores:
        """extra: whole-batch keyword arguments for every function (trainer_state, log_metric, log_extra)."""
        batch = RewardBatch(prompts, completions, columns, completion_ids, dict(extra or {}))
        if self.plain:
            pending = PendingScores(self, batch, [], {}, None)
            pending.result = score_rewards(self.functions, prompts, completions, columns, completion_ids, extra)
            return pending
        _check(prompts, completions, columns, completion_ids)
        count = len(completions)
        values = [[math.nan] * count for _ in self.functions]  # (F, N), NaN = not scored (yet)
        todo = [list(range(count)) for _ in self.functions]
        keys = [self._keys(index, batch) for index in range(len(self.functions))]
        passed = None
        if self.gate is not None:
            self._lookup(self.gate, keys, todo, values)
            self._call_inline([self.gate], batch, todo, values, keys)
            passed = passed_samples(values[self.gate], self.algo.gate_threshold)
            todo = [indices if index == self.gate else [i for i in indices if passed[i]]
                    for index, indices in enumerate(todo)]
        others = [index for index in range(len(self.functions)) if index != self.gate]
        for index in others:
            self._lookup(index, keys, todo, values)
        slices = {index: self.pool.submit(self.functions[index], batch, todo[index])
                  for index in others if self.slow[index] and todo[index]}
        fast = [index for index in others if index not in slices and todo[index]]
        self._call_inline(fast, batch, todo, values, keys)
        return PendingScores(self, batch, values, slices, passed, keys=keys)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    # ------------------------------------------------------------------ internals

    def _keys(self, index: int, batch: RewardBatch) -> list[tuple] | None:
        if not self.cached[index]:
            return None
        name = self.functions[index].name
        return [sample_key(name, batch.prompts[i], batch.completions[i], batch.completion_ids[i],
                           {column: values[i] for column, values in batch.columns.items()})
                for i in range(len(batch.completions))]

    def _lookup(self, index: int, keys, todo: list[list[int]], values) -> None:
        """Write cache hits into values[index]; leave only the misses in todo[index]."""
        if keys[index] is None:
            return
        misses = []
        for i in todo[index]:
            score = self.cache.get(keys[index][i])
            if score is MISSING:
                misses.append(i)
            else:
                values[index][i] = score
        todo[index] = misses

    def _call_inline(self, indices: list[int], batch: RewardBatch, todo, values, keys) -> None:
        """Call the functions `indices` now, grouped by identical sample subsets (async ones together)."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for index in indices:
            if todo[index]:
                groups.setdefault(tuple(todo[index]), []).append(index)
        for subset, members in groups.items():
            part = batch if len(subset) == len(batch.completions) else slice_batch(batch, list(subset))
            functions = [self.functions[index] for index in members]
            for index, outcome in zip(members, call_all(functions, part)):
                if isinstance(outcome, BaseException):
                    raise locate_failure(self.functions[index], part, outcome, indices=subset)
                scores = validate_scores(self.functions[index].name, outcome, len(subset))
                self._store(index, list(subset), scores, values, keys)

    def _store(self, index: int, subset: list[int], scores: list[float], values, keys) -> None:
        for i, score in zip(subset, scores):
            values[index][i] = score
            if keys[index] is not None:
                self.cache.put(keys[index][i], score)

    def _finish(self, pending: PendingScores) -> RewardScores:
        values, batch = pending.values, pending.batch
        for index, slices in pending.slices.items():
            scores = join(self.functions[index], batch, slices)
            self._store(index, [i for part in slices for i in part.indices], scores, values, pending.keys)
        count = len(batch.completions)
        per_function = torch.tensor(values, dtype=torch.float32).T.contiguous()  # (N, F)
        weights = torch.tensor([f.weight for f in self.functions], dtype=torch.float32)  # (F,)
        total = torch.nansum(per_function * weights, dim=1)  # (N,)
        if pending.passed is not None:
            total = apply_gate(total, pending.passed, self.algo.gate_failed_reward)
            pending.metrics["rewards/gate_failed"] = 1 - sum(pending.passed) / max(count, 1)
        if self.cache is not None:
            pending.metrics["reward_cache/hit_rate"] = self.cache.hit_rate
            pending.metrics["reward_cache/size"] = len(self.cache.entries)
        return RewardScores(per_function=per_function, total=total,
                            names=[f.name for f in self.functions])


def _check(prompts, completions, columns, completion_ids) -> None:
    """The same input checks as score_rewards, with the same one-line errors."""
    from .runner import RESERVED_COLUMNS

    count = len(completions)
    if len(prompts) != count or len(completion_ids) != count:
        raise RewardError(f"reward error: got {len(prompts)} prompts, {count} completions and "
                          f"{len(completion_ids)} completion_ids (they must match)")
    for column, values in columns.items():
        if column in RESERVED_COLUMNS:
            raise RewardError(f"reward error: a dataset column may not be named '{column}' (reserved for rewards)")
        if len(values) != count:
            raise RewardError(f"reward error: column '{column}' has {len(values)} values for {count} samples")


@dataclass
class RewardState:
    """trainer_state for reward functions on the CLI path (the Python API passes its TrainerState):
    the fields of transformers' TrainerState a reward schedule reads."""

    global_step: int = 0  # optimizer steps completed
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list = field(default_factory=list)


class RewardLogs:
    """TRL 1.16's reward-function keyword arguments `trainer_state`, `log_metric`, `log_extra`.

    log_metric(name, value): the step's record gets the mean of the values under `name`.
    log_extra(column, values): one value per sample, added to the step's logged completions.
    Both are drained once per step; thread-pool rewards may call them concurrently (list appends).
    """

    def __init__(self, state: Any):
        self.state = state
        self.metrics: dict[str, list[float]] = {}
        self.columns: dict[str, list] = {}

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        self.columns.setdefault(column, []).extend(values)

    def kwargs(self) -> dict[str, Any]:
        return {"trainer_state": self.state, "log_metric": self.log_metric, "log_extra": self.log_extra}

    def drain(self) -> tuple[dict[str, float], dict[str, list]]:
        metrics = {name: sum(values) / len(values) for name, values in self.metrics.items() if values}
        columns, self.metrics, self.columns = self.columns, {}, {}
        return metrics, columns
