"""A run directory's single owner, and checkpoints that prove they are whole.

Why: two `hasten train --resume` of one run (a scheduler job submitted
twice) would both append to metrics.jsonl and save over each other's
checkpoints, and bytes damaged after a save (a bad disk, a copy cut short,
random bytes over the end of the weights) would load silently and train on
from other weights. So:

- the owner: a process writing a run directory holds an exclusive
  `fcntl.flock` on `<run>/.lock` (holding its pid, for the message). The
  kernel drops the lock when the process dies, however it dies, so a crashed
  owner never leaves the directory locked; a second writer fails at once
  with one line naming the directory and the owner's pid (exit 2);
- the manifest: every checkpoint holds `manifest.json`, the sha256 and size
  of each of its files, written last inside the temporary directory that is
  renamed into place (outputs.RunDir.save_files). `verify` recomputes them
  before a resume; a checkpoint saved before manifests existed is accepted
  as it is (its trainer state is still read with checks).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ..errors import UserError
from ..models.files import sha256_file

LOCK_FILE = ".lock"
MANIFEST = "manifest.json"


class RunInUse(UserError):
    """Another live process owns the run directory; one line."""


class DamagedCheckpoint(UserError):
    """A checkpoint whose files do not match its manifest; one line naming the file."""


class RunLock:
    """The exclusive, crash-safe ownership of one run directory (released by close() or the process's end)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self._descriptor: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise RunInUse naming the owner; writes nothing when the run is owned."""
        descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # the umask decides, as for every file
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(descriptor, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise RunInUse(f"run error: {self.directory} is in use by process {owner} (another hasten run "
                           "writes it); wait for it to end or stop it, then retry") from None
        except BaseException:
            os.close(descriptor)
            raise
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        self._descriptor = descriptor
        return self

    def __getstate__(self) -> dict:
        """A copy sent to another process (torchrun's ranks) owns nothing: the descriptor is this process's."""
        return {**self.__dict__, "_descriptor": None}

    def release(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # closing the descriptor drops the flock
            self._descriptor = None


def write_manifest(directory: Path) -> None:
    """manifest.json: {"files": {relative path: {"sha256", "bytes"}}} of every file under `directory`."""
    files = {}
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file() and p.name != MANIFEST):
        files[path.relative_to(directory).as_posix()] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    (Path(directory) / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def verify(directory: Path) -> None:
    """Raise DamagedCheckpoint unless every file the manifest lists is there with its size and sha256.

    A checkpoint without manifest.json (saved by an older hasten) passes.
    """
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        return
    try:
        listed = json.loads((directory / MANIFEST).read_text())["files"]
        entries = [(name, int(entry["bytes"]), str(entry["sha256"])) for name, entry in listed.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise DamagedCheckpoint(f"checkpoint error: {directory / MANIFEST} is damaged (not a manifest)") from None
    for name, size, digest in entries:
        path = directory / name
        if not path.is_file():
            raise DamagedCheckpoint(f"checkpoint error: {path} is missing")
        if path.stat().st_size != size:
            raise DamagedCheckpoint(f"checkpoint error: {path} is damaged ({path.stat().st_size} bytes, "
                                    f"saved with {size})")
        if sha256_file(path) != digest:
            raise DamagedCheckpoint(f"checkpoint error: {path} is damaged (its sha256 differs from the saved one)")

