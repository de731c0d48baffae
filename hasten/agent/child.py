"""The child process of generation.tool_isolation=process: runs one call, writes its result, leaves.

Below both forkers: the trainer forks it itself (agent/isolation.py) or the
fork server does (agent/forkserver.py); either way the child is run_child and
its end is kill_group. run_child:
- starts its own process group, so the kill at the deadline takes whatever it
  started too (threads, subprocesses), and a Ctrl-C meant for the trainer
  does not reach it; and a parent-death signal, so it dies with its forker;
- drops the trainer's signal handlers, and arms SIGALRM (default action:
  terminate) for the deadline plus a second, so it ends even if the trainer
  is gone, and even while it holds the GIL;
- calls the tool, turns the result into text bounded by the turn's limit
  (results.to_text) and writes one message on its pipe, `kind finished
  length text` (kind R: a result, E: the error text; finished: when, on the
  clock all processes share). The caller then leaves with os._exit, so none
  of the trainer's atexit handlers or buffers run twice.
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import os
import signal
import struct
import time

from .calls import Tool, ToolCall
from .results import failure_text, to_text

HEADER = struct.Struct("<cdQ")  # kind (R | E), when the tool finished (time.monotonic), length of the UTF-8 text
GRACE = 1.0  # seconds past the deadline before the child's own alarm ends it (the trainer kills it first)
PR_SET_PDEATHSIG = 1


def run_child(tool: Tool, call: ToolCall, write_fd: int, deadline: float, limit: int, parent: int) -> None:
    """parent: the pid of the process that forked it (the trainer, or the fork server)."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    # Dies with the process that forked it (the trainer's thread, or the fork server): a trainer killed
    # outright leaves no call running. What the call starts is its group's, killed when the call ends.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)  # it died before the signal was armed
    faulthandler.disable()  # a crash is reported as the call's error, not as a "Fatal Python error" in the log
    signal.set_wakeup_fd(-1)  # the trainer's wakeup pipe is not this process's to write
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(number, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline - time.monotonic()) + GRACE)
    try:
        if tool.is_async:
            asyncio.events._set_running_loop(None)  # forked from inside a running loop (a notebook): not this one
            value = asyncio.run(tool.fn(**call.arguments))
        else:
            value = tool.fn(**call.arguments)
        kind, text = b"R", to_text(value, limit)
    except BaseException as error:  # SystemExit included: it is the call's error, like any other
        kind, text = b"E", failure_text(call.name, error)
    data = text.encode("utf-8", errors="replace")
    view = memoryview(HEADER.pack(kind, time.monotonic(), len(data)) + data)  # CLOCK_MONOTONIC: one clock for all
    while view:
        view = view[os.write(write_fd, view):]


def kill_group(pid: int) -> None:
    """SIGKILL the child's process group (the child, zombie or not, still holds its id: no reuse race)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # already gone
        pass
