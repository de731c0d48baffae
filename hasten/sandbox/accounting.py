"""Per-execution memory and process accounting: one cgroup per worker, holding one execution at a time.

RLIMIT_AS bounds one process's address space, not what an execution pins in
total: its processes together, page cache and tmpfs pages, kernel memory for
inodes and sockets. A cgroup counts all of that. Each worker makes one cgroup
at start (a worker runs one execution at a time, and kills every process of
it before the next), sets the job's limits in it before each execution, and
A, the first process of the tree, joins it before dropping privileges; every
process of the execution inherits it. Over the limit the kernel's OOM killer
picks a process inside it (the result is a crash), never the trainer.

Detected once per worker: cgroup v2 when the worker's own cgroup delegates
memory and pids to children; else cgroup v1's memory and pids hierarchies;
else nothing (not root, or a read-only /sys/fs/cgroup), and the pool says
once what is then unbounded (pool.py). Standard library only.
"""

from __future__ import annotations

import os

ROOT = "/sys/fs/cgroup"
PREFIX = "hasten-sandbox-"
OVERHEAD = 32 << 20  # B and C themselves (the interpreter's pages they write after the fork)


def _own_paths() -> dict[str, str]:
    """Controller (or "" for the v2 hierarchy) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as file:
        for line in file:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                paths[controller] = path
    return paths


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as file:
            file.write(text)
        return True
    except OSError:
        return False


def _remove_stale(base: str) -> None:
    """Groups of workers that died without cleaning up (SIGKILL): removed when empty."""
    try:
        names = [name for name in os.listdir(base) if name.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


class Group:
    """This worker's cgroup: a dir per controller ("memory", "pids"); empty where none could be made."""

    def __init__(self) -> None:
        self.dirs: dict[str, str] = {}
        self.version = 0
        try:
            own = _own_paths()
        except (OSError, ValueError):
            return
        name = f"{PREFIX}{os.getpid()}"
        if os.path.exists(f"{ROOT}/cgroup.controllers") and "" in own:  # the unified (v2) hierarchy
            base = ROOT + own[""]
            try:
                with open(f"{base}/cgroup.subtree_control") as file:
                    delegated = file.read().split()
            except OSError:
                delegated = []
            if {"memory", "pids"} <= set(delegated) and self._make(base, name, ("memory", "pids")):
                self.version = 2
                return
        for controller in ("memory", "pids"):  # v1: one hierarchy per controller
            if controller in own and os.path.isdir(f"{ROOT}/{controller}"):
                self._make(f"{ROOT}/{controller}{own[controller]}", name, (controller,))
        self.version = 1 if self.dirs else 0

    def _make(self, base: str, name: str, controllers: tuple[str, ...]) -> bool:
        _remove_stale(base)
        path = os.path.join(base, name)
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            return False
        self.dirs.update({controller: path for controller in controllers})
        return True

    def set_limits(self, memory_bytes: int, disk_bytes: int, max_processes: int) -> None:
        """Before each execution: its memory (with its /tmp and no swap) and process count."""
        total = int(memory_bytes) + int(disk_bytes) + OVERHEAD
        processes = int(max_processes) + 4  # A, B and C are processes of the group too
        memory, pids = self.dirs.get("memory"), self.dirs.get("pids")
        if memory and self.version == 2:
            self._hold("memory", _write(f"{memory}/memory.max", str(total)))
            _write(f"{memory}/memory.swap.max", "0")
        elif memory:  # memory+swap may never be below memory: raise it first, lower it last
            _write(f"{memory}/memory.memsw.limit_in_bytes", str(total))  # absent without swap accounting
            self._hold("memory", _write(f"{memory}/memory.limit_in_bytes", str(total)))
            _write(f"{memory}/memory.memsw.limit_in_bytes", str(total))
        if pids:
            self._hold("pids", _write(f"{pids}/pids.max", str(processes)))

    def _hold(self, controller: str, written: bool) -> None:
        if not written:
            self.dirs.pop(controller, None)  # a limit we cannot set is no layer

    def procs_files(self) -> list[str]:
        return sorted({f"{path}/cgroup.procs" for path in self.dirs.values()})

    def remove(self) -> None:
        for path in set(self.dirs.values()):
            try:
                os.rmdir(path)
            except OSError:
                pass
        self.dirs.clear()


def join(procs_files: list[str], controllers: dict[str, str], layers: dict) -> None:
    """In A, before it drops root: move into the worker's group; records which controllers hold."""
    joined = {path: _write(path, str(os.getpid())) for path in procs_files}
    layers["memory_cgroup"] = bool(controllers.get("memory")) and joined.get(f"{controllers['memory']}/cgroup.procs",
                                                                             False)
    layers["pids_cgroup"] = bool(controllers.get("pids")) and joined.get(f"{controllers['pids']}/cgroup.procs", False)


PIPE_PAGES = 16  # a pipe's pages at its default size (64 KiB); F_SETPIPE_SZ, to grow one, is refused
OPEN_FILES = 256  # RLIMIT_NOFILE of an execution's processes, at most


def open_files(workers: int, max_processes: int, own_uid: bool) -> int:
    """RLIMIT_NOFILE for an execution's processes: what bounds its pipes, and so its pipe pages.

    The kernel counts pipe pages per uid, and past `fs.pipe-user-pages-soft` gives every new pipe of
    that uid 8 KiB. With a uid of its own (root) an execution can only reach its own count: 256.
    Sharing your uid, each execution's pipes (two fds each; at most max_processes processes) are held
    to its share, among `workers` executions at once, of half that limit, so your own pipes keep
    their 64 KiB whatever the completions do; never below 16 (Python and a subprocess need a few).
    """
    if own_uid:
        return OPEN_FILES
    try:
        with open("/proc/sys/fs/pipe-user-pages-soft") as file:
            soft = int(file.read())
    except (OSError, ValueError):
        soft = 16384  # the kernel's default
    if soft <= 0:
        return OPEN_FILES  # no soft limit: nothing to protect
    pipes = soft // 2 // max(1, workers) // (PIPE_PAGES * max(1, max_processes))
    return max(16, min(OPEN_FILES, 2 * pipes))
