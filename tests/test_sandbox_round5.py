"""Issue 54, items 5 and 6: nothing outlives a run, and the sandbox's remaining host I/O.

Item 5: a sandbox execution and a tool call are each a unit that the run's end
kills whole. The cases: a sleeper that ignores SIGALRM (and a child of it in a
session of its own) when the pool is closed under it, or its worker killed
outright; the built-in `python` tool's job when its call times out; twelve
spinning `python` calls and the call after them; a process a tool starts with
Popen under tool_isolation=process. Each finds the processes it started by a
name (PR_SET_NAME, /proc/<pid>/comm) or a command-line marker of its own.

Item 6: O_DIRECT, page-cache madvise, MPTCP sockets, CHILD_SUBREAPER and
KEEPCAPS are refused, pipes are bounded in number and size, in the BPF
interpreter and in a real run. Run as root and as nobody, like
tests/test_sandbox_hostile_*.py (shared limits and fixtures: tests/sandbox_hostile.py).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from hasten.sandbox import Sandbox, assert_program, pool
from tests.sandbox_hostile import LIMITS, module_sandbox, recorded_layers  # noqa: F401 (the fixtures sandbox, layers)
from tests.sandbox_hostile import probe as _probe

ONE_TEST = assert_program(["assert f() == 1"])
# Long enough that nothing in these tests ends by its own wall clock: what ends it is the unit's end.
LONG = replace(LIMITS, wall_seconds=600.0, test_seconds=300.0, cpu_seconds=600)


def _named(name: str) -> list[int]:
    """Live processes whose comm (PR_SET_NAME) or command line carries `name`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                cmdline = file.read()
        except OSError:
            continue
        state = stat.rsplit(b")", 1)[1].split()[0]
        if state not in (b"Z", b"X") and (name.encode() in stat.split(b")", 1)[0] or name.encode() in cmdline):
            found.append(int(entry))
    return found


def _wait_for(predicate, seconds: float = 60.0) -> bool:
    """Poll until predicate() is true or `seconds` pass (a bound for slow machines, not a timing assert)."""
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _sleeper(name: str) -> str:
    """A completion that ignores SIGALRM and sleeps, with a child that leaves for a session of its own."""
    return ("import ctypes, os, signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
            f"ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"
            "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n    os._exit(0)\n"
            "time.sleep(600)\ndef f():\n    return 1\n")


def _kill_leftovers(name: str) -> None:
    for pid in _named(name):  # only ours: the name is a fresh random token
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ------------------------------------------------- item 5: nothing outlives a run

def test_a_sleeper_that_ignores_alarms_dies_with_close_shared(layers):
    """pool.close_shared() (the trainer's run end) with a job running: no process of its tree is left."""
    name = "hx" + secrets.token_hex(5)
    box = pool.shared_sandbox(workers=1, limits=LONG, cache_size=0)
    try:
        box.run("def f():\n    return 1\n", ONE_TEST)
        running = threading.Thread(target=box.run, args=(_sleeper(name), ONE_TEST), daemon=True)
        running.start()
        assert _wait_for(lambda: len(_named(name)) >= 2), "the sleeper never started"
        pool.close_shared()
        assert _wait_for(lambda: not _named(name), 10.0), _named(name)
        running.join(60)
        assert not running.is_alive()
    finally:
        box.close()
        _kill_leftovers(name)


def test_a_worker_killed_outright_takes_its_job_with_it(layers):
    """SIGKILL to a busy worker (no chance to clean up): its job's processes die with it (parent-death signals)."""
    name = "hx" + secrets.token_hex(5)
    box = Sandbox(workers=1, limits=LONG, cache_size=0)
    try:
        box.run("def f():\n    return 1\n", ONE_TEST)
        running = threading.Thread(target=box.run, args=(_sleeper(name), ONE_TEST), daemon=True)
        running.start()
        assert _wait_for(lambda: len(_named(name)) >= 2), "the sleeper never started"
        os.kill(box._all[0].process.pid, signal.SIGKILL)
        assert _wait_for(lambda: not _named(name), 10.0), _named(name)
        running.join(60)
        assert not running.is_alive()
    finally:
        box.close()
        _kill_leftovers(name)


@pytest.fixture()
def python_tool(monkeypatch):
    """The built-in `python` tool on a sandbox whose wall clock (600 s) never ends a call by itself."""
    import hasten.sandbox
    from hasten.agent.tools import load_tool

    box = Sandbox(workers=2, limits=LONG, cache_size=0)
    monkeypatch.setattr(hasten.sandbox, "shared_sandbox", lambda *args, **kwargs: box)
    yield {"python": load_tool("python")}, box
    box.close()


def _tool_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "hasten-tool-python"]


def test_the_python_tools_job_ends_with_its_timed_out_call(python_tool):
    from hasten.agent.tools import ToolCall, ToolRunner

    tools, box = python_tool
    name = "hx" + secrets.token_hex(5)
    runner = ToolRunner(timeout=3.0, isolation="thread")
    try:
        [[result]] = runner.run([[ToolCall("python", {"code": _sleeper(name)})]], [tools])
        assert result.failed and "timed out" in result.content, result
        # The call's thread, and its sandbox job, end with the call: not at the sandbox's 600 s wall clock.
        assert _wait_for(lambda: not _tool_threads(), 60.0), _tool_threads()
        assert not _named(name), _named(name)
    finally:
        runner.close()
        _kill_leftovers(name)


def test_twelve_spinning_python_calls_leave_no_thread_and_no_busy_worker(python_tool):
    from hasten.agent.tools import ToolCall, ToolRunner

    tools, box = python_tool
    runner = ToolRunner(timeout=5.0, isolation="thread")
    try:
        spinners = runner.run([[ToolCall("python", {"code": "while True:\n    pass\n"})] for _ in range(12)],
                              [tools] * 12)
        assert all(result.failed and "timed out" in result.content for [result] in spinners)
        assert _wait_for(lambda: not _tool_threads(), 60.0), len(_tool_threads())
        [[after]] = runner.run([[ToolCall("python", {"code": "print(6 * 7)"})]], [tools])
        assert not after.failed and after.content == "42", after  # no worker is still held by a spinner
    finally:
        runner.close()


def spawn(session: bool) -> str:
    """Start a sleeping process and return at once.

    Args:
        session: Whether the process leaves for a session (and process group) of its own.
    """
    marker = os.environ["HASTEN_TEST_MARKER"]
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker],
                     start_new_session=session, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return "started"


def test_a_process_a_tool_starts_ends_with_the_run(monkeypatch):
    """tool_isolation=process with the fork server (make_agent's): a Popen'd sleeper, in the call's group or
    in a session of its own, is gone once the runner is closed (the run's end)."""
    from hasten.agent.forkserver import start_fork_server
    from hasten.agent.tools import ToolCall, ToolRunner, make_tool

    marker = "hx" + secrets.token_hex(5)
    monkeypatch.setenv("HASTEN_TEST_MARKER", marker)
    tool = make_tool(spawn)
    server = start_fork_server([tool])
    assert server is not None
    runner = ToolRunner(timeout=20.0, isolation="process", fork_server=server)
    try:
        results = runner.run([[ToolCall("spawn", {"session": False})], [ToolCall("spawn", {"session": True})]],
                             [{"spawn": tool}] * 2)
        assert [row[0].content for row in results] == ["started", "started"], results
    finally:
        runner.close()
    try:
        assert _wait_for(lambda: not _named(marker), 10.0), _named(marker)
    finally:
        _kill_leftovers(marker)


# ------------------------------------------------- item 6: the sandbox's remaining host I/O

def test_the_filter_refuses_the_remaining_host_io():
    """seccomp.py's program in the BPF interpreter: O_DIRECT, page-cache advice, MPTCP, subreaper, keepcaps."""
    from hasten.sandbox import seccomp
    from tests.test_sandbox_hostile_host import _run_filter

    program = seccomp.program()
    assert len(program) < 4096 and all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in program)
    allow, eperm, enosys = seccomp.RET_ALLOW, seccomp.RET_ERRNO | seccomp.EPERM, seccomp.RET_ERRNO | seccomp.ENOSYS
    direct = 0o40000
    cases = {
        "open": ((2, (0, 0)), allow), "open_direct": ((2, (0, direct)), eperm),
        "open_direct_high_word_ignored": ((2, (0, (1 << 32) | 2)), allow),
        "openat": ((257, (0, 0, 0o2101)), allow), "openat_direct": ((257, (0, 0, direct | 2)), eperm),
        "openat2": ((437, (0, 0, 0, 24)), enosys),  # glibc falls back to openat
        "F_SETFL": ((72, (3, 4, 0o4000)), allow), "F_SETFL_direct": ((72, (3, 4, direct | 0o4000)), eperm),
        "F_GETFL": ((72, (3, 3)), allow), "F_SETPIPE_SZ": ((72, (3, 1031, 1 << 20)), eperm),
        "madvise_dontneed": ((28, (0, 4096, 4)), allow), "madvise_free": ((28, (0, 4096, 8)), allow),
        "madvise_willneed": ((28, (0, 4096, 3)), eperm), "madvise_cold": ((28, (0, 4096, 20)), eperm),
        "madvise_pageout": ((28, (0, 4096, 21)), eperm), "madvise_populate_read": ((28, (0, 4096, 22)), eperm),
        "madvise_populate_write": ((28, (0, 4096, 23)), eperm), "madvise_collapse": ((28, (0, 4096, 25)), eperm),
        "socket_tcp": ((41, (2, 1, 0)), allow), "socket_tcp6": ((41, (10, 1, 6)), allow),
        "socket_udp": ((41, (2, 2, 17)), allow), "socket_mptcp": ((41, (2, 1, 262)), eperm),
        "socket_mptcp6": ((41, (10, 1, 262)), eperm), "socket_unix": ((41, (1, 1, 0)), eperm),
        "prctl_subreaper": ((157, (36, 1)), eperm), "prctl_keepcaps": ((157, (8, 1)), eperm),
        "prctl_dumpable": ((157, (4, 1)), eperm), "prctl_set_name": ((157, (15, 0)), allow),
    }
    wrong = {name: (hex(expected), hex(_run_filter(program, seccomp.AUDIT_ARCH_X86_64, *call)))
             for name, (call, expected) in cases.items()
             if _run_filter(program, seccomp.AUDIT_ARCH_X86_64, *call) != expected}
    assert wrong == {}


HOST_IO = r'''
import ctypes, errno, fcntl, glob, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
found = {}
def outcome(name, action):
    try:
        value = action()
        found[name] = "failed %s" % errno.errorcode.get(ctypes.get_errno(), "?") if value == -1 else "ok"
    except OSError as error:
        found[name] = "failed %s" % errno.errorcode.get(error.errno, error.errno)
TARGET = "/usr/bin/env"
outcome("open_direct", lambda: os.close(os.open(TARGET, os.O_RDONLY | os.O_DIRECT)))
how = (ctypes.c_uint64 * 3)(os.O_RDONLY | os.O_DIRECT, 0, 0)  # struct open_how
outcome("openat2_direct", lambda: libc.syscall(437, -100, TARGET.encode(), how, 24))
outcome("open_plain", lambda: os.close(os.open(TARGET, os.O_RDONLY)))
fd = os.open(TARGET, os.O_RDONLY)
outcome("setfl_direct", lambda: fcntl.fcntl(fd, fcntl.F_SETFL, os.O_DIRECT) and None)
outcome("setfl_nonblock", lambda: fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK) and None)
size = os.fstat(fd).st_size
mapped = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: the host's page cache of the file
for name, advice in (("pageout", 21), ("cold", 20), ("willneed", 3), ("populate_read", 22)):
    outcome(name, lambda advice=advice: libc.madvise(mapped, size, advice))
anonymous = libc.mmap(None, 1 << 16, 3, 0x22, -1, 0)  # PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS
outcome("dontneed_anonymous", lambda: libc.madvise(anonymous, 1 << 16, 4))
outcome("mptcp", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM, 262).close())
outcome("tcp", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
outcome("subreaper", lambda: libc.prctl(36, 1, 0, 0, 0))
outcome("keepcaps", lambda: libc.prctl(8, 1, 0, 0, 0))
found["wheels"] = glob.glob("/usr/share/python-wheels/*")
pipes = []
try:
    while len(pipes) < 4096:
        pipes.append(os.pipe())
except OSError:
    pass
found["pipes"] = len(pipes)
print(json.dumps(found))
'''


def test_the_remaining_host_io_is_refused_in_a_real_run(sandbox, layers):
    """The candidate's view: O_DIRECT, page-cache madvise on a host file, MPTCP, subreaper and keepcaps fail;
    plain opens, F_SETFL, anonymous advice and TCP work; no wheels to import pip from; pipes bounded."""
    if not layers.get("seccomp"):
        pytest.skip(f"no syscall allowlist here ({os.uname().machine})")
    from hasten.sandbox.accounting import open_files

    found = _probe(sandbox, HOST_IO)
    pipes, wheels = found.pop("pipes"), found.pop("wheels")
    refused = ("open_direct", "setfl_direct", "pageout", "cold", "willneed", "populate_read", "mptcp", "subreaper",
               "keepcaps")
    expected = {name: "failed EPERM" for name in refused}
    expected.update({name: "ok" for name in ("open_plain", "setfl_nonblock", "dontneed_anonymous", "tcp")},
                    openat2_direct="failed ENOSYS")
    assert found == expected
    assert wheels == []
    files = open_files(sandbox.workers, LIMITS.max_processes, own_uid=bool(layers.get("own_uid")))
    assert 2 * pipes <= files, (pipes, files)


PIPE_HOG = r'''
import ctypes, os, time
for _ in range(MAX_PROCESSES):  # every process the execution may have holds as many pipes as it can open
    try:
        if os.fork() == 0:
            break
    except OSError:  # RLIMIT_NPROC or the pids cgroup: B and C count too
        break
pipes = []
try:
    while len(pipes) < 4096:
        pipes.append(os.pipe())
except OSError:
    pass
ctypes.CDLL(None).prctl(15, NAME, 0, 0, 0)  # says "holding" to the host side
time.sleep(8)
'''

PIPE_WATCH = r'''
import fcntl, json, os, sys, time
small = tries = 0
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    read_end, write_end = os.pipe()
    tries += 1
    small += fcntl.fcntl(read_end, 1032) < 65536  # F_GETPIPE_SZ: 8 KiB past pipe-user-pages-soft
    os.close(read_end)
    os.close(write_end)
    time.sleep(0.01)
print(json.dumps({"tries": tries, "small": small}))
'''


def test_executions_filling_pipes_leave_a_host_process_its_pipe_size(layers):
    """Three executions at once, every process holding all the pipes it can: a host process of the uid
    they would share (ours unprivileged, nobody as root) still gets 64 KiB pipes."""
    root = os.geteuid() == 0
    python = "/usr/bin/python3" if root else sys.executable
    if not os.path.exists(python):
        pytest.skip("no /usr/bin/python3 to run the host side as nobody")
    name = "hx" + secrets.token_hex(5)
    box = Sandbox(workers=3, limits=replace(LIMITS, wall_seconds=30.0, test_seconds=20.0), cache_size=0)
    try:
        box.run_many([("def f():\n    return 1\n" + f"# {index}\n", ONE_TEST) for index in range(3)])  # 3 started
        hog = PIPE_HOG.replace("MAX_PROCESSES", str(LIMITS.max_processes)).replace("NAME", repr(name.encode()))
        running = threading.Thread(target=box.run_many, args=([(hog + f"def f():\n    return 1\n# {index}\n", ONE_TEST)
                                                                for index in range(3)],))
        running.start()
        # The processes of the three executions hold their pipes (each names itself once it does; B and
        # C count against max_processes, so at least half of it in each).
        assert _wait_for(lambda: len(_named(name)) >= 3 * LIMITS.max_processes // 2), len(_named(name))
        host = subprocess.run([python, "-I", "-S", "-c", PIPE_WATCH, "1.0"], capture_output=True, text=True,
                              timeout=60, user=65534 if root else None, group=65534 if root else None,
                              extra_groups=[] if root else None, check=False)
        running.join()
    finally:
        box.close()
        _kill_leftovers(name)
    assert host.returncode == 0, host.stderr[-1000:]
    seen = json.loads(host.stdout.splitlines()[-1])
    assert seen["tries"] > 10 and seen["small"] == 0, seen
