"""The candidate side: the only code that runs in the process with the model's code (C).

It runs the code (and the test program's setup) in a fresh namespace, says
whether that loaded, then serves the judge's requests one at a time:

    {"id": n, "op": "get", "name": "add"}                      a global of the code
    {"id": n, "op": "attr", "target": h, "name": "__name__"}   an attribute of a handle
    {"id": n, "op": "call", "target": h, "args": [...], "kwargs": [[k, v], ...], "seconds": s}

Each answer is {"id": n, "ok": true, "value": <wire.encode>} or {"id": n,
"ok": false, "error": "ValueError", "message": "...", "timeout": bool}.
Values that are not plain data stay here as handles. Nothing this process
says decides a verdict by itself: the judge compares plain data it rebuilt
(wire.py), and the test program, with its expected values, never enters
this process (the worker forks it from a zygote that never saw a test).
Hostile code may rewrite all of this module; the judge assumes it does.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import wire  # a top-level module in the worker (python -I -S); see worker.py


class TestTimeout(BaseException):
    """Raised by the interval timer; a BaseException so that `except Exception` in the code misses it."""


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def _send(fd: int, message: dict) -> None:
    data = wire.dumps(message)
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:
            return  # the judge is gone; nothing left to tell


def _timed(seconds: float, action):
    """Run action() under an interval timer; the timer is off again whatever happens."""
    signal.setitimer(signal.ITIMER_REAL, max(0.001, seconds))
    try:
        return action()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def serve(job: dict, requests: int, replies: int) -> None:
    """Load the code, report, answer requests until the judge closes its end."""

    def on_alarm(signum, frame):
        raise TestTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    per_test = float(job["limits"]["test_seconds"])
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    loaded: dict[str, Any] = {"event": "loaded", "ok": True}
    try:
        _timed(per_test, lambda: exec(compile(job["code"], "<completion>", "exec"), namespace))
        if job.get("setup"):
            _timed(per_test, lambda: exec(compile(job["setup"], "<test setup>", "exec"), namespace))
    except BaseException as error:  # noqa: BLE001 - anything the code raises is its verdict
        loaded.update(ok=False, status="timeout" if isinstance(error, TestTimeout) else "error",
                      reason=f"{type(error).__name__}: {_describe(error)}".rstrip(": "))
    _send(replies, loaded)
    if not loaded["ok"]:
        return
    handles: dict[int, Any] = {}

    def to_handle(value: Any) -> list:
        handles[len(handles) + 1] = value
        return ["h", len(handles), type(value).__name__]

    def from_handle(number: int, _name: str) -> Any:
        return handles[number]

    reader = wire.LineReader(requests)
    while True:
        line = reader.pop()
        if line is None:
            if reader.closed:
                return
            reader.fill()
            continue
        request = wire.loads(line)
        answer: dict[str, Any] = {"id": request.get("id")}
        try:
            value = _timed(float(request.get("seconds", per_test)),
                           lambda: _perform(request, namespace, from_handle, to_handle))
            answer.update(ok=True, value=value)
        except BaseException as error:  # noqa: BLE001 - the call failed; the judge decides what that means
            answer.update(ok=False, error=type(error).__name__, message=_describe(error),
                          timeout=isinstance(error, TestTimeout))
        _send(replies, answer)


def _perform(request: dict, namespace: dict, from_handle, to_handle) -> Any:
    """One request -> its encoded answer (runs under the caller's timer)."""
    op = request.get("op")
    if op == "get":
        return wire.encode(namespace[request["name"]], to_handle)
    target = from_handle(request["target"], "")
    if op == "attr":
        return wire.encode(getattr(target, request["name"]), to_handle)
    if op == "call":
        args = [wire.decode(item, from_handle) for item in request["args"]]
        kwargs = {key: wire.decode(item, from_handle) for key, item in request["kwargs"]}
        return wire.encode(target(*args, **kwargs), to_handle)
    raise ValueError(f"unknown request {op!r}")


def prepare(workdir: str) -> None:
    """Interpreter settings for the code: its own dir as home and temp, output line-buffered."""
    import tempfile

    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"})
    tempfile.tempdir = workdir
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 3000))
    sys.dont_write_bytecode = True
