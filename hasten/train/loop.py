"""The outer loop every training job runs: steps, evals, checkpoints, signals, summary.

GRPO (trainer.py), the game policy (policy_loop.py) and SFT (rft/sft.py)
are each a `Job`: what one step does, how to evaluate, how to save and
restore the model and the job's state. Everything around the steps is here,
once:

    evals        at the start (job.eval_at_start), every job.eval_every steps, at the end
    checkpoints  full state, every output.save_every steps and whenever
                 output.save_minutes of wall-clock passed since the last one, plus
                 the final checkpoint/; output.save_total_limit keeps the newest N
    resume       `run(..., resume_from=checkpoint)`: the model and job state, the
                 step, python's and torch's RNGs are restored, and metrics.jsonl /
                 eval.jsonl are cut back to what they held at that checkpoint, so
                 the resumed run continues bit-identically (tests/test_resume.py) where it
                 uses the same threads per phase (docs/operations.md). A run killed after
                 its final save but before its summary resumes from checkpoint/ to write it
    signals      SIGINT / SIGTERM / SIGHUP (the terminal closed, treated as SIGTERM): the
                 current step finishes, a checkpoint and the summary are written, and the
                 run returns status "interrupted" (the CLI exits 130 / 143 / 129). After a
                 SIGHUP a terminal's stdout and stderr go to /dev/null: writing to a hung-up
                 terminal fails, and summary.json holds the end. A second signal stops at once
                 (`Interrupted`), through every `finally`: the job's pools and
                 threads are always closed. During the final eval (the model is
                 saved) the first signal stops at once; a resume runs that eval.
                 What a signal does is said through `log` when output.progress is off
    owner        open_run (opening.py) takes an flock on <run>/.lock (integrity.py): a second writer of
                 the run fails in one line naming the owner's pid, before writing anything;
                 a run one may not write (another user's), or a disk already full when a
                 fresh run starts, is one line too, and a fresh half-made directory is removed
    integrity    every checkpoint holds manifest.json (sha256 of its files); --resume RUN_DIR
                 takes the newest whole one, saying which damaged ones it passed over
    torchrun     rank 0 alone writes the run directory (the others follow it, distributed.py),
                 every rank restores on resume, and a signal on any rank stops all after
                 the same step: every choice that decides whether a rank saves, evaluates or
                 stops is made once for all ranks (agreed, or rank 0's), because under FSDP
                 those are collectives. torchrun forwards SIGINT/SIGTERM to every worker and
                 exits 1 itself (docs/distributed.md; tests/test_fsdp.py)
    failure      a run that fails before its first step completed removes its
                 fresh directory (nothing half-written is left); a later failure
                 keeps it, summary.json saying status "failed" and why; a full disk or a
                 failed allocation is one line naming it and the last whole checkpoint
                 (resources.py), with room kept in <run>/.reserve for that summary
    hooks        `run(..., callbacks=[Hook, ...])`: experiment trackers (tracking.py)
                 and the Python API's TrainerCallbacks hear of the start, each step's
                 record, evals, saves and the end; a hook's on_step returning True
                 stops the run after that step (status "stopped", a checkpoint saved)

What a checkpoint's trainer_state.pt holds: {"step", "job" (the job's
state_dict: optimizer, schedule, scaler, sampler ...), "rng" (python, torch),
"logs" (byte offsets of the two logs)}. It is read back with
torch.load(weights_only=True): plain tensors and containers only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..config import Config
from ..console import record_to
from ..errors import Interrupted
from ..kernels.allocator import loaded as loaded_allocator
from ..tasks.sampler import as_random_state
from ..ticker import Ticker
from . import distributed, opening
from .integrity import write_manifest
from .outputs import STATE_FILE, STATE_SUMMARY, CheckpointError, OutOfSpace, RunDir, quoted
from .progress import Progress
from .resources import ResourceExhausted, exhausted

# opening a run directory lives in opening.py; its names stay reachable here for the loop's callers
from .opening import RESUME_OVERRIDES, check_resume, discard_unstarted, find_checkpoint, open_run  # noqa: F401
from .opening import permission_denied, resume_config  # noqa: F401


class Job(Protocol):
    """One kind of training, as the loop sees it."""

    total_steps: int
    resume_command: str  # "hasten train --resume": what the user runs to continue
    eval_at_start: bool
    eval_every: int  # 0 = only at the start (if eval_at_start) and the end

    def step(self, step: int) -> dict[str, Any]: ...  # run step `step` (1-based); its metrics record

    def evaluate(self, step: int, run: RunDir) -> dict[str, Any] | None: ...  # None: this job has no eval

    def save_model(self, directory: Path) -> None: ...  # the model files (HF format for language models)

    def state_dict(self) -> dict[str, Any]: ...  # optimizer, schedule, sampler ... (torch.save-able)

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None: ...  # and the weights

    def summary(self) -> dict[str, Any]: ...  # extra summary.json fields

    def close(self) -> None: ...  # pools, threads, workers


class Hook:
    """An observer of the loop; every method is a no-op here, so a hook overrides only what it needs."""

    def on_begin(self, run: RunDir, start: int) -> None: ...  # start: the step a resumed run continues from

    def on_step(self, step: int, record: dict[str, Any]) -> bool | None: ...  # True: stop after this step

    def on_evaluate(self, step: int, metrics: dict[str, Any]) -> None: ...

    def on_save(self, step: int, checkpoint: Path) -> None: ...

    def on_end(self, summary: dict[str, Any]) -> None: ...  # also after an interrupted run

    def close(self) -> None: ...  # always, even after a failure (flush and close files)


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed; treated as SIGTERM


class Signals:
    """SIGINT/SIGTERM/SIGHUP handlers for the loop's lifetime: the first asks for a stop, the second raises."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.received: int | None = None
        self.at_once = False  # the final eval: nothing is left to save, so the first signal stops it
        self.previous: dict[int, Any] = {}
        self.terminals: list = []  # stdout/stderr where they are a terminal: after a hang-up isatty() is False

    def __enter__(self) -> Signals:
        self.terminals = [stream for stream in (sys.stdout, sys.stderr) if _is_terminal(stream)]
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for signum in SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None or self.at_once:
            raise Interrupted(signum, saved=self.at_once)
        self.received = signum
        try:
            self.log(f"{signal.Signals(signum).name}: stopping after this step and saving a checkpoint "
                     "(send it again to stop at once)")
        except OSError:  # a terminal already gone (EIO): the stop still happens
            pass
        if signum == signal.SIGHUP:
            _leave_terminal(self.terminals)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (OSError, ValueError, AttributeError):
        return False


def _leave_terminal(streams: list) -> None:
    """Point `streams` (those that were a terminal) at /dev/null: after a hang-up every write to the terminal
    fails (EIO), which would turn the orderly stop into a failure. summary.json holds what they would say."""
    for stream in streams:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):  # no descriptor any more
            pass


@dataclass
class Checkpoints:
    """When to save: output.save_every steps, output.save_minutes of wall-clock."""

    every: int
    minutes: float
    keep: int
    last_saved: float  # time.monotonic() of the last save (or the start)

    def due(self, step: int) -> bool:
        if self.every and step % self.every == 0:
            return True
        return bool(self.minutes) and time.monotonic() - self.last_saved >= self.minutes * 60


def run(job: Job, cfg: Config, run_dir: RunDir, log: Callable[[str], None] = print,
        resume_from: Path | None = None, created: bool = True, callbacks: list[Hook] | None = None) -> dict[str, Any]:
    """Run `job` to cfg's end (or a signal) in `run_dir`; returns the summary (also summary.json).

    created: this call made run_dir (a failure before the first step removes it).
    callbacks: Hooks told of each step, eval, save and the end.
    """
    opening.taken_over()  # from here a failure or signal is this function's to handle
    if distributed.is_main():
        record_to(run_dir.path)  # what a closed or failed stdout/stderr is given goes to output.log (console.py)
        run_dir.reserve()  # room for summary.json should the disk fill (resources.py)
    progress = Progress(job.total_steps, cfg.output.progress if distributed.is_main() else "off")
    hooks = list(callbacks or [])
    start = 0
    # What a signal does is always said: above the progress view, or through `log` when it is off.
    say = progress.message if progress.mode != "off" else log
    try:
        with Signals(say) as signals:
            if resume_from is not None:
                start = restore(job, run_dir, resume_from)
                progress.message(f"resumed from {resume_from} at step {start}")
            for hook in hooks:
                hook.on_begin(run_dir, start)
            summary = _steps(job, cfg, run_dir, progress, signals, start, hooks)
            for hook in hooks:
                hook.on_end(summary)
            return summary
    except Exception as error:
        resource = exhausted(error, run_dir, job.resume_command)  # a full disk or failed allocation: one line
        _failed(run_dir, created, start, resource or error, log, say=resource is None)
        if resource is error:
            raise
        if resource is not None:
            raise resource from None
        raise
    finally:
        if distributed.is_main():
            run_dir.release_reserve()
        progress.close()
        try:
            for hook in hooks:
                hook.close()
        finally:
            try:
                job.close()
            finally:
                if run_dir.lock is not None:
                    run_dir.lock.release()


def _steps(job: Job, cfg: Config, run_dir: RunDir, progress: Progress, signals: Signals, start: int,
           hooks: list[Hook]) -> dict:
    saves = Checkpoints(cfg.output.save_every, cfg.output.save_minutes, cfg.output.save_total_limit, time.monotonic())
    # A resumed run's earlier evals (the summary's eval_before), as rank 0 reads them after cutting the
    # logs back: a follower reading eval.jsonl itself could see the cut-off final eval and skip the
    # final one, which under FSDP is a collective (every rank gathers the weights).
    evals = distributed.from_main(run_dir.evals)
    if start == 0 and job.eval_at_start:
        _evaluate(job, run_dir, progress, 0, evals, hooks)
    # Under torchrun a rank acts only on the agreed stop (`stop`), never on its own handler's: a
    # signal can land on one rank after an agreement and on another before it, and a rank that
    # left the loop alone would leave the others waiting in a collective (FSDP's saves gather).
    step, stopped, stop, saved = start, False, None, start
    while step < job.total_steps and not stopped:
        stop = distributed.agree_signal(signals.received)  # one that came during the last eval or save
        if stop is not None:
            break
        step += 1
        progress.begin_step(step)  # the heartbeat shows the step's phase and count while it runs
        record = job.step(step)
        run_dir.log_step(record)
        if step == 1:  # named once it is kept: a run failing in its first step removes its directory
            progress.message(f"run directory: {run_dir.path}")
        progress.update(step, record)
        stop = distributed.agree_signal(signals.received)  # torchrun: every rank stops here too
        stopped = any([bool(hook.on_step(step, record)) for hook in hooks])  # every hook hears of the step
        stopped = distributed.any_rank(stopped)  # a hook's stop, on every rank alike
        if step == job.total_steps:
            break
        if job.eval_every and step % job.eval_every == 0:
            _evaluate(job, run_dir, progress, step, evals, hooks)
        # output.save_minutes reads each rank's clock: one decision, or FSDP's gathering save would hang
        if distributed.any_rank(saves.due(step)) or stop is not None or stopped:
            _save(job, run_dir, step, hooks)
            run_dir.prune(saves.keep)
            saves.last_saved, saved = time.monotonic(), step
        if stop is not None:
            break
    if stopped and step < job.total_steps:  # a hook (a TrainerCallback's should_training_stop) ended the run
        return _summary(job, run_dir, step, evals, cfg.output.plot, status="stopped",
                        checkpoint=str(run_dir.checkpoint_dir(step)))
    if stop is not None and step < job.total_steps:  # a stop asked in the last step just finishes
        if saved != step:  # the signal came during an eval or save after step `step`
            _save(job, run_dir, step, hooks)
        name = signal.Signals(stop).name
        summary = _summary(job, run_dir, step, evals, cfg.output.plot, status="interrupted", signal=name,
                           exit_code=128 + stop)
        checkpoint = run_dir.latest_checkpoint()
        signals.log(f"interrupted at step {step}; resume with: {job.resume_command} {quoted(run_dir.path)}"
                    if checkpoint is not None else f"interrupted at step {step}, before any checkpoint")
        return summary
    # The final save comes first: a failing final eval cannot cost the trained model, and an eval
    # may change the model in place (SFT's merges LoRA adapters into the weights for the lean engine).
    if start == job.total_steps:  # resumed from the final checkpoint of a run killed before its summary
        checkpoint = run_dir.checkpoint_dir(None)
    else:
        checkpoint = save(job, run_dir, job.total_steps, final=True)
        for hook in hooks:
            hook.on_save(job.total_steps, checkpoint)
    if job.total_steps not in evals:
        stop = _final_evaluate(job, run_dir, progress, signals, evals, hooks)
        if stop is not None:  # the model is saved; a resume runs the final eval and writes the summary
            summary = _summary(job, run_dir, job.total_steps, evals, cfg.output.plot, status="interrupted",
                               signal=signal.Signals(stop).name, exit_code=128 + stop, checkpoint=str(checkpoint))
            signals.log(f"interrupted during the final eval (the trained model is saved in {checkpoint}); "
                        f"resume with: {job.resume_command} {quoted(run_dir.path)}")
            return summary
    return _summary(job, run_dir, job.total_steps, evals, cfg.output.plot, status="finished",
                    checkpoint=str(checkpoint))


def _final_evaluate(job: Job, run_dir: RunDir, progress: Progress, signals: Signals, evals: dict,
                    hooks: list[Hook]) -> int | None:
    """The final eval, which a signal stops at once (nothing is left to save); the signal's number, or None."""
    signals.at_once = True
    try:
        _evaluate(job, run_dir, progress, job.total_steps, evals, hooks)
    except Interrupted as stop:
        return stop.signum
    finally:
        signals.at_once = False
    return None


def _evaluate(job: Job, run_dir: RunDir, progress: Progress, step: int, evals: dict, hooks: list[Hook]) -> None:
    metrics = job.evaluate(step, run_dir)
    if metrics is not None:
        run_dir.log_eval(step, metrics)
        progress.set_eval(step, metrics)
        evals[step] = metrics
        for hook in hooks:
            hook.on_evaluate(step, metrics)


def _save(job: Job, run_dir: RunDir, step: int, hooks: list[Hook]) -> None:
    checkpoint = save(job, run_dir, step, final=False)
    for hook in hooks:
        hook.on_save(step, checkpoint)


def save(job: Job, run_dir: RunDir, step: int, final: bool) -> Path:
    """A full-state checkpoint of `job` after `step`: checkpoint-<step>/ or, final, checkpoint/.

    Every rank builds `state` (job.state_dict(): FSDP gathers its shards there); rank 0 alone writes.
    """
    state = {"step": step, "job": job.state_dict(), "logs": run_dir.log_offsets(),
             "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}

    target = run_dir.checkpoint_dir(None if final else step)

    def write(directory: Path) -> None:
        job.save_model(directory)
        torch.save(state, directory / STATE_FILE)
        readable = {"step": step, "final": final, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "resume": f"{job.resume_command} {quoted(target)}"}  # where it lands, not the temporary
        (directory / STATE_SUMMARY).write_text(json.dumps(readable, indent=2) + "\n")
        write_manifest(directory)  # last: the sha256 of every file above, verified before a resume

    # a heartbeat while it writes: a large model's save takes tens of seconds on a busy box (issue 56)
    with Ticker(f"saving {'the final checkpoint' if final else f'checkpoint-{step}'}", unit="s"):
        return run_dir.save_files(write, None if final else step)


def restore(job: Job, run_dir: RunDir, checkpoint: Path) -> int:
    """Load `checkpoint` into `job` and cut the logs back to it; returns its step."""
    try:
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"resume error: {checkpoint} has no {STATE_FILE} (not a full-state checkpoint)") from None
    except Exception as error:  # a truncated or foreign file
        reason = (str(error).splitlines() or [""])[0][:120]  # torch may raise with an empty message
        raise CheckpointError(f"resume error: cannot read {checkpoint / STATE_FILE} "
                              f"({type(error).__name__}{': ' + reason if reason else ''})") from None
    job.load_state_dict(state["job"], checkpoint)
    random.setstate(as_random_state(state["rng"]["python"]))
    torch.set_rng_state(state["rng"]["torch"])
    run_dir.truncate_logs(state["logs"])
    return int(state["step"])


def _summary(job: Job, run_dir: RunDir, step: int, evals: dict, plot: bool, **fields) -> dict[str, Any]:
    summary = {"run_dir": str(run_dir.path), "steps": step, **fields, "allocator": loaded_allocator(), **job.summary()}
    if evals:
        summary["eval_before"] = evals[min(evals)]
        if max(evals) > min(evals) or fields.get("status") == "finished":  # never the start's eval as the end's
            summary["eval_after"] = evals[max(evals)]
    run_dir.write_summary(summary)
    if plot:
        run_dir.plot()
    return summary


def _failed(run_dir: RunDir, created: bool, start: int, error: Exception, log: Callable[[str], None],
            say: bool = True) -> None:
    """summary.json saying status "failed" and why (a fresh run that did no step leaves no directory).
    say: also log that the directory is kept (a ResourceExhausted line already names it)."""
    if distributed.is_main():
        run_dir.release_reserve()  # a full disk: the reserved room takes the summary
    steps_done = sum(1 for _ in _lines(run_dir.metrics_path))
    # A fresh run whose first save found the disk full has nothing to resume from: leave no directory either.
    unusable = isinstance(error, (ResourceExhausted, OutOfSpace)) and run_dir.latest_checkpoint() is None
    if created and start == 0 and (steps_done == 0 or unusable) and distributed.is_main():
        shutil.rmtree(run_dir.path, ignore_errors=True)  # nothing worth keeping: leave nothing behind
        return
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    try:
        run_dir.write_summary({"run_dir": str(run_dir.path), "status": "failed", "steps": steps_done,
                               "error": f"{type(error).__name__}: {reason}"})
    except OSError:
        pass  # the failure may be the disk itself; the error is what the user needs
    if say:
        log(f"run failed; its directory is kept: {run_dir.path}")


def _lines(path: Path):
    if path.is_file():
        yield from (line for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
