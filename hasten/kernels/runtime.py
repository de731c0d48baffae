"""Process-level settings that change speed, never results.

keep_freed_memory (speed.keep_freed_memory): glibc serves every allocation
above 32 MB with a fresh mmap and returns it on free, so each learning pass
page-faults its activations and logits in again. Telling malloc to never use
mmap and never trim keeps freed memory in the heap for the next step.
On a CPU that page-faulting can cost more than the forward itself
(docs/results/code-notes.md). Costs: the process keeps its peak memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Ask glibc malloc to keep freed memory; False where that is not glibc."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok_mmap = mallopt(M_MMAP_MAX, 0) == 1
    ok_trim = mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return ok_mmap and ok_trim


def configure_threads(num_threads: int) -> None:
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)

