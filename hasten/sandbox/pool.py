"""The host side of the sandbox: pre-started workers, a result cache, batch runs.

`Sandbox.run_many([(code, program), ...])` is the call the rewards make: it
answers identical (code, tests, limits) jobs from an LRU cache, runs each
distinct job once per batch (both off with cache_size=0), and spreads the rest over `workers` worker
processes (one thread each feeds its worker; the threads only wait on pipes,
so the GIL is not the bottleneck). Workers are started lazily, restarted if
one dies, and stopped at exit. Code that does not parse never reaches a
worker: it gets a `syntax_error` result at once (the early-termination gate).

Each worker is `python -I -S worker.py` with an environment of PATH and LANG
only, so nothing it or its children can read holds the trainer's secrets.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import os
import queue
import struct
import subprocess
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from hasten.sandbox.programs import Limits, TestProgram
from hasten.sandbox.results import ExecutionResult, interpret, syntax_error_result

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
WORKER_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def default_workers() -> int:
    """One worker per core, at least 2 (executions spend part of their time waiting)."""
    return max(2, min(8, os.cpu_count() or 2))


@dataclass
class SandboxStats:
    executions: int = 0  # jobs that reached a worker
    cache_hits: int = 0  # answered from the cache or from an identical job in the same batch
    syntax_errors: int = 0  # gated without executing


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
        data = json.dumps(job).encode()
        try:
            assert self.process.stdin is not None and self.process.stdout is not None
            self.process.stdin.write(struct.pack("!I", len(data)) + data)
            self.process.stdin.flush()
            header = self.process.stdout.read(4)
            if len(header) < 4:
                raise EOFError("worker closed its pipe")
            (size,) = struct.unpack("!I", header)
            return json.loads(self.process.stdout.read(size))
        except (OSError, EOFError, ValueError) as error:
            # The worker itself died (it never runs the code, so this is rare): report, restart next time.
            self.close()
            return {"events": [{"event": "internal", "reason": f"worker lost: {error}"}]}

    def close(self) -> None:
        if self.process is not None:
            try:
                self.process.kill()
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self.process = None


class Sandbox:
    """Runs untrusted code against test programs in isolated processes."""

    def __init__(self, workers: int = 0, limits: Limits | None = None, cache_size: int = 4096):
        self.limits = limits or Limits()
        self.workers = workers or default_workers()
        self.cache_size = cache_size
        self.stats = SandboxStats()
        self._cache: collections.OrderedDict[str, ExecutionResult] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all = [_Worker() for _ in range(self.workers)]
        for worker in self._all:
            self._idle.put(worker)
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hasten-sandbox")
        weakref.finalize(self, Sandbox._shutdown, self._all, self._executor)

    # ------------------------------------------------------------- public API

    def run(self, code: str, program: TestProgram) -> ExecutionResult:
        return self.run_many([(code, program)])[0]

    def run_many(self, jobs: list[tuple[str, TestProgram]]) -> list[ExecutionResult]:
        """One result per job, in order; identical jobs execute once."""
        results: list[ExecutionResult | None] = [None] * len(jobs)
        pending: dict[str, list[int]] = {}  # cache key -> indices waiting on it
        for index, (code, program) in enumerate(jobs):
            try:
                compile(code, "<completion>", "exec")
            except (SyntaxError, ValueError) as error:  # ValueError: NUL bytes in the source
                results[index] = syntax_error_result(program, f"syntax error: {_one_line(error)}")
                self._count("syntax_errors")
                continue
            key = self._key(code, program)
            if self.cache_size <= 0:
                key = f"{key}:{index}"  # no cache, no de-duplication: every job executes
            cached = self._cache_get(key)
            if cached is not None:
                results[index] = cached
                self._count("cache_hits")
            elif key in pending:
                pending[key].append(index)
                self._count("cache_hits")
            else:
                pending[key] = [index]
        futures = {key: self._executor.submit(self._execute, *jobs[indices[0]]) for key, indices in pending.items()}
        for key, future in futures.items():
            result = future.result()
            self._cache_put(key, result)
            for position, index in enumerate(pending[key]):
                results[index] = result if position == 0 else replace(result, cached=True)
        return [result for result in results if result is not None]

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        Sandbox._shutdown(self._all, self._executor)

    # ------------------------------------------------------------- internals

    def _key(self, code: str, program: TestProgram) -> str:
        text = json.dumps([code, program.key(), self.limits.as_dict()], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def _cache_get(self, key: str) -> ExecutionResult | None:
        with self._lock:
            result = self._cache.get(key)
            if result is None:
                return None
            self._cache.move_to_end(key)
            return replace(result, cached=True)

    def _cache_put(self, key: str, result: ExecutionResult) -> None:
        if self.cache_size <= 0:
            return
        with self._lock:
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _execute(self, code: str, program: TestProgram) -> ExecutionResult:
        job = {"code": code, "program": program.as_dict(), "limits": self.limits.as_dict()}
        worker = self._idle.get()
        try:
            raw = worker.call(job)
        finally:
            self._idle.put(worker)
        self._count("executions")
        return interpret(raw, program, self.limits)

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
    return str(error).splitlines()[0] if str(error) else type(error).__name__


# One sandbox per (workers, limits, cache size) per process, shared by the code rewards
# and the task's checker so their cache is one; stopped at interpreter exit.
_SHARED: dict[tuple, Sandbox] = {}
_SHARED_LOCK = threading.Lock()


def shared_sandbox(workers: int = 0, limits: Limits | None = None, cache_size: int = 4096) -> Sandbox:
    limits = limits or Limits()
    key = (workers, limits, cache_size, os.getpid())  # a forked child must not reuse the parent's pipes
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = Sandbox(workers, limits, cache_size)
        return _SHARED[key]


@atexit.register
def _close_shared() -> None:
    for sandbox in _SHARED.values():
        sandbox.close()
