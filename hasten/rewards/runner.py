"""Load and run reward functions with TRL's calling convention.

A reward function is `fn(prompts, completions, **kwargs) -> list[float | None]`,
exactly as TRL's GRPOTrainer calls it, so a TRL user's functions work here
unchanged:

- `prompts`: one entry per sample, as stored in the dataset row (a string, or
  a list of chat messages).
- `completions`: strings for string prompts; for conversational prompts each
  is `[{"role": "assistant", "content": text}]`.
- kwargs: every other dataset column as a per-sample list, plus
  `completion_ids` (a list of token-id lists), plus what the trainer adds as
  TRL 1.16 does (`extra`): `trainer_state` (global_step, max_steps, ...),
  `log_metric(name, value)` and `log_extra(column, values)`.
- `None` means "does not apply to this sample". The total reward is TRL's
  `nansum(per_function * weights)`; a sample no function scored is marked
  unscorable (`RewardScores.scorable`): TRL, and the trainer here, leave it
  out of its group's statistics and give it advantage 0.

Choices: each function is called once on the whole batch; coroutine functions
run concurrently under one `asyncio.run`, sync ones are called directly. When
a function raises, it is re-run one sample at a time to name the sample that
breaks it (index and the prompt's first characters), because "failed on the
batch" rarely tells a user what to fix; a function that fails only on several
samples together is named with the shortest failing run of samples.
Nothing here prints; problems surface as `RewardError` with a one-line message,
and a sample no function scored is TRL's logging warning ("All reward functions
returned None for the following kwargs: ...") on the "hasten.rewards" logger.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Coroutine

import numpy
import torch

from hasten.errors import UserError
from hasten.userfiles import load_attribute, one_line as _summary


# Keyword arguments every reward function receives; a dataset column with one of
# these names would shadow them.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


class RewardError(UserError):
    """A user-facing reward problem; str() is the one-line message."""


class RewardExit(RewardError):
    """A reward function called sys.exit (or raised SystemExit): a bug in the reward, not a request
    to end the run; without this the run would end with the function's exit code and no message."""

    @classmethod
    def of(cls, function: RewardFunction, code: Any) -> RewardExit:
        return cls(f"reward error: function '{function.name}' called sys.exit({code!r}) "
                   "(a reward function must return its scores, not exit)")


@contextlib.contextmanager
def _no_exit(function: RewardFunction):
    """Turn a SystemExit raised by `function` into RewardExit, an ordinary exception: it then travels
    like any other through asyncio.gather, thread and process pool futures (which re-raise SystemExit)."""
    try:
        yield
    except SystemExit as exc:
        raise RewardExit.of(function, exc.code) from None


@dataclass
class RewardFunction:
    name: str  # shown in logs and metrics
    fn: Callable[..., Any]
    weight: float = 1.0
    slow: bool = False  # may run in the reward worker pool (speed features)
    deterministic: bool = False  # same inputs -> same score, so results may be cached

    @property
    def is_async(self) -> bool:
        # A class instance with `async def __call__` is a coroutine function too,
        # but inspect only sees that when asked about the bound __call__.
        if inspect.iscoroutinefunction(self.fn):
            return True
        call = getattr(self.fn, "__call__", None)
        return call is not None and inspect.iscoroutinefunction(call)


@dataclass
class RewardScores:
    per_function: torch.Tensor  # (N, F) float32, NaN where a function returned None
    total: torch.Tensor  # (N,) weighted nansum over functions
    names: list[str]  # (F,) function names, column order of per_function

    @property
    def scorable(self) -> torch.Tensor:
        """(N,) bool: at least one function returned a number for the sample."""
        return ~torch.isnan(self.per_function).all(dim=1) if self.per_function.shape[1] else \
            torch.zeros(self.total.shape, dtype=torch.bool)

    @property
    def scored_total(self) -> torch.Tensor:
        """(N,) the total, NaN for unscorable samples: what advantages and reward statistics use (TRL)."""
        return torch.where(self.scorable, self.total, torch.full_like(self.total, math.nan))

    def means(self) -> dict[str, float]:
        """Mean score per function over the samples it applied to (NaN if none)."""
        result: dict[str, float] = {}
        for column, name in enumerate(self.names):
            values = self.per_function[:, column]  # (N,)
            applied = ~torch.isnan(values)
            result[name] = float(values[applied].mean()) if applied.any() else math.nan
        return result

    def stds(self) -> dict[str, float]:
        """Standard deviation per function over the samples it applied to (NaN if fewer than 2)."""
        result: dict[str, float] = {}
        for column, name in enumerate(self.names):
            values = self.per_function[:, column]
            values = values[~torch.isnan(values)]
            result[name] = float(values.std()) if values.numel() > 1 else math.nan
        return result


# ------------------------------------------------------------------- loading


def load_reward(spec: str) -> RewardFunction:
    """'path/to/file.py:function' or 'package.module:function' -> RewardFunction named after the function;
    a model directory or hub id -> a reward model (reward_model.py), as TRL takes one."""
    from hasten.rewards.reward_model import is_model_spec, load_reward_model

    if is_model_spec(spec):
        model = load_reward_model(spec)
        return RewardFunction(name=model.__name__, fn=model, deterministic=True)
    path_text, separator, function_name = spec.rpartition(":")
    if not separator or not path_text or not function_name:
        raise RewardError(f"reward error: spec '{spec}' must look like path/to/file.py:function "
                          "or package.module:function")
    path = Path(path_text)
    if not path.is_file() and not path_text.endswith(".py") and "/" not in path_text:
        return _load_module_reward(path_text, function_name)
    fn = load_attribute(path_text, function_name, "reward", RewardError, what="function")
    if not callable(fn):
        raise RewardError(f"reward error: {path_text}:{function_name} is not callable")
    return RewardFunction(name=function_name, fn=fn)


def _load_module_reward(module_name: str, function_name: str) -> RewardFunction:
    """An importable module's function ('my_rewards.format:reward')."""
    import importlib

    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ModuleNotFoundError, or whatever the module raises at import
        raise RewardError(f"reward error: cannot import module '{module_name}': {_summary(exc)}") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise RewardError(f"reward error: module '{module_name}' has no function '{function_name}'")
    return RewardFunction(name=function_name, fn=fn)


# ------------------------------------------------------------------- scoring


def score_rewards(
    functions: list[RewardFunction],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    completion_ids: list[list[int]],
    extra: dict[str, Any] | None = None,
) -> RewardScores:
    """Call every function once on the batch; return per-function and total scores.

    extra: keyword arguments passed as they are (trainer_state, log_metric, log_extra).
    """
    count = len(completions)
    if len(prompts) != count or len(completion_ids) != count:
        raise RewardError(
            f"reward error: got {len(prompts)} prompts, {count} completions and "
            f"{len(completion_ids)} completion_ids (they must match)"
        )
    for column, values in columns.items():
        if column in RESERVED_COLUMNS:
            raise RewardError(
                f"reward error: a dataset column may not be named '{column}' (reserved for rewards)"
            )
        if len(values) != count:
            raise RewardError(
                f"reward error: column '{column}' has {len(values)} values for {count} samples"
            )
    batch = RewardBatch(prompts, completions, columns, completion_ids, dict(extra or {}))
    outcomes = call_all(functions, batch)

    per_function = torch.full((count, len(functions)), math.nan, dtype=torch.float32)  # (N, F)
    for column, (function, outcome) in enumerate(zip(functions, outcomes)):
        if isinstance(outcome, BaseException):
            raise locate_failure(function, batch, outcome)
        values = validate_scores(function.name, outcome, count)
        per_function[:, column] = torch.tensor(values, dtype=torch.float32)

    weights = torch.tensor([f.weight for f in functions], dtype=torch.float32)  # (F,)
    total = torch.nansum(per_function * weights, dim=1)  # (N,)
    unscored = torch.isnan(per_function).all(dim=1) if functions else torch.zeros(count, dtype=torch.bool)
    if unscored.any():
        _warn_unscored(batch, int(unscored.nonzero()[0, 0]))
    return RewardScores(per_function=per_function, total=total, names=[f.name for f in functions])


def _warn_unscored(batch: RewardBatch, index: int) -> None:
    """TRL's warning (its words: scripts and tests match them) for a sample no function scored; it is
    left out of its group's statistics (advantages.py)."""
    import logging

    row = {name: values[index] for name, values in batch.columns.items()}
    row.update(completion_ids=batch.completion_ids[index], prompt=batch.prompts[index],
               completion=batch.completions[index])
    logging.getLogger("hasten.rewards").warning(
        f"All reward functions returned None for the following kwargs:\n{row}\n"
        "Please ensure that at least one reward function returns a valid reward.")


@dataclass
class RewardBatch:
    """The arguments of one reward call, sliceable to a single sample."""

    prompts: list
    completions: list
    columns: dict[str, list]
    completion_ids: list[list[int]]
    extra: dict[str, Any] = field(default_factory=dict)  # whole-batch arguments (trainer_state, log_metric, ...)

    def kwargs(self) -> dict[str, Any]:
        # Everything is a keyword argument, as TRL passes it.
        return {
            "prompts": self.prompts,
            "completions": self.completions,
            "completion_ids": self.completion_ids,
            **self.columns,
            **self.extra,
        }

    def sample(self, index: int) -> RewardBatch:
        return self.select([index])

    def select(self, positions: list[int]) -> RewardBatch:
        """The samples at `positions`, in that order."""
        return RewardBatch(
            prompts=[self.prompts[i] for i in positions],
            completions=[self.completions[i] for i in positions],
            columns={name: [values[i] for i in positions] for name, values in self.columns.items()},
            completion_ids=[self.completion_ids[i] for i in positions],
            extra=self.extra,
        )


def call_all(functions: list[RewardFunction], batch: RewardBatch) -> list[Any]:
    """Each function's return value, or the exception it raised."""
    outcomes: list[Any] = [None] * len(functions)
    asynchronous = [i for i, f in enumerate(functions) if f.is_async]
    for index, function in enumerate(functions):
        if index in asynchronous:
            continue
        try:
            with _no_exit(function):
                outcomes[index] = function.fn(**batch.kwargs())
        except Exception as exc:
            outcomes[index] = exc
    if asynchronous:

        async def call(function: RewardFunction) -> Any:
            # Calling inside the coroutine, so that even a bad signature is
            # caught by gather rather than escaping as a bare TypeError.
            with _no_exit(function):
                return await function.fn(**batch.kwargs())

        async def gather() -> list[Any]:
            calls = [call(functions[i]) for i in asynchronous]
            return await asyncio.gather(*calls, return_exceptions=True)

        for index, outcome in zip(asynchronous, _run_coroutine(gather())):
            outcomes[index] = outcome
    return outcomes


def call_one(function: RewardFunction, batch: RewardBatch) -> Any:
    """One call of `function` on `batch` (also what the reward pool's workers run)."""
    if function.is_async:

        async def call() -> Any:
            with _no_exit(function):
                return await function.fn(**batch.kwargs())

        return _run_coroutine(call())
    with _no_exit(function):
        return function.fn(**batch.kwargs())


def _run_coroutine(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """asyncio.run, or the same on a helper thread when a loop already runs here (notebooks)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def locate_failure(function: RewardFunction, batch: RewardBatch, error: BaseException,
                    indices: list[int] | tuple[int, ...] | None = None) -> RewardError:
    """Re-run one sample at a time to find which sample makes `function` raise.

    indices: the batch positions of `batch`'s samples as the user knows them (`batch` may be a part).
    """
    if not isinstance(error, Exception):
        # KeyboardInterrupt and the like are not reward bugs (a reward's SystemExit is RewardExit by now).
        raise error
    if isinstance(error, RewardExit):  # says it all; re-running would only exit again
        return error
    positions = list(range(len(batch.completions)))
    return name_failure(function, error, batch.prompts, list(indices) if indices is not None else positions,
                        lambda chosen: call_one(function, batch.select(chosen)))


def name_failure(function: RewardFunction, error: Exception, prompts: list, indices: list[int],
                 call: Callable[[list[int]], Any]) -> RewardError:
    """The one-line error naming the sample that makes `function` raise, its index and its prompt's start.

    prompts[i] and indices[i] belong to the i-th sample of the failed call; call(positions) re-runs the
    function on those samples (positions into prompts). Each sample is tried alone first. When every one
    passes alone (a function that breaks only on a batch, e.g. on samples of unequal lengths), a binary
    search over prefixes finds the shortest failing one, ceil(log2 n) more calls, and the error names its
    last sample, the one whose addition breaks it.
    """
    for position, index in enumerate(indices):
        try:
            call([position])
        except Exception as sample_error:
            result = RewardError(f"reward error: function '{function.name}' failed on sample {index} "
                                 f"({_prompt_start(prompts[position])}): {_summary(sample_error)}")
            result.__cause__ = sample_error
            return result
    passing, failing = 1, len(indices)  # the first sample alone passes; the whole call fails
    while failing - passing > 1:
        middle = (passing + failing) // 2
        try:
            call(list(range(middle)))
        except Exception as prefix_error:
            failing, error = middle, prefix_error
        else:
            passing = middle
    last = failing - 1
    result = RewardError(
        f"reward error: function '{function.name}' failed on samples {indices[0]} to {indices[last]} together, "
        f"though each passes alone (sample {indices[last]}: {_prompt_start(prompts[last])}): {_summary(error)}")
    result.__cause__ = error
    return result


def _prompt_start(prompt: Any, width: int = 40) -> str:
    """'prompt "What is 12 + 7? ..."': the prompt's first characters (a chat prompt's last message's)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    text = " ".join(str(prompt).split())
    return f'prompt "{text[:width]}{"..." if len(text) > width else ""}"'


def validate_scores(name: str, values: Any, count: int) -> list[float]:
    """A function's return as floats (NaN for None), or RewardError saying what is wrong."""
    expected = f"(expected a list of {count} floats or None)"
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward error: function '{name}' returned {type(values).__name__} {expected}")
    if len(values) != count:
        raise RewardError(f"reward error: function '{name}' returned {len(values)} values {expected}")
    result: list[float] = []
    for index, value in enumerate(values):
        if value is None:
            result.append(math.nan)
            continue
        # Zero-dimensional tensors and numpy scalars (np.bool_ is not a numbers.Real).
        if isinstance(value, torch.Tensor) and value.dim() == 0 or isinstance(value, numpy.generic):
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward error: function '{name}' returned {type(value).__name__} "
                f"at sample {index} {expected}"
            )
        number = float(value)
        if not math.isfinite(number):
            raise RewardError(
                f"reward error: function '{name}' returned {number} at sample {index} "
                "(rewards must be finite; return None to skip a sample)"
            )
        result.append(number)
    return result
