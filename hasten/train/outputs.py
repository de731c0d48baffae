"""The run directory: everything a training run leaves on disk.

Layout of `<output.dir>/<output.name or <time>-<task>>/`:

    config.yaml        the resolved config, written before training starts
    metrics.jsonl      one JSON object per GRPO step (appended, flushed per line)
    eval.jsonl         one JSON object per held-out evaluation: {"step": N, ...}
    checkpoint-<N>/    full-state checkpoints (output.save_every, output.save_minutes, on a signal)
    checkpoint/        the final checkpoint (full state too)
    summary.json       end-of-run summary (status: finished | interrupted | stopped | failed)
    .lock              flock'd by the process writing the run (integrity.py; the kernel frees it), from
                       the moment the directory exists, before config.yaml
    output.log         what a closed, full or gone stdout/stderr could not show (console.py); only then
    .reserve           64 KiB held while the run writes, freed for summary.json on a full disk (resources.py)
    progress.png       reward and held-out accuracy curves; loss, KL, entropy, completion
                       length and step time below them

Choices:
- One directory, one run: a fresh run takes its directory's lock before it writes anything there
  (config.yaml included), so a second run, however timed, never writes beside it.
- A run never overwrites another: an existing non-empty directory gets a
  `-2`, `-3`, ... suffix instead; or, with output.earlier_run=set_aside (the
  TRL API's output_dir), an earlier run there is renamed `<name>.previous-N`
  and the new run takes the name (a directory that is not a run, or one a live
  process writes, is never moved).
- Logs are strict JSON (NaN and infinities become null, tensor and numpy
  scalars become numbers) so `json.loads`, jq and pandas read every line.
  Each line is written with its own open/append/close: a killed run loses at
  most the line being written, and readers skip a torn last line.
- Checkpoints and the summary are written to a temporary sibling, fsynced
  and renamed into place, so an interrupted save (even kill -9 or a power
  cut) leaves the previous file or directory, never a half-written one; the
  temporary directories a killed save leaves are removed when the run is
  opened again (`clean_stale`). Saving goes through `save_pretrained`, so
  plain HF models write full weights and peft models write adapters only.
- Modes follow the umask, as mkdir and open would give them: a checkpoint is staged in
  tempfile.mkdtemp's 700 directory and given 0o777 & ~umask (files 0o666 & ~umask) before
  its rename, so a teammate can evaluate it. A run one may not write (another user's) is
  one line naming the file and its owner, for a new run and for a resume (loop.open_run).
- A disk already full when a run starts (config.yaml, the pid in .lock) is one line, and
  the half-made directory is removed.
- Pruning renames a checkpoint to a hidden `.deleting-checkpoint-<N>` before deleting it:
  a kill during the deletion leaves no half-deleted checkpoint-<N>/ in view, and the
  leftover is removed with the other stale temporaries when the run is opened again.
- Every checkpoint ends with manifest.json, the sha256 of its files (integrity.py),
  checked before a resume. A save that finds the disk full raises OutOfSpace: one
  line naming the directory and the space one checkpoint needs.
- A checkpoint is full state: the model files plus `trainer_state.pt`
  (optimizer, schedule, scaler, RNGs, sampler position, step, log offsets:
  what train/loop.py needs to resume bit-identically) and a readable
  `trainer_state.json`. `output.save_total_limit` keeps the newest N
  `checkpoint-<N>/`; the final `checkpoint/` is never pruned.
- Nothing heavy is imported at module import time: matplotlib is imported
  inside `plot()` and uses the Agg canvas directly (no pyplot, so no global
  backend switch and no figures kept alive across a long run).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from hasten.config import Config, save_config
from hasten.errors import UserError
from hasten.models.files import owner_note, share_like_umask, utf8_path
from hasten.train.integrity import LOCK_FILE, RunInUse, RunLock

STATE_FILE = "trainer_state.pt"
STATE_SUMMARY = "trainer_state.json"
DELETING = ".deleting-"  # a pruned checkpoint's name while it is deleted
RESERVE = ".reserve"  # disk kept while a run writes, freed for summary.json when the disk fills (resources.py)
RESERVE_BYTES = 64 * 1024
_NUMBERED = re.compile(r"checkpoint-(\d+)")


class CheckpointError(UserError):
    """A checkpoint that cannot be written or resumed from; one line."""


class RunDirError(UserError):
    """A run directory that cannot be made or written (a full disk, another user's); one line."""


def start_error(error: OSError, root: Path) -> RunDirError:
    """The one line for a fresh run that could not make its directory, its config.yaml or its lock."""
    if out_of_space(error):
        free = _megabytes(shutil.disk_usage(root).free) if root.is_dir() else "nothing"
        return RunDirError(f"run error: no space left on the disk of {root} to start a run ({free} free); "
                           "free some space and start it again")
    if isinstance(error, PermissionError):
        where = Path(error.filename or root)
        return RunDirError(f"run error: cannot start a run in {root}: permission denied writing "
                           f"{where}{owner_note(where)}; choose another output.dir")
    return RunDirError(f"run error: cannot start a run in {root}: {error.strerror or error}"
                       + (f" ({error.filename})" if error.filename else ""))


def quoted(path: Path) -> str:
    """A path as a shell reads it back: a run directory with spaces pasted into --resume works."""
    return shlex.quote(str(path))


class OutOfSpace(CheckpointError):
    """The disk filled up during a save; one line naming the directory and the space needed."""


def out_of_space(error: BaseException) -> bool:
    """A full disk (or quota), however the writer reports it: OSError ENOSPC / EDQUOT, or the text of
    torch.save's RuntimeError ("file write failed", "unexpected pos") and safetensors' errors."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(error)
    return any(sign in text for sign in ("No space left on device", "Disk quota exceeded", "file write failed",
                                         "unexpected pos"))


class RunDir:
    """One run's output directory. Use `RunDir.create(cfg)` for a new run;
    `RunDir(path)` opens an existing one (e.g. to re-plot it)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metrics_path = self.path / "metrics.jsonl"
        self.eval_path = self.path / "eval.jsonl"
        self.lock: Any = None  # integrity.RunLock while this process writes the directory (loop.open_run)

    @classmethod
    def create(cls, cfg: Config) -> RunDir:
        """Make a fresh directory for `cfg` (already validated), own it (its lock), then save the config there.

        The lock comes before any file: a run that stalls before writing its config (a slow disk) still
        owns its directory, so a second run started meanwhile takes the next name (or, set_aside, is
        refused) instead of writing beside it."""
        name = cfg.output.name or f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.task.name}"
        root = Path(cfg.output.dir)
        root.mkdir(parents=True, exist_ok=True)
        if cfg.output.earlier_run == "set_aside":
            set_aside(root / name)
        suffix = 1
        while True:
            candidate = root / (name if suffix == 1 else f"{name}-{suffix}")
            lock = _own_fresh(candidate)
            if lock is not None:
                break
            suffix += 1
        run = cls(candidate)
        run.lock = lock
        try:
            save_config(cfg, run.path / "config.yaml")
        except BaseException:  # a full disk, say: leave no directory holding half a config
            shutil.rmtree(run.path, ignore_errors=True)
            lock.release()
            raise
        return run

    def reserve(self) -> None:
        """Keep RESERVE_BYTES of the disk (real blocks, not a sparse file) for the run's end."""
        try:
            (self.path / RESERVE).write_bytes(bytes(RESERVE_BYTES))
        except OSError:  # the disk is full already: the run's next write says so in one line
            self.release_reserve()

    def release_reserve(self) -> None:
        try:
            (self.path / RESERVE).unlink(missing_ok=True)
        except OSError:
            pass

    # ------------------------------------------------------------------ logs

    def log_step(self, record: dict[str, Any]) -> None:
        """Append one training-step record to metrics.jsonl."""
        _append_json_line(self.metrics_path, record)

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one held-out evaluation to eval.jsonl."""
        _append_json_line(self.eval_path, {"step": step, **metrics})

    def save_samples(self, name: str, samples: list[dict[str, Any]]) -> Path:
        """Write samples/<name>.jsonl: completions kept for reading, one per line."""
        target = self.path / "samples" / f"{name}.jsonl"
        target.parent.mkdir(exist_ok=True)
        lines = "".join(json.dumps(_jsonable(sample), allow_nan=False) + "\n" for sample in samples)
        _write_atomically(target, lines.encode())
        return target

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write summary.json (pretty-printed, atomically) and return its path."""
        target = self.path / "summary.json"
        text = json.dumps(_jsonable(summary), indent=2, allow_nan=False) + "\n"
        _write_atomically(target, text.encode())
        return target

    # ----------------------------------------------------------- checkpoints

    def checkpoint_dir(self, step: int | None) -> Path:
        """`checkpoint/` for the final save (step None), else `checkpoint-<step>/`."""
        return self.path / ("checkpoint" if step is None else f"checkpoint-{step}")

    def save_checkpoint(self, model, tokenizer, step: int | None) -> Path:
        """Save model and tokenizer (no trainer state) to `checkpoint_dir(step)`, replacing any earlier save."""
        return self.save_files(lambda directory: save_model_files(model, tokenizer, directory), step)

    def save_files(self, write: Callable[[Path], Any], step: int | None) -> Path:
        """Run `write(directory)` on a fresh temporary directory, fsync it, then move it to `checkpoint_dir(step)`.

        The atomic replace of every checkpoint; models that are not HF models
        (the games' policies) save through this too. A failure (a full disk,
        say) leaves the previous save in place and raises CheckpointError.
        """
        target = self.checkpoint_dir(step)
        temporary = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=self.path))
        try:
            write(temporary)
            share_like_umask(temporary)  # mkdtemp made it 700: a teammate could not read the checkpoint
            _fsync_tree(temporary)
            if target.exists():
                # Move the old save aside first: a rename onto a non-empty
                # directory fails, and deleting it first would leave a window
                # with no checkpoint at all.
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=self.path))
                os.replace(target, old / target.name)
                os.replace(temporary, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(temporary, target)
            _fsync_directory(self.path)
        except Exception as error:
            written = _tree_bytes(temporary)
            shutil.rmtree(temporary, ignore_errors=True)
            if out_of_space(error):
                raise self._out_of_space(target, written) from None
            if isinstance(error, OSError):
                raise CheckpointError(f"checkpoint error: could not write {target}: {error.strerror or error}") from None
            raise
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return target

    def _out_of_space(self, target: Path, written: int) -> OutOfSpace:
        """The one line for a save the disk had no room for: the space one checkpoint takes (the newest
        saved one's size; else, at least, what the failed save wrote) and what is free."""
        saved = self.checkpoints_newest_first()[:1]
        needed = max([_tree_bytes(path) for path in saved] + [written])
        free = _megabytes(shutil.disk_usage(self.path).free)
        if saved:
            return OutOfSpace(f"checkpoint error: no space left on the disk of {self.path} to write {target.name} "
                              f"(needs about {_megabytes(needed)}, {free} free); free some space, then resume "
                              f"the run from its last checkpoint (--resume {quoted(self.path)})")
        return OutOfSpace(f"checkpoint error: no space left on the disk of {self.path.parent} for a checkpoint "
                          f"(needs more than {_megabytes(needed)}, {free} free); free some space and start the "
                          "run again (its directory is removed)")

    def clean_stale(self) -> list[Path]:
        """Remove what killed saves and prunes left behind (hidden .checkpoint*.tmp-* / .old-* dirs,
        .*.tmp-* files, .deleting-checkpoint-* dirs)."""
        stale = [entry for entry in self.path.iterdir()
                 if entry.name.startswith(".") and (".tmp-" in entry.name or ".old-" in entry.name
                                                    or entry.name.startswith(DELETING))]
        for entry in stale:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        return stale

    def numbered_checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every checkpoint-<N>/ holding trainer state, oldest first."""
        found = []
        for entry in self.path.glob("checkpoint-*"):
            match = _NUMBERED.fullmatch(entry.name)
            if match and (entry / STATE_FILE).is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def prune(self, keep: int) -> None:
        """Keep the newest `keep` checkpoint-<N>/ (0 = keep all), with trainer state or not (the API's
        save_only_model drops it; those count against the limit too, as in transformers).

        Each one is renamed out of view first, then deleted: a kill in between leaves a hidden
        .deleting-checkpoint-<N>/ that clean_stale removes, never a half-deleted checkpoint-<N>/."""
        if keep <= 0:
            return
        numbered = sorted((int(match.group(1)), entry) for entry in self.path.glob("checkpoint-*")
                          if entry.is_dir() and (match := _NUMBERED.fullmatch(entry.name)))
        for _, path in numbered[:-keep]:
            doomed = path.with_name(DELETING + path.name)
            shutil.rmtree(doomed, ignore_errors=True)  # the leftover of an earlier killed prune
            try:
                os.replace(path, doomed)
                _fsync_directory(self.path)  # the rename is on disk before the first file goes
            except OSError:  # kept until the next prune: a checkpoint too many never fails the run
                continue
            shutil.rmtree(doomed, ignore_errors=True)

    def checkpoints_newest_first(self) -> list[Path]:
        """Every checkpoint-<N>/ and a final checkpoint/ with state, highest step first (final first on a tie)."""
        candidates = [(step, path) for step, path in self.numbered_checkpoints()]
        final = self.checkpoint_dir(None)
        if (final / STATE_SUMMARY).is_file() and (final / STATE_FILE).is_file():
            try:
                candidates.append((int(json.loads((final / STATE_SUMMARY).read_text())["step"]), final))
            except (ValueError, KeyError, TypeError):
                pass
        return [path for _, path in sorted(candidates, key=lambda item: (item[0], item[1] == final), reverse=True)]

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint with the highest step among checkpoint-<N>/ and a final checkpoint/ with state."""
        candidates = self.checkpoints_newest_first()
        return candidates[0] if candidates else None

    def log_offsets(self) -> dict[str, int]:
        """Bytes in metrics.jsonl and eval.jsonl now: what a resume from here truncates them back to."""
        return {path.name: path.stat().st_size if path.is_file() else 0 for path in (self.metrics_path, self.eval_path)}

    def truncate_logs(self, offsets: dict[str, int]) -> None:
        """Drop the lines written after a checkpoint (steps a resume will run again)."""
        for path in (self.metrics_path, self.eval_path):
            size = offsets.get(path.name, 0)
            if path.is_file() and path.stat().st_size > size:
                with path.open("r+b") as handle:
                    handle.truncate(size)

    def evals(self) -> dict[int, dict[str, Any]]:
        """step -> metrics of every held-out eval logged so far."""
        return {record["step"]: {k: v for k, v in record.items() if k != "step"}
                for record in read_json_lines(self.eval_path) if isinstance(record.get("step"), int)}

    def plot(self) -> Path | None:
        """Draw progress.png from the logs (progress_plot.py); None when there is nothing to draw yet."""
        from .progress_plot import plot

        return plot(self.path, read_json_lines(self.metrics_path), read_json_lines(self.eval_path))


def _jsonable(value: Any) -> Any:
    """`value` with everything strict JSON cannot hold turned into what it can."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    # torch tensors and numpy values, recognised by duck typing so this
    # module does not import either: 0-d ones become Python scalars.
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return _jsonable(value.item())
    if hasattr(value, "tolist"):
        return _jsonable(value.tolist())
    return str(value)


def save_model_files(model, tokenizer, directory: Path, state: dict | None = None) -> None:
    """An HF-format model directory: full weights, or adapters only for a peft model; plus the tokenizer.

    state: the full weights to write when the model's own are sharded (FSDP, train/fsdp.py).
    """
    with utf8_path(Path(directory)) as directory:
        _save_model_files(model, tokenizer, directory, state)


def _save_model_files(model, tokenizer, directory: Path, state: dict | None) -> None:
    if hasattr(model, "peft_config"):
        # Adapters only. "auto" would look the base model up on the hub to see whether
        # the vocabulary changed; hasten never trains the embeddings through LoRA.
        model.save_pretrained(directory, save_embedding_layers=False)
        base = model.get_base_model()
        registry_name = getattr(base, "_hasten_registry_name", None)
        if registry_name is not None:  # hasten loads the adapter onto these weights (models/__init__.py)
            (Path(directory) / "hasten_base.json").write_text(json.dumps({"name": registry_name}) + "\n")
        origin = getattr(base, "_hasten_base_origin", None)
        if origin is not None:  # the model card says what the recorded base name stood for here
            card = Path(directory) / "README.md"
            text = card.read_text() if card.is_file() else ""
            card.write_text(text.rstrip("\n") + f"\n\n## Base model weights\n\nTrained on {origin}.\n")
    elif state is not None:
        model.save_pretrained(directory, state_dict=state)
    else:
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _tree_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in Path(root).rglob("*") if path.is_file()) if Path(root).is_dir() else 0


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def _fsync_tree(root: Path) -> None:
    """Flush every file under root, then the directories: the data is on disk before the rename."""
    for directory, _, files in os.walk(root):
        for name in files:
            descriptor = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _fsync_directory(Path(directory))


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _own_fresh(candidate: Path) -> RunLock | None:
    """The lock of `candidate` made now, or found empty (made by hand beforehand); None when it is taken:
    it holds files, or a live run owns it (one that has not written its config yet, say)."""
    made = True
    try:
        candidate.mkdir()
    except FileExistsError:
        made = False
        if not candidate.is_dir() or any(entry.name != LOCK_FILE for entry in candidate.iterdir()):
            return None
    try:
        lock = RunLock(candidate).acquire()
    except RunInUse:
        return None
    except OSError:  # a full disk (the pid in .lock): the directory made here goes too
        if made:
            shutil.rmtree(candidate, ignore_errors=True)
        raise
    if any(entry.name != LOCK_FILE for entry in candidate.iterdir()):  # filled before we took it
        lock.release()
        return None
    return lock


def aside_name(path: Path) -> Path:
    """Where set_aside would move the run at `path`: `<name>.previous-N`, the first N not taken."""
    number = 1
    while (target := path.with_name(f"{path.name}.previous-{number}")).exists():
        number += 1
    return target


def holds_run(path: Path) -> bool:
    """`path` is a run directory (a config.yaml that RunDir.create wrote)."""
    return (path / "config.yaml").is_file()


def set_aside(path: Path) -> Path | None:
    """Rename the earlier run at `path` to aside_name(path), so a new run can write `path` (TRL's
    output_dir) with nothing deleted. None when `path` is not a run (left alone: the new run goes beside
    it); RunInUse when a live process writes it."""
    if (path / LOCK_FILE).is_file():
        RunLock(path).acquire().release()  # a live run keeps its directory, even before its config exists
    if not holds_run(path):
        return None
    lock = RunLock(path).acquire()  # a live run keeps its directory
    try:
        target = aside_name(path)
        os.rename(path, target)
    finally:
        lock.release()
    return target


def _append_json_line(path: Path, record: dict[str, Any]) -> None:
    line = json.dumps(_jsonable(record), allow_nan=False)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line + "\n")
        handle.flush()


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """Records from a .jsonl file; a missing file is empty and torn lines are skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
