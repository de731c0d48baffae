"""Checks on where a run will write, made before anything expensive (model load, sampling).

A run that loads a model for a minute and then finds it cannot create its
output directory, or a `rft datagen` that samples for minutes and then cannot
write its records, wastes the user's time and ends in a traceback. These
checks walk up to the nearest existing ancestor of the path, require it to
be a directory, and create (then remove) a probe file there: permission
bits alone would say yes to root on a read-only mount and no to ACL'd
users who can write. Nothing is left behind, not even the missing parents:
the writer creates those when it writes.

Each failure is a ConfigError naming the config key and the path, so the CLI
prints one line and exits 2.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..config import Config, ConfigError


def check_output_dir(cfg: Config) -> None:
    """Raise ConfigError unless output.dir is (or can be created as) a writable directory where output.name
    can be a directory's name."""
    check_writable_dir(cfg.output.dir, "output.dir")
    if cfg.output.name:
        check_name(cfg.output.name, _nearest_existing(Path(cfg.output.dir).expanduser()), "output.name")


def check_name(name: str, directory: Path, key: str) -> None:
    """`name` fits the file system's limit on one name (255 bytes on most)."""
    try:
        limit = os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    size = len(os.fsencode(name))
    if size > limit:
        raise ConfigError(f"config error: {key} is {size} bytes long; a name on this file system may have at most "
                          f"{limit}")


def check_writable_dir(path: str | Path, key: str) -> None:
    """`path` is a writable directory, or a directory that can be created there."""
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"config error: {key} '{path}' is a file, not a directory")
    _probe(_nearest_existing(target), path, key)


def check_writable_file(path: str | Path, key: str) -> None:
    """`path` can be written as a file: not a directory, and its (nearest existing) parent is writable."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(f"config error: {key} '{path}' is a directory, not a file")
    _probe(_nearest_existing(target.parent), path, key)


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (a relative path ends at '.' at worst)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe(directory: Path, path: str | Path, key: str) -> None:
    if not directory.is_dir():
        raise ConfigError(f"config error: {key} '{path}' cannot be created: '{directory}' is a file")
    try:
        handle, probe = tempfile.mkstemp(prefix=".hasten-write-check-", dir=directory)
    except OSError as error:
        raise ConfigError(
            f"config error: {key} '{path}' is not writable ({error.strerror or error}: '{directory}')"
        ) from None
    os.close(handle)
    os.unlink(probe)
