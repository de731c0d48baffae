"""Reward pool (speed.reward_workers, speed.reward_pool): slow reward functions off the main thread.

A slow function (RewardFunction.slow, or its name in speed.slow_rewards) is
called on contiguous slices of the batch, one slice per worker, and the
slices are submitted at once; the trainer then scores the fast functions
inline and joins the slices before the advantages. Results are put back in
sample order, so the scores equal a serial call's exactly, provided the
function scores each sample on its own (which is what flagging it slow
declares; a function that normalizes over the batch must stay fast).

Threads suit what slow rewards usually wait on (a subprocess running tests,
a network call): the GIL is released while they wait. CPU-bound pure-Python
rewards need processes (speed.reward_pool=process, fork start method, the
function must pickle); on a 2-core machine they then compete with torch for
the same cores.

A slice that raises is re-run one sample at a time on the main thread, so
the error names the function and the batch index of the sample, as the plain
runner does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import pickle
from dataclasses import dataclass

from hasten.userfiles import one_line as _summary

from .runner import RewardBatch, RewardError, RewardExit, RewardFunction, call_one, name_failure


@dataclass
class Slice:
    """One submitted call: `indices` are the batch indices it scores, in order."""

    indices: list[int]
    future: concurrent.futures.Future


def slice_batch(batch: RewardBatch, indices: list[int]) -> RewardBatch:
    """The samples `indices` of `batch`, in that order."""
    return RewardBatch(
        prompts=[batch.prompts[i] for i in indices],
        completions=[batch.completions[i] for i in indices],
        columns={name: [values[i] for i in indices] for name, values in batch.columns.items()},
        completion_ids=[batch.completion_ids[i] for i in indices],
        extra=batch.extra,
    )


class RewardPool:
    """A fixed pool of `workers` threads or processes, alive for the whole run."""

    def __init__(self, workers: int, kind: str = "thread"):
        self.workers = workers
        self.kind = kind
        if kind == "process":
            context = multiprocessing.get_context("fork")  # the user's reward module is already imported
            self.executor = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
        else:
            self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hasten-reward")

    def check(self, function: RewardFunction) -> None:
        """Raise RewardError now if `function` cannot run in this pool (processes need pickling)."""
        if self.kind != "process":
            return
        try:
            pickle.dumps(function)
        except Exception as error:
            raise RewardError(
                f"reward error: function '{function.name}' cannot run in a process pool ({_summary(error)}); "
                "use speed.reward_pool=thread"
            ) from None

    def submit(self, function: RewardFunction, batch: RewardBatch, indices: list[int]) -> list[Slice]:
        """Start `function` on the samples `indices`, split in up to `workers` contiguous slices."""
        count = min(self.workers, len(indices))
        if self.kind == "process":  # log_metric / log_extra are closures over this process: they cannot cross
            batch = dataclasses.replace(batch, extra={key: value for key, value in batch.extra.items()
                                                      if not callable(value)})
        bounds = [len(indices) * part // count for part in range(count + 1)]
        slices = []
        for start, stop in zip(bounds, bounds[1:]):
            part = indices[start:stop]
            slices.append(Slice(part, self.executor.submit(call_one, function, slice_batch(batch, part))))
        return slices

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def join(function: RewardFunction, batch: RewardBatch, slices: list[Slice]) -> list:
    """The slices' return values concatenated in sample order; RewardError naming the sample on failure."""
    from .runner import validate_scores

    values: list = []
    for part in slices:
        try:
            outcome = part.future.result()
        except Exception as error:
            raise locate(function, batch, part.indices, error) from error
        values += validate_scores(function.name, outcome, len(part.indices))
    return values


def locate(function: RewardFunction, batch: RewardBatch, indices: list[int], error: Exception) -> RewardError:
    """Re-run the slice one sample at a time (main thread) to name the sample that raises."""
    if isinstance(error, RewardExit):  # the worker's call already said which function exited
        return RewardExit(str(error))
    return name_failure(function, error, [batch.prompts[i] for i in indices], indices,
                        lambda positions: call_one(function, slice_batch(batch, [indices[p] for p in positions])))
