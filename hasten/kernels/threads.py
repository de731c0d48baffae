"""Threads that follow the free cores (speed.adaptive_threads): robust to a busy neighbour.

A step's OpenMP regions end in barriers: with 2 threads on 2 cores and one
core taken by another process, every region waits for the thread the kernel
descheduled. With one busy neighbour a step slows several times over, generation
(many small regions) most of all (docs/results/code-notes.md). Fewer threads than
cores wins there: one thread that owns its core.

Before each phase of a step (generation, learning) `ThreadGovernor.adjust()`
counts the runnable threads of other processes (`procs_running` in
/proc/stat minus this process's own runnable threads, the minimum of a few
samples a millisecond apart, so a brief blip does not count) and sets
torch's intra-op threads to max(1, cores - others), at most the threads the
run started with. Kernel threads are not neighbours: kswapd reclaiming under
memory pressure, or kdamond, shows in procs_running but holds no OpenMP
barrier (B8's 256-token cell, 19 GB of 24 GiB resident, generated on one
thread, most likely because of them); so a non-zero count is confirmed by reading the
state and flags of every task in /proc (PF_KTHREAD ones left out), which is
done only then. A quiet machine keeps every thread. The thread count only
changes floating-point summation order (results within rounding), and an
explicit train.num_threads turns the governor off (tests pin 1 thread).
"""

from __future__ import annotations

import os
import time

import torch


def _running_total() -> int | None:
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith("procs_running"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _running_own() -> int:
    running = 0
    try:
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "R":
                        running += 1
            except OSError:
                continue
    except OSError:
        pass
    return running


PF_KTHREAD = 0x00200000  # include/linux/sched.h: the task is a kernel thread


def _running_user_others(proc: str = "/proc", own: int | None = None) -> int:
    """Runnable tasks of other processes that are not kernel threads (reads every /proc/<pid>/task/<tid>/stat)."""
    own = os.getpid() if own is None else own
    running = 0
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit() and int(name) != own]
    except OSError:
        return 0
    for pid in pids:
        try:
            tasks = os.listdir(f"{proc}/{pid}/task")
        except OSError:
            continue  # gone since the listing
        for task in tasks:
            try:
                with open(f"{proc}/{pid}/task/{task}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if len(fields) > 6 and fields[0] == "R" and not int(fields[6]) & PF_KTHREAD:
                running += 1
    return running


def busy_neighbours(samples: int = 5, gap_s: float = 0.001) -> int | None:
    """Runnable threads of other user processes now (min over `samples`); None where /proc/stat is unreadable."""
    seen = []
    for index in range(samples):
        total = _running_total()
        if total is None:
            return None
        seen.append(max(0, total - max(1, _running_own())))
        if index + 1 < samples:
            time.sleep(gap_s)
    if min(seen) == 0:
        return 0
    confirmed = []  # something runs: is it a process, or the kernel's own threads?
    for index in range(samples):
        confirmed.append(_running_user_others())
        if index + 1 < samples:
            time.sleep(gap_s)
    return min(min(seen), min(confirmed))


class ThreadGovernor:
    def __init__(self, enabled: bool, cores: int | None = None):
        self.max_threads = torch.get_num_threads()
        self.cores = cores or len(os.sched_getaffinity(0))
        self.enabled = enabled and self.max_threads > 1

    def adjust(self) -> int:
        """Set and return the intra-op threads for the next phase."""
        if not self.enabled:
            return torch.get_num_threads()
        others = busy_neighbours()
        threads = self.max_threads if others is None else max(1, min(self.max_threads, self.cores - others))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    def restore(self) -> None:
        """Give the process back the threads it started with (the run is over)."""
        if self.enabled and torch.get_num_threads() != self.max_threads:
            torch.set_num_threads(self.max_threads)
