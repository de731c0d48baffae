"""Sandbox worker: a pre-started process that runs one untrusted program per job.

Started by `hasten.sandbox.pool` as `python -I -S worker.py` with a scrubbed
environment, it imports only the standard library and its sibling modules
(wire, isolation, world, seccomp, accounting, candidate, judge; no torch, no
hasten), reads length-prefixed JSON jobs on stdin and answers each with one
JSON result on stdout. Per job:

    worker (subreaper: enforces the wall clock, caps output, kills and reaps everything after)
      ├─ J  forked by the zygote; own mount namespace and built root; reads this job's tests; runs them,
      │     calls the candidate through a pipe (judge.py)
      └─ A  forked by the zygote; joins the worker's cgroup; setsid; root -> its own uid; unshare(user, mount, ...)
           └─ B  pid 1 of the new pid namespace: builds the root (world.py), reports C's layers from /proc
                 └─ C  own session, rlimits, no capabilities, not dumpable, no_new_privs, syscall allowlist;
                       reads its code; serves J

The zygote is forked at start, before any job is read, and only ever gets the
limits and pipe ends: C reads the code and setup from its own pipe after the
last fork, so neither an earlier job's code nor any test is in the memory C
is forked from. Every process of a job is killed and reaped in a `finally`
(the worker is a child subreaper, so orphans come back to it), and whatever
bytes the tree sends are handled. docs/sandbox.md has the threat model.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import signal
import socket
import struct
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accounting  # noqa: E402
import candidate  # noqa: E402
import isolation  # noqa: E402
import judge  # noqa: E402
import wire  # noqa: E402
import world  # noqa: E402

del sys.path[0]  # the code under test finds nothing of hasten's on its path


def _send_line(fd: int, record: dict) -> None:
    try:
        os.write(fd, wire.dumps(record))
    except OSError:
        pass  # the reader is gone (deadline passed); nothing left to tell


# ------------------------------------------------------- the sandboxed tree


def _tree(job: dict, fds: list[int]) -> None:
    """Body of A (never returns): namespaces, then B, which sets up the file system and runs C."""
    requests, replies, stdout, stderr, tree, source = fds
    layers: dict = {}
    try:
        isolation.await_parent(job["middle"])
        os.setsid()
        isolation.close_fds_except(set(fds))
        accounting.join(job["cgroup"]["procs"], job["cgroup"]["dirs"], layers)  # while still root, if we are
        strict = not job["fallback"]
        isolation.enter_namespaces(strict, layers, job["workdir"])
        # The uid change cleared the parent-death signal: set it again, so A (and through B's own, the pid
        # namespace) dies with a worker killed outright (the pool's SIGKILL), never living on with ppid 1.
        isolation.die_with(job["worker"])
        a_pid = os.getpid()
        if os.fork() == 0:
            isolation.die_with(0 if layers["pid_namespace"] else a_pid)  # a parent outside our pid namespace reads as 0
            workdir = isolation.setup_filesystem(
                job["limits"]["disk_bytes"], job["limits"]["tmp_inodes"], layers, strict) or job["workdir"]
            b_pid = os.getpid()  # 1 in its own pid namespace
            code_pid = os.fork()
            if code_pid == 0:
                _code(job, workdir, fds, b_pid)
            for fd in (requests, replies, stdout, stderr, source):
                os.close(fd)
            isolation.libc.prctl(isolation.PR_SET_DUMPABLE, 0, 0, 0, 0)  # C may not ptrace B
            # C's own layers as the kernel shows them to B, never as C reports them.
            layers.update(isolation.inspect(code_pid, job["limits"], layers))
            _send_line(tree, {"event": "layers", "layers": layers})
            _, status = os.waitpid(code_pid, 0)
            report = {"event": "exit", "layers": layers}
            report.update({"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else
                          {"code": os.WEXITSTATUS(status)})
            _send_line(tree, report)
            os._exit(0)
        for fd in (requests, replies, stdout, stderr, source):
            os.close(fd)
        os.wait()
    except isolation.Refused as error:
        _send_line(tree, {"event": "refused", "reason": str(error)[:300], "layers": layers})
    except BaseException:  # noqa: BLE001
        _send_line(tree, {"event": "internal", "reason": traceback.format_exc(limit=2)[-300:]})
    os._exit(0)


def _code(job: dict, workdir: str, fds: list[int], parent: int) -> None:
    """Body of C: the only process that runs untrusted code."""
    requests, replies, stdout, stderr, tree, source = fds
    try:
        isolation.die_with(parent)  # B; its death also ends the pid namespace, and every process in it
        # A session of its own: kill(0, ...) and killpg from the code reach C and its children only,
        # never A, which shares B's group and lives in the host's pid namespace.
        os.setsid()
        os.close(tree)
        job = dict(job, **_read_source(source))  # the code enters this process only, after every fork
        os.chdir(workdir)
        devnull = os.open(os.devnull, os.O_RDONLY)  # opened inside the namespace
        os.dup2(devnull, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        isolation.close_fds_except({requests, replies})  # the source pipe too
        isolation.drop_privileges(job["limits"])
        candidate.prepare(workdir)
        candidate.serve(job, requests, replies)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001 - the judge sees the pipe close
        pass
    os._exit(0)


def _read_source(fd: int) -> dict:
    """C's code and setup, read from the worker's pipe until EOF (the worker writes them after the forks)."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return json.loads(b"".join(chunks))


def _zygote(channel: socket.socket) -> None:
    """Forks a tree or a judge per request; forked before any job was read, and never sent code or tests.

    It gets the limits and the pipe ends; C reads its code, and J its tests, from one of them after
    the last fork, so no earlier job's bytes sit in the memory either is forked from.
    """
    worker = os.getppid()
    isolation.die_with(worker)  # it holds no code, but a zygote left behind is a process that outlives the run
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    isolation.close_fds_except({channel.fileno()})
    while True:
        try:
            header, fds, _, _ = socket.recv_fds(channel, 4, 6)
            if len(header) < 4:
                os._exit(0)
            (size,) = struct.unpack("!I", header)
            payload = bytearray()
            while len(payload) < size:
                chunk = channel.recv(size - len(payload))
                if not chunk:
                    os._exit(0)
                payload += chunk
            job = json.loads(payload)
        except OSError:
            os._exit(0)
        middle = os.fork()
        if middle == 0:  # double fork: A (or J) is re-parented to the worker (a subreaper), which reaps it
            job["middle"], job["worker"] = os.getpid(), worker
            if os.fork() == 0:
                (_judge_process if job.get("role") == "judge" else _tree)(job, fds)
            os._exit(0)
        os.waitpid(middle, 0)
        for fd in fds:
            os.close(fd)
        channel.sendall(b"k")  # our copies of the pipe ends are closed: EOF now means the tree closed them


# ------------------------------------------------------------------ one job


class Worker:
    def __init__(self) -> None:
        isolation.libc.prctl(isolation.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        isolation.libc.prctl(isolation.PR_SET_DUMPABLE, 0, 0, 0, 0)  # same-uid code may not ptrace us
        world.package_dirs_to_hide()  # walked once here, so the zygote's trees and judges inherit the list
        # Forked now, before the first job is read: a zygote forked later would carry tests in its memory.
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _zygote(theirs)
        theirs.close()
        self.zygote_pid, self.channel = pid, ours
        ours.settimeout(30)
        self.group = accounting.Group()  # one execution at a time: one cgroup, limits set per job

    @property
    def broken(self) -> bool:
        """The zygote is gone; a new one may only come from a fresh worker (the pool starts one)."""
        return self.channel is None

    def run(self, job: dict) -> dict:
        """Run one job; always returns a result record, and leaves no process or directory behind."""
        started = time.monotonic()
        # Own uid: as root, the execution's uid is its own (isolation.enter_namespaces), and so its pipe pages.
        limits = dict(job["limits"], open_files=accounting.open_files(
            int(job.get("workers") or 1), int(job["limits"]["max_processes"]), own_uid=os.geteuid() == 0))
        workdir = ""
        ends: dict[str, tuple[int, int]] = {}
        try:
            if self.channel is None:
                raise OSError("the zygote is gone")
            if job.get("fallback"):  # only used where no mount namespace holds
                workdir = tempfile.mkdtemp(prefix="hasten-sandbox-")  # A hands it to the execution's uid
            for name in ("requests", "replies", "stdout", "stderr", "tree", "verdicts", "source", "tests"):
                ends[name] = os.pipe()  # (read, write)
            tree_fds = [ends["requests"][0], ends["replies"][1], ends["stdout"][1], ends["stderr"][1],
                        ends["tree"][1], ends["source"][0]]
            self.group.set_limits(limits["memory_bytes"], limits["disk_bytes"], limits["max_processes"])
            tree_job = {"limits": limits, "fallback": bool(job.get("fallback")), "workdir": workdir,
                        "cgroup": {"procs": self.group.procs_files(), "dirs": dict(self.group.dirs)}}
            source = json.dumps({"code": job["code"], "setup": job["program"].get("setup", "")}).encode()
            self._fork(tree_job, tree_fds)
            judge_fds = [ends["requests"][1], ends["replies"][0], ends["verdicts"][1], ends["tests"][0]]
            self._fork({"role": "judge", "limits": limits}, judge_fds)
            tests = json.dumps({"program": job["program"], "preamble": job.get("preamble", ""),
                                "limits": limits}).encode()
            for name, (read, write) in ends.items():  # keep the read ends we collect, the write ends we feed
                for fd in ((read, write) if name in ("requests", "replies") else (read,) if name in ("source", "tests")
                           else (write,)):
                    os.close(fd)
            keep = {name: ends[name][0] for name in ("stdout", "stderr", "tree", "verdicts")}
            feed = {ends["source"][1]: source, ends["tests"][1]: tests}
            ends.clear()
            # A caller's own deadline (the python tool's call) ends the job with the call, on the clock all
            # processes share (CLOCK_MONOTONIC), so no job runs on after the caller gave up on it.
            deadline = min(started + float(limits["wall_seconds"]), float(job.get("deadline") or "inf"))
            collected = _collect(keep, deadline, int(limits["output_bytes"]), feed)
        except Stop:
            raise  # the pool is closing: the finally below kills and reaps this job, main() the rest
        except BaseException:  # noqa: BLE001 - the worker must answer every job
            collected = {"events": [{"event": "internal", "reason": traceback.format_exc(limit=3)[-500:]}],
                         "stdout": b"", "stderr": b"", "truncated": False, "timed_out": False}
            self._drop_zygote()
        finally:
            for pair in ends.values():
                for fd in pair:
                    try:
                        os.close(fd)
                    except OSError:
                        pass  # closed before the failure
            if not self._reap():
                collected["events"].append({"event": "internal", "reason": "processes survived the kill loop"})
            if workdir:
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)
        return {
            "events": collected["events"],
            "stdout": collected["stdout"].decode(errors="replace"),
            "stderr": collected["stderr"].decode(errors="replace"),
            "output_truncated": collected["truncated"],
            "timed_out": collected["timed_out"],
            "seconds": time.monotonic() - started,
        }

    def _fork(self, request: dict, fds: list[int]) -> None:
        """Ask the zygote for a tree (A) or a judge (J) holding these pipe ends."""
        data = json.dumps(request).encode()
        socket.send_fds(self.channel, [struct.pack("!I", len(data))], fds)
        self.channel.sendall(data)
        if self.channel.recv(1) != b"k":
            raise OSError("the zygote is gone")

    def close(self) -> None:
        """Kill and reap every child, the zygote included: nothing of this worker outlives it."""
        self._drop_zygote()
        self._reap()

    def _drop_zygote(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.zygote_pid:
            try:
                os.kill(self.zygote_pid, signal.SIGKILL)
            except OSError:
                pass
            self.zygote_pid = 0

    def _reap(self) -> bool:
        """SIGKILL every child but the zygote (A, J, orphans that came back to us), until none is left."""
        for _ in range(10000):
            children = _children() - {self.zygote_pid}
            for pid in children:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            while True:
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return True
                if pid == 0:
                    break
                if pid == self.zygote_pid:
                    self.zygote_pid = 0
                    self._drop_zygote()
            if not children:
                return True
            time.sleep(0.0005)
        return False


def _children() -> set[int]:
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as file:
                found.update(int(pid) for pid in file.read().split())
        except OSError:
            pass
    return found


def _judge_process(request: dict, fds: list[int]) -> None:
    """Body of J (never returns): forked by the zygote, in a root of its own, reads only this job's tests."""
    requests, replies, report, tests = fds
    try:
        isolation.await_parent(request["middle"])
        isolation.die_with(request["worker"])
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # the tests' own prints go nowhere
        isolation.close_fds_except({requests, replies, report, tests})
        with open("/proc/self/statm") as file:  # read before the judge's world, which has no /proc
            footprint = int(file.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        layers: dict = {}
        isolation.enter_judge_world(layers)
        isolation.libc.prctl(isolation.PR_SET_DUMPABLE, 0, 0, 0, 0)
        job = _read_source(tests)
        # Bounded too: what the judge holds beyond the zygote's own footprint is memory_bytes at most.
        ceiling = footprint + int(job["limits"]["memory_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (ceiling, ceiling))
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        os.write(report, wire.dumps({"event": "judge_layers", "layers": layers}))
        judge.judge(job, requests, replies, report)
    except BaseException:  # noqa: BLE001
        try:
            os.write(report, wire.dumps({"event": "internal", "reason": traceback.format_exc(limit=2)[-300:]}))
        except OSError:
            pass
    os._exit(0)


def _parse(lines: list[bytes], source: str) -> list[dict]:
    """Event lines -> records; anything that is not a JSON object becomes a `malformed` event."""
    events = []
    for line in lines:
        if not line.strip():
            continue
        try:
            event = wire.loads(line)
            if not isinstance(event.get("event"), str):
                raise wire.WireError("no event name")
        except wire.WireError as error:
            event = {"event": "malformed", "reason": str(error)[:200]}
        event["source"] = source  # which pipe it came on: results.py accepts each kind from one source only
        events.append(event)
    return events


def _collect(fds: dict[str, int], deadline: float, cap: int, feed: dict[int, bytes]) -> dict:
    """Feed C its code and J its tests; read the pipes until J is done (and B reported) or the deadline."""
    pending = {fd: memoryview(data) for fd, data in feed.items()}
    buffers = {name: bytearray() for name in fds}
    limits = {"stdout": cap, "stderr": cap, "tree": 1 << 16, "verdicts": 1 << 22}
    truncated = timed_out = False
    selector = selectors.DefaultSelector()
    for name, fd in fds.items():
        selector.register(fd, selectors.EVENT_READ, name)
    for writer in pending:
        os.set_blocking(writer, False)
        selector.register(writer, selectors.EVENT_WRITE, "feed")
    open_names = set(fds)
    try:
        while open_names:
            if "verdicts" not in open_names and ("tree" not in open_names or (
                    b'"event":"lost"' not in buffers["verdicts"] and b'"event":"layers"' in buffers["tree"])):
                break  # the judge is done and B has reported C's layers; the exit code matters if the code died
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(remaining):
                name = key.data
                if name == "feed":
                    try:
                        pending[key.fd] = pending[key.fd][os.write(key.fd, pending[key.fd][:1 << 16]):]
                    except BlockingIOError:
                        continue
                    except OSError:
                        pending[key.fd] = pending[key.fd][:0]  # the reader is gone
                    if not pending[key.fd]:
                        selector.unregister(key.fd)
                        del pending[key.fd]
                        os.close(key.fd)  # EOF: the reader has it all
                    continue
                chunk = os.read(key.fd, 65536)
                room = limits[name] - len(buffers[name])
                buffers[name] += chunk[:max(room, 0)]
                if chunk and room >= len(chunk):
                    continue
                truncated |= bool(chunk) and name in ("stdout", "stderr")
                selector.unregister(key.fd)  # EOF, or over its cap: the writer gets EPIPE
                open_names.discard(name)
        for name in open_names:  # what was written before the end is still worth keeping
            os.set_blocking(fds[name], False)
            try:
                chunk = os.read(fds[name], max(limits[name] - len(buffers[name]), 1))
                buffers[name] += chunk[:max(limits[name] - len(buffers[name]), 0)]
            except OSError:
                pass
    finally:
        selector.close()
        for fd in [*fds.values(), *pending]:
            os.close(fd)
    events = _parse(bytes(buffers["verdicts"]).split(b"\n"), "judge") + \
        _parse(bytes(buffers["tree"]).split(b"\n"), "tree")
    return {"events": events, "stdout": bytes(buffers["stdout"]), "stderr": bytes(buffers["stderr"]),
            "truncated": truncated, "timed_out": timed_out}


# ---------------------------------------------------------------- job loop


def _read_message(stream) -> dict | None:
    header = stream.read(4)
    if len(header) < 4:
        return None
    (size,) = struct.unpack("!I", header)
    return json.loads(stream.read(size))


def _write_message(stream, message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack("!I", len(data)) + data)
    stream.flush()


# Imported once here so the code under test finds them in sys.modules: faster than an
# import per run, and the only way they load at all where the interpreter lives in a
# directory the unprivileged sandbox user cannot read (a Python under /root, run as root).
PRELOADED = (
    "abc array base64 bisect calendar cmath collections collections.abc copy dataclasses datetime "
    "decimal enum fractions functools hashlib heapq io itertools json math numbers operator random "
    "re statistics string struct textwrap time types typing unicodedata glob pathlib shutil socket "
    "subprocess tempfile threading"
).split()


class Stop(BaseException):
    """SIGTERM from the pool (Sandbox.close): end the job at hand, kill and reap it, and leave."""


def _on_term(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the kill and reap that follow run to their end
    raise Stop


def main() -> None:
    import importlib

    for name in PRELOADED:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which shuts us down
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    worker = Worker()
    signal.signal(signal.SIGTERM, _on_term)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    try:
        while True:
            job = _read_message(stdin)
            if job is None:
                return
            _write_message(stdout, worker.run(job))
            if worker.broken:
                return  # the pool sees the pipe close and starts a clean worker
    except Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker.close()  # a sweep: whatever a cut-short job or the zygote left is killed and reaped here
        worker.group.remove()  # empty: every process was killed and reaped


if __name__ == "__main__":
    main()
