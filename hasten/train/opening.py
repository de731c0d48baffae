"""Opening a run directory: a new one, owned, or a resumed one and the checkpoint it continues from.

    open_run          a new run directory (its flock taken before config.yaml is written), or the
                      resumed one: owned first, then its newest whole checkpoint chosen, stale
                      temporaries removed; under torchrun rank 0 opens it and the others follow
    find_checkpoint   `--resume PATH`: a run directory's newest whole checkpoint (a damaged newer
                      one passed over in one line) or the one checkpoint named
    check_resume      before the model loads: a run this user may not write is one line
    resume_config     the run's own config.yaml; options that would change it are errors
    discard_unstarted a fresh directory a Ctrl-C left before loop.run took it over

loop.py runs what this opens (and re-exports these names for its callers).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

from ..config import Config
from ..models.files import owner_note
from . import distributed
from .integrity import LOCK_FILE, DamagedCheckpoint, RunLock, verify
from .outputs import STATE_FILE, STATE_SUMMARY, CheckpointError, RunDir, RunDirError, start_error


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


def taken_over() -> None:
    """loop.run owns the directory from here: a failure or signal is its to handle."""
    global _unstarted
    _unstarted = None


def discard_unstarted() -> None:
    """Remove the fresh run directory a Ctrl-C between open_run and run left (config.yaml alone)."""
    global _unstarted
    if _unstarted is not None:
        shutil.rmtree(_unstarted.path, ignore_errors=True)
        if _unstarted.lock is not None:
            _unstarted.lock.release()
        _unstarted = None
