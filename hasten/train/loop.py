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
    owner        open_run takes an flock on <run>/.lock (integrity.py): a second writer of
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
from ..models.files import owner_note
from ..tasks.sampler import as_random_state
from ..ticker import Ticker
from . import distributed
from .integrity import LOCK_FILE, DamagedCheckpoint, RunLock, verify, write_manifest
from .outputs import STATE_FILE, STATE_SUMMARY, CheckpointError, OutOfSpace, RunDir, RunDirError, quoted, start_error
from .progress import Progress
from .resources import ResourceExhausted, exhausted


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


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


def find_checkpoint(path: str | Path, log: Callable[[str], None] = _stderr,
                    total_steps: int | None = None) -> tuple[RunDir, Path]:
    """`--resume PATH`: a run directory (its newest whole full-state checkpoint) or one checkpoint-<N>/ in it.

    A run directory's newest checkpoint that fails its manifest (integrity.py) is passed over for the
    previous whole one, saying so in one line; a checkpoint named explicitly must be whole.
    total_steps: the resumed run's length when it may be longer than the saved one (the API's
    resume_from_checkpoint with a larger max_steps): a finished run is then continued, not refused.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"resume error: {path} is not a run directory or checkpoint")
    if (path / STATE_FILE).is_file():
        run_dir, checkpoint = RunDir(path.parent), path
        damage = _damage(checkpoint)
        if damage:
            raise DamagedCheckpoint(f"resume error: {damage}")
    else:
        run_dir = RunDir(path)
        checkpoint = _newest_whole(run_dir, log)
    if not (run_dir.path / "config.yaml").is_file():
        raise CheckpointError(f"resume error: {run_dir.path} has no config.yaml (is it a hasten run directory?)")
    try:
        readable = json.loads((checkpoint / STATE_SUMMARY).read_text())
    except (OSError, ValueError):
        readable = {}
    longer = total_steps is not None and total_steps > int(readable.get("step") or 0)
    if readable.get("final") and _finished(run_dir) and not longer:  # killed before summary.json: resuming writes it
        raise CheckpointError(f"resume error: {run_dir.path} finished at step {readable.get('step')}; "
                              "nothing to resume")
    return run_dir, checkpoint


def _newest_whole(run_dir: RunDir, log: Callable[[str], None]) -> Path:
    candidates = run_dir.checkpoints_newest_first()
    if not candidates:
        raise CheckpointError(f"resume error: {run_dir.path} has no full-state checkpoint ({STATE_FILE}) "
                              "to resume from")
    damaged = []
    for checkpoint in candidates:
        if not _damage(checkpoint):
            for newer in damaged:
                if newer not in _told:  # resume_config and open_run both look: say it once
                    _told.add(newer)
                    log(f"{_damage(newer)}; resuming from the previous complete checkpoint {checkpoint}")
            return checkpoint
        damaged.append(checkpoint)
    raise DamagedCheckpoint(f"resume error: no complete checkpoint in {run_dir.path} ({_damage(candidates[0])})")


_checked: dict[Path, str] = {}  # checkpoint -> "" (whole) or what is wrong: hashed once per process
_told: set[Path] = set()  # damaged checkpoints already reported (resume_config, then open_run)


def _damage(checkpoint: Path) -> str:
    """'' when the checkpoint is whole, else one line saying what is wrong."""
    if checkpoint not in _checked:
        try:
            verify(checkpoint)
            empty = (checkpoint / STATE_FILE).stat().st_size == 0
            _checked[checkpoint] = f"checkpoint error: {checkpoint / STATE_FILE} is empty" if empty else ""
        except DamagedCheckpoint as error:
            _checked[checkpoint] = str(error)
    return _checked[checkpoint]


def _finished(run_dir: RunDir) -> bool:
    """summary.json says the run finished (its end was written, not just its final checkpoint)."""
    try:
        return json.loads((run_dir.path / "summary.json").read_text()).get("status") == "finished"
    except (OSError, ValueError, AttributeError):
        return False


# How a resumed run shows itself, and where its memory comes from; nothing it learns from.
RESUME_OVERRIDES = ("output.progress", "output.plot", "speed.allocator")


def resume_config(path: str | Path, given: list[str], overrides: list[tuple[str, Any]]) -> Config:
    """The run's own config.yaml: a resumed run continues exactly what was started.

    given: the command-line options that would change it (each is an error).
    """
    from ..config import ConfigError, load_config

    given = given + [f"--{key}" for key, _ in overrides if key not in RESUME_OVERRIDES]
    if given:
        raise ConfigError(f"config error: --resume continues the run's saved config.yaml; drop {', '.join(given)} "
                          "(or edit the run's config.yaml)")
    try:
        run_dir, _ = find_checkpoint(path)
        return load_config(run_dir.path / "config.yaml", overrides)
    except PermissionError as error:  # another user's run saved 700 by an older hasten
        raise permission_denied(Path(path), error) from None


def open_run(cfg: Config, resume: str | Path | None) -> tuple[RunDir, Path | None]:
    """A new run directory, or the resumed one (stale temporaries of killed saves removed) and its checkpoint.

    Under torchrun rank 0 opens it and every other rank follows that choice (distributed.py).
    """
    def open_on_main() -> tuple[RunDir, Path | None]:
        if resume is None:
            return _create(cfg), None
        path = run_path = Path(resume)
        try:
            run_path = path.parent if (path / STATE_FILE).is_file() else path
            return _reopen(cfg, resume, run_path)
        except PermissionError as error:  # another user's run: one line, before anything is written
            raise permission_denied(run_path, error) from None

    run_dir, checkpoint = distributed.from_main(open_on_main)
    return distributed.follow(run_dir), checkpoint  # rank 0's RunDir holds the lock; loop.run releases it


def _create(cfg: Config) -> RunDir:
    """A fresh run directory, owned; a disk already full or an output.dir one may not write is one line,
    and the half-made directory is removed."""
    global _unstarted
    run_dir = None
    try:
        run_dir = _unstarted = RunDir.create(cfg)  # owned (its lock) before config.yaml is written
        return run_dir
    except OSError as error:
        if run_dir is not None:
            discard_unstarted()
        raise start_error(error, Path(cfg.output.dir)) from None


def _reopen(cfg: Config, resume: str | Path, run_path: Path) -> tuple[RunDir, Path]:
    """The resumed run, owned, with its checkpoint; stale temporaries of killed saves and prunes removed."""
    # Own the run before choosing its checkpoint: a second writer stops here, writing nothing, and
    # one that waited for the first to end sees the checkpoints (and summary) the first left.
    try:
        lock = RunLock(run_path).acquire() if (run_path / "config.yaml").is_file() else None  # else: not a run
    except PermissionError as error:
        raise permission_denied(run_path, error, "writing") from None
    try:
        if lock is not None:
            _check_writable(run_path)
        run_dir, checkpoint = find_checkpoint(resume, total_steps=cfg.train.steps)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    run_dir.lock = lock
    run_dir.clean_stale()
    _record_length(cfg, run_dir)
    return run_dir, checkpoint


def _check_writable(run_path: Path) -> None:
    """What a resume writes, checked: a lock file shared 666 can be taken by a user who cannot write the
    directory itself."""
    for target in (run_path, run_path / "metrics.jsonl", run_path / "eval.jsonl", run_path / "config.yaml"):
        if target.exists() and not os.access(target, os.W_OK):
            raise permission_denied(run_path, PermissionError(13, "Permission denied", str(target)), "writing")


def check_resume(resume: str | Path) -> None:
    """Before the model loads: a run this user may not write (another user's) is one line now, not after
    a minute of loading. Takes no lock (open_run does); writes nothing."""
    path = Path(resume)
    run_path = path.parent if (path / STATE_FILE).is_file() else path
    if not (run_path / "config.yaml").is_file():
        return  # not a run: open_run's find_checkpoint says so
    lock = run_path / LOCK_FILE
    try:
        if lock.exists():
            os.close(os.open(lock, os.O_RDWR))
        elif not os.access(run_path, os.W_OK):
            raise PermissionError(13, "Permission denied", str(lock))
        _check_writable(run_path)
    except PermissionError as error:
        raise permission_denied(run_path, error, "writing") from None


def permission_denied(run_path: Path, error: PermissionError, doing: str = "reading") -> RunDirError:
    """The one line for a resume of a run this user may not read or write (another user's)."""
    where = Path(error.filename or run_path)
    return RunDirError(f"run error: cannot resume {run_path}: permission denied {doing} {where}{owner_note(where)}; "
                       "its owner can resume it, or copy the run directory and resume the copy")


def _record_length(cfg: Config, run_dir: RunDir) -> None:
    """A resumed run made longer (the API's resume with a larger max_steps): its config.yaml says so."""
    from ..config import load_config, save_config

    path = run_dir.path / "config.yaml"
    if load_config(path).train.steps < cfg.train.steps:
        save_config(cfg, path)


_unstarted: RunDir | None = None  # a fresh run directory no loop.run has taken over yet


def discard_unstarted() -> None:
    """Remove the fresh run directory a Ctrl-C between open_run and run left (config.yaml alone)."""
    global _unstarted
    if _unstarted is not None:
        shutil.rmtree(_unstarted.path, ignore_errors=True)
        if _unstarted.lock is not None:
            _unstarted.lock.release()
        _unstarted = None


def run(job: Job, cfg: Config, run_dir: RunDir, log: Callable[[str], None] = print,
        resume_from: Path | None = None, created: bool = True, callbacks: list[Hook] | None = None) -> dict[str, Any]:
    """Run `job` to cfg's end (or a signal) in `run_dir`; returns the summary (also summary.json).

    created: this call made run_dir (a failure before the first step removes it).
    callbacks: Hooks told of each step, eval, save and the end.
    """
    global _unstarted
    _unstarted = None  # from here a failure or signal is this function's to handle
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
