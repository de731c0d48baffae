"""A run that runs out of a resource: the disk or memory. One line, a failed summary, the last whole checkpoint.

Why: a disk that fills between two checkpoints (at metrics.jsonl, an eval's samples, the plot, the
summary) or an allocation that fails mid-run (oneDNN's "could not create a primitive" under an
address-space limit, torch's out-of-memory, MemoryError) ended in a traceback of dozens of lines and,
on a full disk, no summary.json. Neither is a bug in hasten: the operator frees the resource and
resumes. So train/loop.py turns them into `ResourceExhausted` (a UserError: one line, exit 2) naming
the resource, the run directory and its last whole checkpoint, after writing summary.json with status
"failed". Checkpoints are written whole or not at all (outputs.RunDir.save_files), so the last one is
never touched.

On a full disk even summary.json needs room: the loop keeps RESERVE_BYTES of the disk in
`<run>/.reserve` while it runs (outputs.RunDir.reserve) and frees them just before writing it.

Recognised by what the writers and allocators raise, since torch and oneDNN give no error types of
their own for these (an OSError's errno where there is one).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from ..errors import UserError
from .outputs import OutOfSpace, RunDir, out_of_space, quoted

# What torch's CPU allocator, oneDNN and CUDA say when an allocation fails
ALLOCATION_FAILURES = ("could not create a primitive", "can't allocate memory", "out of memory",
                       "Cannot allocate memory", "std::bad_alloc")


class ResourceExhausted(UserError):
    """The disk filled or an allocation failed during a run; str() is one line naming the resource."""


def out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: MemoryError, torch's OutOfMemoryError, ENOMEM, oneDNN's primitive creation."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    if isinstance(error, OSError) and error.errno == errno.ENOMEM:
        return True
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in ALLOCATION_FAILURES)


def exhausted(error: BaseException, run_dir: RunDir, resume_command: str) -> UserError | None:
    """The one line for a run that ran out of disk or memory, or None for any other failure."""
    if isinstance(error, OutOfSpace):  # a checkpoint save: its own line already names what it needs
        return error
    if out_of_space(error):
        try:
            free = f"{shutil.disk_usage(run_dir.path).free / 1e6:.1f} MB free"
        except OSError:
            free = "free space unknown"
        resource = f"no space left on the disk of {run_dir.path} ({free}{_where(error)})"
        remedy = "free some space"
    elif out_of_memory(error):
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        resource = f"out of memory ({type(error).__name__}: {reason})"
        remedy = "free memory (or lower speed.token_budget, train.prompts_per_step)"
    else:
        return None
    checkpoint = run_dir.latest_checkpoint()
    if checkpoint is None:
        return ResourceExhausted(f"run error: {resource}; no checkpoint was saved yet: {remedy} and start the "
                                 "run again")
    return ResourceExhausted(f"run error: {resource}; the last whole checkpoint is {checkpoint}: {remedy}, then "
                             f"resume with: {resume_command} {quoted(run_dir.path)}")


def _where(error: BaseException) -> str:
    """', writing FILE' where the error names the file it could not write."""
    name = getattr(error, "filename", None)
    return f", writing {Path(name).name}" if name else ""
