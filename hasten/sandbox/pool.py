"""The host side of the sandbox: pre-started workers, a result cache, batch runs.

`Sandbox.run_many([(code, program[, preamble]), ...])` is the call the
rewards make: it answers identical (code, tests, preamble, limits) jobs from
an LRU cache bounded in entries and in bytes, and runs each distinct job
exactly once however many threads ask at the same time: a job already
executing is waited for (its future), not started again, so the tests and
execution rewards share one run even from two reward workers (both off with
cache_size=0). The rest is spread over `workers` worker processes (one
thread each feeds its worker; the threads only wait on pipes, so the GIL is
not the bottleneck). Workers are started lazily, restarted if one dies, and
stopped at exit. Code that does not parse never reaches a worker: it gets a
`syntax_error` result at once (the early-termination gate).

Where Linux refuses the namespaces, every run raises SandboxRefused (one
line) unless the fallback was opted into (`fallback=True`,
code.sandbox_fallback), which warns once; docs/sandbox.md says what holds then.

Each worker is `python -I -S worker.py` with an environment of PATH and LANG
only, so nothing it or its children can read holds the trainer's secrets.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import hashlib
import json
import logging
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from hasten.errors import UserError
from hasten.sandbox.accounting import open_files
from hasten.sandbox.programs import Limits, TestProgram
from hasten.sandbox.results import ExecutionResult, crash_result, interpret, syntax_error_result

LOG = logging.getLogger("hasten.sandbox")
CACHE_BYTES = 64 << 20  # the result cache's memory bound, whatever cache_size says


class SandboxRefused(UserError):
    """The kernel refused the isolation the sandbox needs, and the fallback is not opted into."""

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
WORKER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def default_workers() -> int:
    """One worker per core, at least 2 (executions spend part of their time waiting)."""
    return max(2, min(8, os.cpu_count() or 2))


@dataclass
class SandboxStats:
    executions: int = 0  # jobs that reached a worker
    cache_hits: int = 0  # answered from the cache or from an identical job already running
    syntax_errors: int = 0  # gated without executing
    malformed: int = 0  # runs whose report could not be read (scored 0; the result's reason says why)
    refused: int = 0  # jobs whose isolation the kernel refused after the start-up probe held (scored as crashes)
    internal_errors: int = 0  # jobs the host side failed on (scored as crashes; the reason says why)


class _Worker:
    """One pre-started worker process and its length-prefixed JSON pipe."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", str(WORKER_SCRIPT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=WORKER_ENV, cwd="/", start_new_session=True, close_fds=True,
        )

    def call(self, job: dict) -> dict:
        if self.process is None or self.process.poll() is not None:
            self.process = self._start()
        process = self.process  # close() from another thread (the pool's end) may clear the attribute
        data = json.dumps(job).encode()
        try:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(struct.pack("!I", len(data)) + data)
            process.stdin.flush()
            header = process.stdout.read(4)
            if len(header) < 4:
                raise EOFError("worker closed its pipe")
            (size,) = struct.unpack("!I", header)
            return json.loads(process.stdout.read(size))
        except (OSError, EOFError, ValueError) as error:
            # The worker itself died (it never runs the code, so this is rare): report, restart next time.
            self.close()
            return {"events": [{"event": "internal", "reason": f"worker lost: {error}"}]}

    def close(self) -> None:
        """Stop the worker and everything it started, busy or not: nothing of it outlives the pool.

        EOF first: an idle worker exits at once and removes its cgroup. A busy one gets SIGTERM, and
        kills and reaps its job's processes itself (it is their subreaper); one that does not leave
        is SIGKILLed, its tree dying with it (parent-death signals, the pid namespace), and whatever
        it had started is killed from here too, by pidfd (no pid reused since can be hit).
        """
        process, self.process = self.process, None
        if process is None:
            return
        try:
            process.stdin.close()
            process.wait(timeout=0.5)
            return
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        tree = _descendants(process.pid)
        for stop, wait in ((process.terminate, 5.0), (process.kill, 5.0)):
            try:
                stop()
                process.wait(timeout=wait)
                break
            except (OSError, subprocess.TimeoutExpired):
                pass
        for pidfd in tree:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass  # already gone
            os.close(pidfd)


def _descendants(pid: int) -> list[int]:
    """Pidfds of every process below `pid`, found through /proc's children lists.

    Each is checked, once opened, to still be the child of the parent it was listed under: a pidfd
    then names that process for good, even after it dies and its pid is reused.
    """
    found: list[int] = []
    parents = [pid]
    while parents and len(found) < 65536:
        parent = parents.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as file:
                    children = [int(child) for child in file.read().split()]
            except OSError:
                continue
            for child in children:
                try:
                    pidfd = os.pidfd_open(child)
                except OSError:
                    continue
                try:
                    with open(f"/proc/{child}/stat") as file:
                        still_ours = int(file.read().rsplit(")", 1)[1].split()[1]) == parent
                except (OSError, ValueError, IndexError):
                    still_ours = False
                if still_ours:
                    found.append(pidfd)
                    parents.append(child)
                else:
                    os.close(pidfd)
    return found


class Sandbox:
    """Runs untrusted code against test programs in isolated processes."""

    def __init__(self, workers: int = 0, limits: Limits | None = None, cache_size: int = 4096,
                 fallback: bool = False, cache_bytes: int = CACHE_BYTES):
        self.limits = limits or Limits()
        self.workers = workers or default_workers()
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.fallback = fallback
        self.stats = SandboxStats()
        self._cache: collections.OrderedDict[str, ExecutionResult] = collections.OrderedDict()
        self._cached_bytes = 0
        self._running: dict[str, Future] = {}  # key -> the one execution of it under way
        self._warned = False
        self._probed: SandboxRefused | bool = False  # True once isolation held; the error if it never did
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all = [_Worker() for _ in range(self.workers)]
        for worker in self._all:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hasten-sandbox")
        weakref.finalize(self, Sandbox._shutdown, self._all, self._executor)

    # ------------------------------------------------------------- public API

    def run(self, code: str, program: TestProgram, preamble: str = "",
            deadline: float | None = None) -> ExecutionResult:
        return self.run_many([(code, program, preamble)], deadline)[0]

    def run_many(self, jobs: list[tuple], deadline: float | None = None) -> list[ExecutionResult]:
        """One result per (code, program[, preamble]) job, in order; identical jobs execute once.

        The preamble is the row's trusted prompt code (imports, helpers): the judge runs its own
        copy, so helpers the tests call cannot be replaced by the completion.

        deadline (time.monotonic()): the caller's own end, the python tool's call. A job still
        waiting for a worker then never starts, and a running one is killed at it, so nothing the
        caller gave up on runs on and holds a worker. Such runs are neither cached nor shared:
        a result cut short by one caller's deadline is not another's.
        """
        self._probe()  # SandboxRefused (no namespaces, no fallback) surfaces here, once, before any job
        results: list[ExecutionResult | None] = [None] * len(jobs)
        waiting: list[tuple[int, Future, bool]] = []  # (index, future, this call started it)
        for index, (code, program, *rest) in enumerate(jobs):
            preamble = rest[0] if rest else ""
            try:
                compile(code, "<completion>", "exec")
            except Exception as error:  # noqa: BLE001 - SyntaxError, NUL bytes (ValueError), RecursionError, ...
                reason = (f"syntax error: {_one_line(error)}" if isinstance(error, SyntaxError)
                          else f"does not compile: {type(error).__name__}: {_one_line(error)}")
                results[index] = syntax_error_result(program, reason)
                self._count("syntax_errors")  # the completion's failure, never the run's
                continue
            key = self._key(code, program, preamble)
            if self.cache_size <= 0 or deadline is not None:
                key = f"{key}:{id(results)}:{index}"  # no cache, no de-duplication: every job executes
            with self._lock:  # look up and claim in one step, so two threads never both start a key
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    self.stats.cache_hits += 1
                    results[index] = replace(cached, cached=True)
                    continue
                future = self._running.get(key)
                started = future is None
                if started:
                    future = self._running[key] = self._executor.submit(self._execute, key, code, program, preamble,
                                                                        deadline)
                else:
                    self.stats.cache_hits += 1
            waiting.append((index, future, started))
        first_seen: set[int] = set()
        for index, future, started in waiting:
            result = future.result()  # never raises: _execute turns every failure into a crash result
            owner = started and id(future) not in first_seen
            first_seen.add(id(future))
            results[index] = result if owner else replace(result, cached=True)
        return [result for result in results if result is not None]

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0

    def close(self) -> None:
        Sandbox._shutdown(self._all, self._executor)

    # ------------------------------------------------------------- internals

    def _key(self, code: str, program: TestProgram, preamble: str) -> str:
        text = json.dumps([code, program.key(), preamble, self.limits.as_dict(), self.fallback], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _probe(self) -> None:
        """Run one trivial job the first time: the kernel's refusal is a UserError here, and only here.

        Once isolation held, a later refusal (say, another process exhausted the per-uid namespace
        limit) is that job's crash, never an exception in the trainer.
        """
        with self._probe_lock:
            if self._probed is False:
                program = TestProgram(mode="asserts", tests=("pass",))
                raw = self._call("pass\n", program, "")
                try:
                    self._check_isolation(raw)
                    self._probed = True
                except SandboxRefused as error:
                    self._probed = error
                else:
                    self._say_what_is_missing(interpret(raw, program, self.limits).layers,
                                              open_files(self.workers, self.limits.max_processes, own_uid=False))
        if isinstance(self._probed, SandboxRefused):
            raise self._probed

    def _call(self, code: str, program: TestProgram, preamble: str, deadline: float | None = None) -> dict:
        """One job on the next idle worker (waiting for one, until the deadline), returned to the pool whatever happens."""
        job = {"code": code, "program": program.as_dict(), "preamble": preamble,
               "limits": self.limits.as_dict(), "fallback": self.fallback, "deadline": deadline,
               "workers": self.workers}
        try:
            if deadline is not None and deadline <= time.monotonic():
                raise queue.Empty
            worker = self._idle.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return {"events": [], "timed_out": True}  # the caller's deadline came before a free worker
        try:
            return worker.call(job)
        finally:
            self._idle.put(worker)

    @staticmethod
    def _say_what_is_missing(layers: dict[str, bool], files: int = 0) -> None:
        """Once per sandbox, at the probe: the layers this kernel or architecture does not give."""
        if not layers.get("seccomp", False):
            warnings.warn(f"the code sandbox has no syscall allowlist on this machine ({os.uname().machine}; "
                          "seccomp.py knows x86-64): unix socket pairs, memfd, SysV shm, ptys and locks are "
                          "not filtered (docs/sandbox.md)", RuntimeWarning, stacklevel=3)
        if not layers.get("own_uid", False):
            warnings.warn(f"the code sandbox runs as your uid ({os.geteuid()}), not a uid of its own (that needs "
                          "root): a completion's pending signals, pipe buffers and processes count against your "
                          f"per-uid limits (its pipes held by {files or 'a few'} open files per process; "
                          "docs/sandbox.md)", RuntimeWarning, stacklevel=3)
        missing = [name for name in ("memory_cgroup", "pids_cgroup") if not layers.get(name, False)]
        if missing:
            warnings.warn(f"the code sandbox has no per-execution cgroup here ({', '.join(missing)}: needs root and "
                          "a writable /sys/fs/cgroup): an execution's memory is bounded per process only "
                          "(RLIMIT_AS x max_processes), its kernel memory not at all, its processes by "
                          "RLIMIT_NPROC (docs/sandbox.md)", RuntimeWarning, stacklevel=3)

    def _execute(self, key: str, code: str, program: TestProgram, preamble: str,
                 deadline: float | None = None) -> ExecutionResult:
        """Runs in a pool thread; never raises. The result is cached before the key stops being 'running'."""
        try:
            raw = self._call(code, program, preamble, deadline)
            try:
                self._check_isolation(raw)
            except SandboxRefused as error:
                self._count("refused")
                LOG.warning("sandbox: isolation refused for one job, scored as a crash (%s)", error)
                return crash_result(program, f"isolation refused for this job: {_one_line(error)}"[:300])
            result = interpret(raw, program, self.limits)
            with self._lock:
                self.stats.executions += 1
                self.stats.malformed += result.malformed
                if deadline is None:
                    self._cache_put(key, result)
            return result
        except Exception as error:  # noqa: BLE001 - the host side's own failure is this job's crash
            self._count("internal_errors")
            LOG.warning("sandbox: a job failed on the host side, scored as a crash (%s: %s)",
                        type(error).__name__, _one_line(error))
            return crash_result(program, f"sandbox error: {type(error).__name__}: {_one_line(error)}"[:300])
        finally:
            with self._lock:
                self._running.pop(key, None)

    def _check_isolation(self, raw: dict) -> None:
        events = raw.get("events") if isinstance(raw, dict) else None
        for event in events if isinstance(events, list) else []:
            if isinstance(event, dict) and event.get("event") == "refused":
                raise SandboxRefused(
                    f"sandbox error: Linux refused the isolation the code sandbox needs ({event.get('reason')}); "
                    "set code.sandbox_fallback=true to run with the weaker fallback (docs/sandbox.md)")
            layers = event.get("layers") if isinstance(event, dict) else None
            if self.fallback and not self._warned and isinstance(layers, dict) and not all(
                    layers.get(name, True) for name in ("user_namespace", "mount_namespace", "pid_namespace",
                                                        "network_namespace", "ipc_namespace")):
                self._warned = True
                warnings.warn("the code sandbox runs in its fallback: some namespaces were refused "
                              f"({', '.join(k for k, v in layers.items() if v is False)}); "
                              "docs/sandbox.md says what that leaves open", RuntimeWarning, stacklevel=2)

    def _cache_put(self, key: str, result: ExecutionResult) -> None:
        """Called with the lock held."""
        if self.cache_size <= 0:
            return
        size = result.size_bytes()
        if size > self.cache_bytes:
            return
        self._cache[key] = result
        self._cached_bytes += size
        while len(self._cache) > self.cache_size or self._cached_bytes > self.cache_bytes:
            _, evicted = self._cache.popitem(last=False)
            self._cached_bytes -= evicted.size_bytes()

    def _count(self, name: str) -> None:
        with self._lock:  # run_many may be called from several threads at once
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    @staticmethod
    def _shutdown(workers: list[_Worker], executor: ThreadPoolExecutor) -> None:
        executor.shutdown(wait=False)
        for worker in workers:
            worker.close()


def _one_line(error: BaseException) -> str:
    if isinstance(error, SyntaxError):
        return f"{error.msg} (line {error.lineno})"
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


# One sandbox per (workers, limits, cache size) per process, shared by the code rewards
# and the task's checker so their cache is one; stopped at interpreter exit.
_SHARED: dict[tuple, Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(workers: int = 0, limits: Limits | None = None, cache_size: int = 4096,
                   fallback: bool = False) -> Sandbox:
    limits = limits or Limits()
    key = (workers, limits, cache_size, fallback, os.getpid())  # a forked child must not reuse the parent's pipes
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Sandbox(workers, limits, cache_size, fallback)
        return _SHARED[key]


def shared_stats() -> dict[str, int]:
    """The shared sandboxes' counters added up (executions, cache hits, syntax errors, malformed reports);
    {} when no code ran in this process."""
    with _SHARED_LOCK:
        sandboxes = list(_SHARED.values())
    if not sandboxes:
        return {}
    totals = dataclasses.asdict(SandboxStats())
    for sandbox in sandboxes:
        for name, value in dataclasses.asdict(sandbox.stats).items():
            totals[name] += value
    return totals


@atexit.register
def close_shared() -> None:
    """Stop every shared sandbox's workers: at the end of a training run (its finally) and at exit."""
    with _SHARED_LOCK:
        sandboxes = list(_SHARED.values())
        _SHARED.clear()
    for sandbox in sandboxes:
        sandbox.close()
