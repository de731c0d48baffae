"""A fork server for tool_isolation=process: each call's child forked from a small copy of the trainer.

A fork copies the parent's page tables, so forking the trainer itself costs
time in proportion to its resident memory (a model, its gradients and the
optimizer's state: docs/agentic.md has the measurements). make_agent starts
this server before the model loads, when the trainer is small; from then on
each call's child is a fork of the server, a few milliseconds whatever the
trainer's size. What a tool sees is therefore the trainer as it was when the
run's tools were loaded (its module, its closures), not the trainer's later
state; a tool never changed the trainer's state in either case.

The server is single-threaded, so its forks inherit no lock another thread
holds. Protocol, over a SOCK_SEQPACKET socket pair (one message per send):

    trainer -> server   ("call", name, arguments, deadline, limit)
                        ("kill", pid)      the deadline passed: SIGKILL the child's group
    server -> trainer   ("child", pid) + the read end of the child's pipe (SCM_RIGHTS)
                        ("failed", reason) no process could be forked
                        ("status", pid, waitpid status) when a child ends

The child itself is agent/child.py's run_child: its own process group and alarm, a
parent-death signal, the result as bounded text on its pipe. The server
reaps its children (so a kill never hits a reused pid) and reports how each
ended. A call is one unit: when its child ends, whatever it started in its
process group is killed (before the child is reaped, so the group's id is
still the child's); and the server is a child subreaper, so a process the
tool moved out of its group (a new session) comes back to the server when
the call ends, and is killed then. It leaves when the trainer closes the
socket or is gone (its parent changes), killing every process it still has.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import socket
import time
import weakref

from .calls import Tool, ToolCall
from .child import kill_group, run_child

PR_SET_CHILD_SUBREAPER = 36

POLL_MS = 1000  # how often the server checks that the trainer is still there


class ForkServer:
    """The trainer's end: start(name, arguments, deadline, limit) -> (pid, fd); kill(pid); status(pid, wait)."""

    def __init__(self, tools: dict[str, Tool]):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                _serve(theirs, tools, parent)
            finally:
                os._exit(0)
        theirs.close()
        self.pid, self.socket = pid, ours
        self.names = frozenset(tools)  # the tools it can run (the trainer forks itself for any other)
        self.statuses: dict[int, int] = {}
        self.broken = False
        self._poll = select.poll()  # not select.select: the trainer may hold more than 1024 fds
        self._poll.register(ours, select.POLLIN)
        self._finalizer = weakref.finalize(self, _stop, pid, ours)

    def start(self, name: str, arguments: dict, deadline: float, limit: int) -> tuple[int, int]:
        """Ask for a child running tool `name`; OSError when none can be had (the call then fails)."""
        try:
            self.socket.send(pickle.dumps(("call", name, arguments, deadline, limit)))
            message, fds = self._receive(timeout=10.0)
        except (OSError, EOFError, pickle.UnpicklingError):
            self.broken = True  # the server is gone: the caller forks from the trainer from now on
            raise OSError(0, "the fork server is gone") from None
        if message[0] == "failed":
            raise OSError(0, message[1])
        self.statuses.pop(message[1], None)  # an earlier child's, with the same (reused) pid
        return message[1], fds[0]

    def kill(self, pid: int) -> None:
        try:
            self.socket.send(pickle.dumps(("kill", pid)))
        except OSError:
            self.broken = True

    def status(self, pid: int, wait: float) -> int | None:
        """How child `pid` ended (waitpid's status), waiting up to `wait` s for the server to say."""
        give_up = time.monotonic() + wait
        while pid not in self.statuses and not self.broken:
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                return None
            try:
                self._receive(timeout=remaining, statuses=True)
            except TimeoutError:
                return None
            except (OSError, EOFError, pickle.UnpicklingError):
                self.broken = True
        return self.statuses.pop(pid, None)

    def _receive(self, timeout: float, statuses: bool = False) -> tuple[tuple, list[int]]:
        """The next message that is not a status (statuses are filed as they come; statuses=True: any message)."""
        give_up = time.monotonic() + timeout
        while True:
            if not self._poll.poll(max(0.0, give_up - time.monotonic()) * 1000):
                raise TimeoutError
            data, fds, _, _ = socket.recv_fds(self.socket, 1 << 16, 1)
            if not data:
                raise EOFError
            message = pickle.loads(data)
            if message[0] == "status":
                self.statuses[message[1]] = message[2]
                if len(self.statuses) > 4096:  # children whose status nobody asked for (they sent a result)
                    self.statuses.pop(next(iter(self.statuses)))
                if not statuses:
                    continue
            return message, fds

    def close(self) -> None:
        self._finalizer()


def _stop(pid: int, ours: socket.socket) -> None:
    ours.close()  # the server leaves on EOF, killing what its calls started; SIGKILL in case it is stuck
    give_up = time.monotonic() + 5.0
    try:
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > give_up:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
    except OSError:
        pass


def start_fork_server(tools: list[Tool]) -> ForkServer | None:
    """A server for the tools that run in child processes; None when there are none or it cannot start."""
    if not tools:
        return None
    try:
        return ForkServer({tool.name: tool for tool in tools})
    except OSError:  # no process to be had: each call forks from the trainer instead
        return None


def _serve(connection: socket.socket, tools: dict[str, Tool], parent: int) -> None:
    os.setpgid(0, 0)  # a Ctrl-C for the trainer's terminal does not reach the server
    # Orphans of a call (a tool's subprocess in a session of its own) come back here, to be killed.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup byte is the point: poll returns, children are reaped
    children: set[int] = set()
    poller = select.poll()
    poller.register(connection, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    try:
        while os.getppid() == parent:
            for fd, _ in poller.poll(POLL_MS):
                if fd == wake_read:
                    os.read(wake_read, 512)
                    continue
                data = connection.recv(1 << 20)
                if not data:
                    return
                request = pickle.loads(data)
                if request[0] == "kill" and request[1] in children:
                    kill_group(request[1])
                elif request[0] == "call":
                    _fork_child(connection, tools, request, children, (wake_read, wake_write))
            _reap(connection, children)
            _kill_strays(children)
    finally:
        for pid in children:
            kill_group(pid)
        _end_all()


def _fork_child(connection: socket.socket, tools: dict[str, Tool], request: tuple, children: set[int],
                wake: tuple[int, int]) -> None:
    _, name, arguments, deadline, limit = request
    read_fd, write_fd = os.pipe()
    server = os.getpid()
    try:
        pid = os.fork()
    except OSError as error:
        os.close(read_fd)
        os.close(write_fd)
        connection.send(pickle.dumps(("failed", error.strerror)))
        return
    if pid == 0:
        try:
            connection.close()
            os.close(read_fd)
            for fd in wake:
                os.close(fd)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            run_child(tools[name], ToolCall(name, arguments), write_fd, deadline, limit, server)
        finally:
            os._exit(0)
    os.close(write_fd)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    children.add(pid)
    socket.send_fds(connection, [pickle.dumps(("child", pid))], [read_fd])
    os.close(read_fd)


def _reap(connection: socket.socket, children: set[int]) -> None:
    while True:
        try:  # WNOWAIT: look first, so the child's pid (its group's id) is still held while the group is killed
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == 0:
            return
        pid = info.si_pid
        if pid in children:
            kill_group(pid)  # the call ended: what it started in its group ends with it
        _, status = os.waitpid(pid, 0)
        if pid not in children:
            continue  # a stray that came back to us (we are its subreaper) and was killed
        children.discard(pid)
        try:
            connection.send(pickle.dumps(("status", pid, status)))
        except OSError:
            return


def _own_children() -> set[int]:
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as file:
                found.update(int(pid) for pid in file.read().split())
        except OSError:
            pass
    return found


def _kill_strays(calls: set[int]) -> None:
    """SIGKILL every child that is not a running call: orphans of ended calls (still ours: no pid reuse)."""
    for pid in _own_children() - calls:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _end_all(seconds: float = 5.0) -> None:
    """Kill and reap every child until none is left: a call's child that dies hands us its orphans only
    then, so the kill repeats. Reaped here, as a trainer that is pid 1 of a container reaps no orphans."""
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        _kill_strays(set())
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.002)
        except ChildProcessError:
            return


