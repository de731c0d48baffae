"""Hostile code against the host: 0 escapes, 0 survivors, no leaked dirs, nothing held past the limits.

Escape cases print what they reached (`probe`) and the host checks its own
state: no host fd, directory, socket or SysV IPC object is reachable; the
syscall allowlist refuses what would reach the host (run in the kernel, and
in a BPF interpreter here, whatever machine runs the tests); nothing outlives
its execution; /tmp's inodes and the memory of an execution's processes
together are bounded (docs/sandbox.md). Shared limits, fixtures and how to
run these: tests/sandbox_hostile.py.
"""

from __future__ import annotations

import glob
import os
import random
import secrets
import socket
import tempfile
from pathlib import Path

import pytest

from hasten.sandbox import Sandbox, assert_program
from tests.sandbox_hostile import LIMITS, module_sandbox, recorded_layers  # noqa: F401 (the fixtures sandbox, layers)
from tests.sandbox_hostile import probe as _probe


def _sandbox_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "hasten-sandbox-*")))


def test_no_host_fd_survives(sandbox, layers):
    found = _probe(sandbox, (
        "import os, json, stat\nfds = {}\nfor fd in range(0, 1024):\n    try:\n        mode = os.fstat(fd).st_mode\n"
        "    except OSError:\n        continue\n    fds[fd] = 'dir' if stat.S_ISDIR(mode) else 'fifo' if stat.S_ISFIFO(mode) else 'other'\n"
        "walked = []\nfor fd, kind in fds.items():\n    if kind == 'dir':\n        try:\n"
        "            walked.append(os.listdir(os.open('../../..', os.O_RDONLY, dir_fd=fd)))\n        except OSError:\n"
        "            pass\nprint(json.dumps({'fds': fds, 'walked': walked}))\n"))
    assert "dir" not in found["fds"].values() and found["walked"] == []
    assert set(found["fds"]) <= {"0", "1", "2", "3", "4", "5", "6", "7"}  # stdio and the two judge pipes


def test_host_dirs_are_hidden_and_the_file_system_read_only(sandbox, layers, tmp_path):
    marker = tmp_path / "host-marker"
    marker.write_text("host")
    os.chmod(tmp_path, 0o777)
    found = _probe(sandbox, (
        "import os, json\nseen = {}\nfor path in ('/tmp', '/run', '/var/tmp', '/dev/shm', '/home', '/root'):\n"
        "    try:\n        seen[path] = sorted(os.listdir(path))\n    except OSError as error:\n        seen[path] = str(error)\n"
        f"reach = os.path.exists({str(marker)!r})\nwrote = []\n"
        "for path in ('/etc/hasten-pwned', '/var/hasten-pwned', '/work/hasten-pwned', '/run/x', '/home/x'):\n"
        "    try:\n        open(path, 'w').write('x')\n        wrote.append(path)\n    except OSError:\n        pass\n"
        "print(json.dumps({'seen': seen, 'reach': reach, 'wrote': wrote, 'pids': [p for p in os.listdir('/proc') if p.isdigit()]}))\n"))
    assert not found["reach"] and found["wrote"] == []
    for path in ("/run", "/var/tmp", "/dev/shm", "/home", "/root"):
        assert found["seen"].get(path) in ([], None) or isinstance(found["seen"][path], str), (path, found["seen"][path])
    assert found["seen"]["/tmp"] == [] or isinstance(found["seen"]["/tmp"], str)
    assert len(found["pids"]) <= 3  # its own pid namespace: B, C (and perhaps a child)


def test_unix_sockets_and_sysv_ipc_of_the_host_are_unreachable(sandbox, layers, tmp_path):
    paths = [str(tmp_path / "host.sock")]
    spare = Path(__file__).resolve().parent.parent / ".hasten-test.sock"  # outside every hidden dir
    if os.access(spare.parent, os.W_OK):
        paths.append(str(spare))
    listeners = []
    for path in paths:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        os.chmod(path, 0o777)
        listener.listen()
        listener.setblocking(False)
        listeners.append(listener)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0hasten-test-" + secrets.token_hex(4).encode())
    abstract.listen()
    abstract.setblocking(False)
    os.chmod(tmp_path, 0o777)
    key = random.randint(1 << 20, 1 << 30)
    try:
        found = _probe(sandbox, (
            "import socket, json, ctypes\nconnected = []\n"
            f"for address in {paths!r} + [{abstract.getsockname()!r}]:\n    try:\n"
            "        s = socket.socket(socket.AF_UNIX)\n        s.connect(address)\n        connected.append(repr(address))\n"
            "    except OSError:\n        pass\nlibc = ctypes.CDLL(None)\n"
            f"ids = [libc.shmget({key}, 4096, 0o1666), libc.msgget({key}, 0o1666), libc.semget({key}, 1, 0o1666)]\n"
            "print(json.dumps({'connected': connected, 'ipc': ids}))\n"))
        assert found["connected"] == []
        for listener in [*listeners, abstract]:
            with pytest.raises(BlockingIOError):
                listener.accept()
        for kind in ("shm", "msg", "sem"):
            table = Path(f"/proc/sysvipc/{kind}").read_text().split("\n")[1:]
            assert not any(line.split() and int(line.split()[0]) == key for line in table), kind
    finally:
        for listener in [*listeners, abstract]:
            listener.close()
        spare.unlink(missing_ok=True)


def test_nothing_survives_and_no_dir_leaks(sandbox, layers):
    from tests.test_sandbox import _worker_descendants, lasting  # the same survivor check as the basic tests

    assert lasting(_worker_descendants) == []
    before_dirs = _sandbox_dirs()
    daemon = ("import os, time\ndef f():\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
              "            time.sleep(600)\n        os._exit(0)\n    return 1\n")
    stuck = "import os\nos.close(4)\ndef f():\n    return 1\n"  # the judge loses its reply channel at once
    results = sandbox.run_many([(daemon, assert_program(["assert f() == 1"])),
                                (stuck, assert_program(["assert f() == 1"])),
                                ("import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\n"
                                 "def f():\n    return 1\n", assert_program(["assert f() == 1"]))])
    assert results[0].status == "pass" and results[1].status != "pass"
    assert lasting(_worker_descendants) == []
    assert lasting(lambda: _sandbox_dirs() - before_dirs) == []  # another xdist worker's runs come and go


# ------------------------------------------------- the syscall allowlist

SYSCALL_ATTACKS = r'''
import ctypes, errno, fcntl, json, os, socket, threading, subprocess
libc = ctypes.CDLL(None, use_errno=True)
reached = {}
def attempt(name, action):
    try:
        result = action()
        reached[name] = result is not False and result != -1
    except Exception:
        reached[name] = False
attempt("socket_unix_stream", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
attempt("socket_unix_dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
attempt("socketpair", lambda: socket.socketpair())
attempt("socketpair_raw", lambda: libc.socketpair(1, 2, 0, (ctypes.c_int * 2)()))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))
def addressed_sendto():
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.sendto(b"x", ("127.0.0.1", 9))
attempt("addressed_sendto", addressed_sendto)
attempt("sendmsg", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendmsg([b"x"]))
attempt("unshare_user", lambda: libc.unshare(0x10000000))
attempt("unshare_net", lambda: libc.unshare(0x40000000))
attempt("setns", lambda: libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0))
attempt("clone_newuser", lambda: libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) if True else None)
attempt("memfd_create", lambda: os.memfd_create("x"))
attempt("shmget", lambda: libc.shmget(0, 1 << 20, 0o1600))
attempt("msgget", lambda: libc.msgget(0, 0o1600))
attempt("openpty", lambda: os.openpty())
def host_flock():
    with open("/etc/passwd") as file:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
attempt("flock", host_flock)
def host_lockf():
    with open("/etc/passwd") as file:
        fcntl.lockf(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
attempt("posix_lock", host_lockf)
attempt("io_uring", lambda: libc.syscall(425, 8, ctypes.create_string_buffer(120)))
attempt("ptrace", lambda: libc.ptrace(16, os.getppid(), 0, 0))
allowed = {}
def thread_runs():
    box = []
    worker = threading.Thread(target=lambda: box.append(1))
    worker.start(); worker.join()
    return box == [1]
allowed["thread"] = thread_runs()
allowed["fork"] = (lambda pid: pid == 0 and os._exit(0) or os.waitpid(pid, 0)[1] == 0)(os.fork())
allowed["files"] = (open("/tmp/x.txt", "w").write("hi") == 2 and open("/tmp/x.txt").read() == "hi")
allowed["inet_socket"] = socket.socket(socket.AF_INET, socket.SOCK_STREAM).fileno() > 0
allowed["urandom"] = len(os.urandom(8)) == 8
print(json.dumps({"reached": reached, "allowed": allowed}))
'''


def test_the_syscall_allowlist_stops_host_reaching_calls(sandbox, layers):
    """Unix sockets of every kind, namespaces, memfd, SysV IPC, ptys and locks fail; threads, forks, files work."""
    if not layers.get("seccomp"):
        pytest.skip(f"no syscall allowlist here ({os.uname().machine}, layers {layers})")
    found = _probe(sandbox, SYSCALL_ATTACKS)
    assert [name for name, ok in found["reached"].items() if ok] == []
    assert all(found["allowed"].values()), found["allowed"]


def _run_filter(program: list[tuple], arch: int, number: int, args: tuple[int, ...] = ()) -> int:
    """A classic-BPF interpreter for the few opcodes seccomp.py uses: the filter's answer for one call."""
    import struct

    words = list(args) + [0] * (6 - len(args))
    data = struct.pack("<iIQ6Q", number, arch, 0, *words)
    accumulator, position = 0, 0
    while True:
        code, jump_true, jump_false, constant = program[position]
        position += 1
        if code == 0x20:
            accumulator = struct.unpack_from("<I", data, constant)[0]
        elif code == 0x06:
            return constant
        else:
            taken = {0x15: accumulator == constant, 0x35: accumulator >= constant,
                     0x45: bool(accumulator & constant)}[code]
            position += jump_true if taken else jump_false


def test_the_syscall_filter_decides_as_documented():
    """seccomp.py's program, run here: the table in its docstring, whatever machine runs the tests."""
    from hasten.sandbox import seccomp

    program = seccomp.program()
    assert len(program) < 4096 and all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in program)
    allow, eperm, enosys = seccomp.RET_ALLOW, seccomp.RET_ERRNO | seccomp.EPERM, seccomp.RET_ERRNO | seccomp.ENOSYS
    x86 = seccomp.AUDIT_ARCH_X86_64
    cases = [
        ((x86, 0), allow), ((x86, 1), allow), ((x86, 231), allow),  # read, write, exit_group
        ((x86, 41, (2, 1)), allow), ((x86, 41, (10, 1)), allow), ((x86, 41, (1, 1)), eperm),  # inet ok, unix no
        ((x86, 41, (16, 3)), eperm),  # netlink
        ((x86, 53, (1, 1)), enosys), ((x86, 46), enosys), ((x86, 47), enosys),  # socketpair, sendmsg, recvmsg
        ((x86, 44, (3, 0, 1, 0, 0)), allow), ((x86, 44, (3, 0, 1, 0, 0x7FFF0000)), eperm),  # sendto to an address
        ((x86, 44, (3, 0, 1, 0, 1 << 40)), eperm),  # an address above 4 GiB: the high word counts
        ((x86, 56, (0x003D0F00,)), allow), ((x86, 56, (0x10000000 | 17,)), eperm),  # threads ok; CLONE_NEWUSER no
        ((x86, 435), enosys), ((x86, 272), enosys), ((x86, 308), enosys),  # clone3, unshare, setns
        ((x86, 319), enosys), ((x86, 29), enosys), ((x86, 73), enosys),  # memfd_create, shmget, flock
        ((x86, 72, (3, 6)), eperm), ((x86, 72, (3, 37)), eperm), ((x86, 72, (3, 1)), allow),  # F_SETLK, OFD, F_GETFD
        ((x86, 16, (3, 0x40045431)), eperm), ((x86, 16, (3, 0x5401)), allow),  # TIOCSPTLCK; TCGETS
        ((x86, 101), enosys), ((x86, 425), enosys), ((x86, 165), enosys),  # ptrace, io_uring_setup, mount
        ((x86, 0x40000000 | 1), eperm), ((0x40000003, 1), eperm),  # x32 and i386 calls
    ]
    wrong = [(call, hex(expected), hex(_run_filter(program, *call))) for call, expected in cases
             if _run_filter(program, *call) != expected]
    assert wrong == []


# ------------------------------------------------- per-execution accounting

def test_the_candidates_tmp_is_bounded_in_inodes(sandbox, layers):
    if not layers.get("built_root"):
        pytest.skip(f"no built root here (layers {layers})")
    found = _probe(sandbox, (
        f"import json, os\ncount = 0\ntry:\n    for count in range({LIMITS.tmp_inodes + 100}):\n"
        "        open(f'/tmp/{count}', 'w').close()\nexcept OSError:\n    pass\nprint(json.dumps({'files': count}))\n"))
    assert found["files"] <= LIMITS.tmp_inodes


HOARD = r'''
import json, os, time
ready, done = os.pipe()
children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            block = b"x" * (150 << 20)  # touched: every page is really held
            os.write(done, b"1")
            os.close(done)  # the parent reads to EOF: every child has written, or died
            time.sleep(3)
        finally:
            os._exit(0)
    children.append(pid)
os.close(done)
while os.read(ready, 1):  # to EOF: every child has allocated and written, or died
    pass
# Count the children still alive (holding their 150 MiB) now: when the limit is hit the kernel may kill
# a child that had already written, so what was written once is not what is held at the same time.
held = sum(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in children)
print(json.dumps({"held": held}))
'''


def test_an_execution_cannot_hold_more_than_its_limit_across_processes(layers):
    """Three processes of 150 MiB each, every one under RLIMIT_AS: together over the execution's cgroup limit."""
    if not layers.get("memory_cgroup"):
        pytest.skip(f"no memory cgroup here (not root, or no writable cgroup; layers {layers})")
    from dataclasses import replace

    box = Sandbox(workers=1, limits=replace(LIMITS, test_seconds=4.0, wall_seconds=8.0), cache_size=0)
    try:
        found = _probe(box, HOARD)
        assert found["held"] < 3  # 3 x 150 MiB > 256 MiB + 32 MiB (/tmp) + 32 MiB (interpreters)
        assert box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"])).status == "pass"
    finally:
        box.close()
