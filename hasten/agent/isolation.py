"""generation.tool_isolation=process: each user tool call in a child process, killed at its deadline.

Where the child comes from: the fork server (agent/forkserver.py) that
make_agent starts before the model loads, so a fork costs milliseconds
whatever the trainer's size; without one (an Agent built directly, or a
server that died) the trainer forks the child itself, which costs time in
proportion to its resident memory. Either way a child per call: no state is
carried from one call to the next, and the tool cannot change the trainer's
state, since what it writes stays in the child.

The child is agent/child.py's run_child: its own process group and alarm, the
result as bounded text on its pipe.

The trainer reads every child's pipe at once (one selector) until each has
sent its whole message or its deadline passes, then kills each
child's process group and reaps it (the fork server does both for its
children). A result that finished after the deadline is timed out however
soon it is read (the trainer may be busy forking the turn's other calls).
A child without a whole message was late (timed out), crashed
(its signal is named), or ended its own process (os._exit, exit code
named): each is that call's error string, never the run's.
"""

from __future__ import annotations

import os
import selectors
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from .calls import Tool, ToolCall
from .child import HEADER, kill_group, run_child
from .forkserver import ForkServer
from .results import CallResult, timed_out


@dataclass
class _Child:
    name: str
    pid: int = 0
    fd: int = -1
    buffer: bytearray = field(default_factory=bytearray)
    message: tuple[bytes, float, str] | None = None  # (kind, finished, text) once whole
    oversized: bool = False
    closed: bool = False  # the pipe reached EOF: the child (and all it started) ended before the deadline
    status: int | None = None  # waitpid's, once reaped
    failed_to_start: str = ""
    served: bool = False  # forked by the fork server (agent/forkserver.py), which reaps it
    deadline: float = 0.0  # its start + the timeout: each call gets the whole timeout, however late it forked


class Children:
    """One turn's child processes: start(tool, call) forks one; collect() waits for all, then kills and reaps."""

    def __init__(self, timeout: float, limit: int, server: ForkServer | None = None):
        self.timeout, self.limit, self.server = timeout, limit, server
        self.children: list[_Child] = []

    def start(self, tool: Tool, call: ToolCall) -> Callable[[], CallResult]:
        child = _Child(call.name, deadline=time.monotonic() + self.timeout)
        try:
            if self.server is not None and not self.server.broken and call.name in self.server.names:
                try:
                    child.pid, child.fd = self.server.start(call.name, call.arguments, child.deadline, self.limit)
                    child.served = True
                except OSError:
                    if not self.server.broken:
                        raise
            if not child.served:  # no server (or it is gone): fork the trainer itself
                child.pid, child.fd = _fork(tool, call, child.deadline, self.limit)
        except OSError as error:  # EAGAIN / ENOMEM: no process to be had, this call fails
            child.failed_to_start = f"error: {call.name} could not start its process ({error.strerror})"
        self.children.append(child)
        return lambda: self._result(child)

    def collect(self) -> None:
        """Read every pipe until its message is whole or its deadline passes; then kill and reap every child."""
        most = HEADER.size + 4 * self.limit + 64  # UTF-8 takes up to 4 bytes a character
        with selectors.DefaultSelector() as selector:
            for child in self.children:
                if child.fd >= 0:
                    selector.register(child.fd, selectors.EVENT_READ, child)
            while selector.get_map():
                earliest = min(key.data.deadline for key in selector.get_map().values())
                ready = selector.select(max(0.0, earliest - time.monotonic()))
                for key, _ in ready:
                    child = key.data
                    chunk = os.read(child.fd, 1 << 16)
                    child.buffer += chunk
                    child.message = _message(child.buffer)
                    child.oversized = len(child.buffer) > most
                    child.closed = not chunk
                    if not chunk or child.message is not None or child.oversized:
                        selector.unregister(child.fd)
                now, read = time.monotonic(), {key.fd for key, _ in ready}
                for key in list(selector.get_map().values()):  # past its deadline with nothing left to read
                    if key.data.deadline <= now and key.fd not in read:
                        selector.unregister(key.fd)
        for child in self.children:
            if child.fd >= 0:
                os.close(child.fd)
            if child.served and self.server is not None:
                if not child.closed and child.message is None:
                    self.server.kill(child.pid)  # the server reaps it: a kill never reaches a reused pid
                elif child.message is None and not child.oversized:  # it ended without a result: how?
                    child.status = self.server.status(child.pid, wait=2.0)
            elif child.pid:
                kill_group(child.pid)
                try:
                    child.status = os.waitpid(child.pid, 0)[1]
                except ChildProcessError:  # reaped by someone else (SIGCHLD ignored, an os.wait()): status unknown
                    pass

    def _result(self, child: _Child) -> CallResult:
        if child.failed_to_start:
            return CallResult(child.name, child.failed_to_start, True)
        if child.message is not None:
            kind, finished, text = child.message
            if finished > child.deadline:  # read in time, but the tool ended late: timed out, always
                return CallResult(child.name, timed_out(child.name, self.timeout), True)
            return CallResult(child.name, text, kind == b"E")
        if child.oversized:
            return CallResult(child.name, f"error: {child.name} returned more than the {self.limit} characters "
                                          "a tool turn may hold", True)
        if not child.closed:  # still writing, or still running, at the deadline
            return CallResult(child.name, timed_out(child.name, self.timeout), True)
        if child.status is None:
            return CallResult(child.name, f"error: {child.name} ended its process without returning a result", True)
        status = child.status
        if os.WIFSIGNALED(status):
            return CallResult(child.name, f"error: {child.name} crashed ({signal.Signals(os.WTERMSIG(status)).name})",
                              True)
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
        return CallResult(child.name, f"error: {child.name} ended its process (exit code {code}) without returning "
                                      "a result", True)


def _message(buffer: bytearray) -> tuple[bytes, float, str] | None:
    if len(buffer) < HEADER.size:
        return None
    kind, finished, length = HEADER.unpack_from(buffer)
    if len(buffer) < HEADER.size + length:
        return None
    return kind, finished, bytes(buffer[HEADER.size:HEADER.size + length]).decode("utf-8", errors="replace")


def _fork(tool: Tool, call: ToolCall, deadline: float, limit: int) -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # else the child's copy of unwritten output could be written twice
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        raise
    if pid == 0:
        try:
            os.close(read_fd)
            run_child(tool, call, write_fd, deadline, limit, parent)
        finally:
            os._exit(0)  # never return into the trainer's code (tools.py's os._exit guard lets a child exit)
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)  # also in the child: whichever runs first, the group exists before any kill
    except OSError:
        pass
    return pid, read_fd
