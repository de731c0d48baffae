"""Shared kernel state a completion could reach through allowed calls, and the builtin-named entry point.

Issue 40, items 1-5: per-uid kernel budgets (pending signals, POSIX timers,
pipe buffers) are the execution's own; the allowlist checks the arguments of
the calls that reach host I/O or other processes; the candidate leads its own
session and is not dumpable; every package dir under the root is emptied,
found by a walk; and an entry point named like a builtin is the candidate's.
Run as root and as nobody, like tests/test_sandbox_hostile_*.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from hasten.sandbox import Limits, Sandbox, assert_program, check_program

LIMITS = Limits(wall_seconds=6.0, test_seconds=4.0, cpu_seconds=5, memory_bytes=256 << 20, output_bytes=16384)
ONE_TEST = assert_program(["assert f() == 1"])
SANDBOX_DIR = Path(__file__).resolve().parent.parent / "hasten" / "sandbox"


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(workers=2, limits=LIMITS, cache_size=0)
    yield box
    box.close()


@pytest.fixture(scope="module")
def layers(sandbox):
    result = sandbox.run("def f():\n    return 1\n", ONE_TEST)
    assert result.status == "pass", result.summary()
    return result.layers


def _probe(sandbox, code: str) -> dict:
    """Run code that prints one JSON line of findings; return them."""
    result = sandbox.run(code + "\ndef f():\n    return 1\n", ONE_TEST)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.summary() + result.stderr[-800:]
    return json.loads(lines[-1])


# ------------------------------------------------- the allowlist's argument rules, in the BPF interpreter

def test_the_syscall_filter_checks_the_arguments_that_matter():
    from hasten.sandbox import seccomp
    from tests.test_sandbox_hostile_host import _run_filter

    program = seccomp.program()
    assert len(program) < 4096 and all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in program)
    allow, eperm, success = seccomp.RET_ALLOW, seccomp.RET_ERRNO | seccomp.EPERM, seccomp.RET_ERRNO | 0
    x86 = seccomp.AUDIT_ARCH_X86_64
    cases = {
        # the sync family: no-ops that report success (a flush of the host's disk per call otherwise)
        "fsync": ((x86, 74, (3,)), success), "fdatasync": ((x86, 75, (3,)), success),
        "sync": ((x86, 162), success), "syncfs": ((x86, 306, (3,)), success),
        "msync": ((x86, 26, (0x7F0000000000, 4096, 4)), success),
        "sync_file_range": ((x86, 277, (3, 0, 0, 7)), success),
        # page-cache eviction and readahead of host files
        "fadvise64_dontneed": ((x86, 221, (3, 0, 0, 4)), eperm), "fadvise64_normal": ((x86, 221, (3, 0, 0, 0)), eperm),
        "readahead": ((x86, 187, (3, 0, 4096)), eperm),
        # per-uid pending-signal budget
        "timer_create": ((x86, 222, (1, 0, 0x7F0000000000)), eperm),
        "rt_sigqueueinfo": ((x86, 129, (1, 34, 0x7F0000000000)), eperm),
        "rt_tgsigqueueinfo": ((x86, 297, (1, 1, 34, 0x7F0000000000)), eperm),
        # fcntl: the commands Python uses, nothing else
        "F_DUPFD": ((x86, 72, (3, 0, 10)), allow), "F_GETFD": ((x86, 72, (3, 1)), allow),
        "F_SETFD": ((x86, 72, (3, 2, 1)), allow), "F_GETFL": ((x86, 72, (3, 3)), allow),
        "F_SETFL": ((x86, 72, (3, 4, 0o4000)), allow), "F_DUPFD_CLOEXEC": ((x86, 72, (3, 1030, 0)), allow),
        "F_SETPIPE_SZ": ((x86, 72, (3, 1031, 1 << 20)), eperm), "F_NOTIFY": ((x86, 72, (3, 1026, 0x80000004)), eperm),
        "F_SETLEASE": ((x86, 72, (3, 1024, 0)), eperm), "F_GETLEASE": ((x86, 72, (3, 1025)), eperm),
        "F_SETOWN": ((x86, 72, (3, 8, 1)), eperm), "F_SETSIG": ((x86, 72, (3, 10, 34)), eperm),
        "F_SETOWN_EX": ((x86, 72, (3, 15, 0)), eperm), "F_SETLK": ((x86, 72, (3, 6, 0)), eperm),
        "F_OFD_SETLK": ((x86, 72, (3, 37, 0)), eperm), "F_ADD_SEALS": ((x86, 72, (3, 1033, 1)), eperm),
        "fcntl_high_word_ignored": ((x86, 72, (3, (1 << 32) | 1)), allow),  # the kernel reads an unsigned int
        # preadv2/pwritev2: flags (the sixth argument) must be zero; RWF_NOWAIT shows what the host has cached
        "preadv2_plain": ((x86, 327, (3, 0, 1, 0, 0, 0)), allow),
        "preadv2_nowait": ((x86, 327, (3, 0, 1, 0, 0, 8)), eperm),
        "preadv2_hipri": ((x86, 327, (3, 0, 1, 0, 0, 1)), eperm),
        "pwritev2_plain": ((x86, 328, (3, 0, 1, 0, 0, 0)), allow),
        "pwritev2_dsync": ((x86, 328, (3, 0, 1, 0, 0, 2)), eperm),
        # prlimit64 only on the calling process (pid 0): pid 1 of the sandbox is B
        "prlimit64_self": ((x86, 302, (0, 7, 0, 0x7F0000000000)), allow),
        "prlimit64_pid1": ((x86, 302, (1, 7, 0x7F0000000000, 0)), eperm),
        "prlimit64_other": ((x86, 302, (2, 6, 0x7F0000000000, 0)), eperm),
        # the candidate may not make itself dumpable again
        "prctl_set_dumpable": ((x86, 157, (4, 1)), eperm), "prctl_get_dumpable": ((x86, 157, (3,)), allow),
        "prctl_set_name": ((x86, 157, (15, 0x7F0000000000)), allow),
        # unchanged neighbours
        "read": ((x86, 0), allow), "setsid": ((x86, 112), allow), "kill": ((x86, 62, (0, 19)), allow),
    }
    wrong = {name: (hex(expected), hex(_run_filter(program, *call))) for name, (call, expected) in cases.items()
             if _run_filter(program, *call) != expected}
    assert wrong == {}


# ------------------------------------------------- the same rules in a real run

ARGUMENT_RULES = r'''
import ctypes, errno, fcntl, json, os, resource, signal
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])  # a queued signal, were one allowed, stays queued
found = {}
def outcome(name, action):
    try:
        value = action()
        found[name] = "ok" if value is None or value == 0 or value is True else ("failed %s" % errno.errorcode.get(ctypes.get_errno(), "?") if value == -1 else "ok")
    except OSError as error:
        found[name] = "failed %s" % errno.errorcode.get(error.errno, error.errno)
fd = os.open("/usr/bin/env", os.O_RDONLY)
outcome("fsync", lambda: os.fsync(fd))
outcome("fdatasync", lambda: os.fdatasync(fd))
outcome("sync", lambda: os.sync())
outcome("fadvise", lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))
outcome("readahead", lambda: libc.syscall(187, fd, ctypes.c_long(0), ctypes.c_size_t(4096)))
outcome("preadv2_nowait", lambda: os.preadv(fd, [bytearray(16)], 0, os.RWF_NOWAIT) and None)
outcome("preadv_plain", lambda: os.preadv(fd, [bytearray(16)], 0) == 16 or -1)
timer = ctypes.c_long(0)
outcome("timer_create", lambda: libc.timer_create(1, None, ctypes.byref(timer)))
outcome("sigqueue", lambda: libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)))
read_end, write_end = os.pipe()
outcome("F_SETPIPE_SZ", lambda: fcntl.fcntl(read_end, 1031, 1 << 20) and None)
outcome("F_NOTIFY", lambda: fcntl.fcntl(os.open("/usr", os.O_RDONLY), 1026, 0x80000004) and None)
outcome("F_SETLEASE", lambda: fcntl.fcntl(read_end, 1024, 0) and None)
outcome("F_SETOWN", lambda: fcntl.fcntl(read_end, 8, os.getpid()) and None)
outcome("set_blocking", lambda: os.set_blocking(read_end, False))
outcome("set_inheritable", lambda: os.set_inheritable(read_end, True))
outcome("dup", lambda: os.dup(read_end) > 0 or -1)
outcome("prlimit_pid1", lambda: resource.prlimit(1, resource.RLIMIT_NOFILE, (16, 16)) and None)
outcome("prlimit_self", lambda: resource.prlimit(0, resource.RLIMIT_NOFILE) and None)
outcome("setrlimit", lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (16, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
found["dumpable"] = libc.prctl(3, 0, 0, 0, 0)
outcome("make_dumpable", lambda: libc.prctl(4, 1, 0, 0, 0))
found["dumpable_after"] = libc.prctl(3, 0, 0, 0, 0)
found["session_leader"] = os.getsid(0) == os.getpid() and os.getpgrp() == os.getpid()
print(json.dumps(found))
'''


def test_argument_rules_hold_in_a_real_run(sandbox, layers):
    """The candidate's view: no-ops succeed, refused commands fail with EPERM, what Python needs works."""
    if not layers.get("seccomp"):
        pytest.skip(f"no syscall allowlist here ({os.uname().machine})")
    found = _probe(sandbox, ARGUMENT_RULES)
    expected = {name: "ok" for name in ("fsync", "fdatasync", "sync", "preadv_plain", "set_blocking", "set_inheritable",
                                        "dup", "prlimit_self", "setrlimit")}
    expected.update({name: "failed EPERM" for name in ("fadvise", "readahead", "preadv2_nowait", "timer_create",
                                                       "sigqueue", "F_SETPIPE_SZ", "F_NOTIFY", "F_SETLEASE",
                                                       "F_SETOWN", "prlimit_pid1", "make_dumpable")})
    expected.update(dumpable=0, dumpable_after=0, session_leader=True)
    assert found == expected


# ------------------------------------------------- process tree

def test_process_group_signals_stop_at_the_candidate(sandbox, layers):
    """kill(0, sig) from the code reaches its own session only, never the tree's outer processes."""
    code = ("import os, signal\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "os.kill(0, signal.SIGUSR1)\nos.kill(0, signal.SIGTERM)\ndef f():\n    return 1\n")
    result = sandbox.run(code, ONE_TEST)
    assert result.status == "pass", result.summary()
    assert result.layers.get("own_session") is True, result.layers
    # A stopped child of the code stops only its own group: the code itself answers, nothing outside is stopped.
    stopper = ("import os, signal, time\npid = os.fork()\nif pid == 0:\n    os.setpgid(0, 0)\n    os.kill(0, signal.SIGSTOP)\n"
               "    os._exit(0)\ntime.sleep(0.2)\ndef f():\n    return 1\n")
    assert sandbox.run(stopper, ONE_TEST).status == "pass"


def _states_of_children(pid: int) -> dict[int, str]:
    states = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                states[int(child)] = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                pass
    return states


def test_kill_0_sigstop_stops_the_candidate_only(layers):
    """The code stops its own group; the worker's children (A, J, the zygote) are never stopped."""
    box = Sandbox(workers=1, limits=replace(LIMITS, wall_seconds=3.0, test_seconds=1.5), cache_size=0)
    try:
        box.run("def f():\n    return 1\n", ONE_TEST)
        worker = box._all[0].process.pid
        outcome: dict = {}
        running = threading.Thread(target=lambda: outcome.setdefault("result", box.run(
            "import os, signal\nos.kill(0, signal.SIGSTOP)\ndef f():\n    return 1\n", ONE_TEST)))
        running.start()
        stopped = set()
        while running.is_alive():
            stopped |= {pid for pid, state in _states_of_children(worker).items() if state in ("T", "t")}
            time.sleep(0.01)
        running.join()
    finally:
        box.close()
    assert stopped == set()
    assert outcome["result"].status != "pass"  # the code stopped itself while loading


# ------------------------------------------------- per-uid kernel budgets

HOG = r'''
import ctypes, fcntl, json, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
timers = grown = 0
for _ in range(100000):  # real-time signals queued while blocked: each one held until read
    os.kill(os.getpid(), signal.SIGRTMIN)  # past the budget the kernel drops the extra ones silently
    libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0))
timer = ctypes.c_long(0)
while timers < 100000 and libc.timer_create(1, None, ctypes.byref(timer)) == 0:
    timers += 1
pipes = []
for _ in range(64):
    try:
        read_end, write_end = os.pipe()
    except OSError:  # RLIMIT_NOFILE: as your uid it bounds an execution's pipes (accounting.open_files)
        break
    pipes.append((read_end, write_end))
    try:
        fcntl.fcntl(read_end, 1031, 1 << 20)  # F_SETPIPE_SZ
        grown += 1
    except OSError:
        pass
time.sleep(2.5)  # held while the host side tries
queued = 0
while signal.sigtimedwait([signal.SIGRTMIN], 0) is not None:
    queued += 1
uid_map = open("/proc/self/uid_map").read().split()
print(json.dumps({"queued": queued, "timers": timers, "grown": grown, "outer_uid": int(uid_map[1])}), flush=True)
'''

HOST_SIDE = r'''
import ctypes, fcntl, json, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
failures = {"timer_create": 0, "sigqueue": 0, "small_pipe": 0}
tries = 0
deadline = time.monotonic() + float(sys.argv[1])
while time.monotonic() < deadline:
    tries += 1
    timer = ctypes.c_long(0)
    if libc.timer_create(1, None, ctypes.byref(timer)) != 0:
        failures["timer_create"] += 1
    else:
        libc.timer_delete(timer)
    if libc.sigqueue(os.getpid(), signal.SIGRTMIN, ctypes.c_void_p(0)) != 0:
        failures["sigqueue"] += 1
    else:
        signal.sigtimedwait([signal.SIGRTMIN], 0)
    read_end, write_end = os.pipe()
    if fcntl.fcntl(read_end, 1032) < 65536:  # F_GETPIPE_SZ: 8 KiB once the uid is past pipe-user-pages-soft
        failures["small_pipe"] += 1
    os.close(read_end)
    os.close(write_end)
    time.sleep(0.01)
print(json.dumps({"tries": tries, "failures": failures}))
'''


def test_a_completion_cannot_spend_the_per_uid_budgets_of_host_processes(sandbox, layers):
    """Timers, queued RT signals and grown pipes in a completion: a host process of the uid it would share is unharmed."""
    if not layers.get("user_namespace"):
        pytest.skip("no user namespace here: the code runs with the host's uid by design (docs/sandbox.md)")
    root = os.geteuid() == 0
    python = "/usr/bin/python3" if root else sys.executable  # the venv may be unreadable to nobody
    if not os.path.exists(python):
        pytest.skip("no /usr/bin/python3 to run the host side as nobody")
    box = Sandbox(workers=1, limits=replace(LIMITS, wall_seconds=8.0), cache_size=0)
    try:
        box.run("def f():\n    return 1\n", ONE_TEST)  # started and probed before the race begins
        outcome: dict = {}
        running = threading.Thread(target=lambda: outcome.setdefault("result", box.run(HOG + "\ndef f():\n    return 1\n",
                                                                                          ONE_TEST)))
        running.start()
        time.sleep(1.0)  # the completion has filled what it can and holds it for 2.5 s
        # The uid the sandbox would share without a uid of its own: nobody when we are root, else ours.
        host = subprocess.run([python, "-I", "-S", "-c", HOST_SIDE, "1.5"], capture_output=True, text=True,
                              timeout=30, user=65534 if root else None, group=65534 if root else None,
                              extra_groups=[] if root else None, check=False)
        running.join()
    finally:
        box.close()
    assert host.returncode == 0, host.stderr[-1000:]
    seen = json.loads(host.stdout.splitlines()[-1])
    assert seen["tries"] > 10 and seen["failures"] == {"timer_create": 0, "sigqueue": 0, "small_pipe": 0}, seen
    result = outcome["result"]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.summary() + result.stderr[-800:]
    inside = json.loads(lines[-1])
    assert inside["timers"] == 0 and inside["grown"] == 0 and inside["queued"] <= 65, inside
    if root:
        assert result.layers.get("own_uid") is True, result.layers
        assert inside["outer_uid"] not in (0, 65534), inside


def test_concurrent_executions_run_as_different_uids(sandbox, layers):
    """As root, each execution has a uid of its own: two at once differ, and neither is nobody."""
    if os.geteuid() != 0 or not layers.get("user_namespace"):
        pytest.skip("a uid per execution needs root (docs/sandbox.md says what stays shared otherwise)")
    code = ("import json, time\nprint(json.dumps({'uid': int(open('/proc/self/uid_map').read().split()[1])}))\n"
            "time.sleep(0.5)\ndef f():\n    return 1\n")
    results = sandbox.run_many([(code, ONE_TEST), (code + "# second\n", ONE_TEST)])
    uids = [json.loads(r.stdout.splitlines()[-1])["uid"] for r in results]
    assert uids[0] != uids[1] and not {0, 65534} & set(uids), uids
    assert all(r.layers.get("own_uid") is True for r in results)


# ------------------------------------------------- the root from a walk

@pytest.fixture()
def world_module(monkeypatch):
    """world.py as the worker imports it (a top-level module next to isolation and seccomp)."""
    monkeypatch.syspath_prepend(str(SANDBOX_DIR))
    for name in ("world", "isolation", "seccomp"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import world

    yield world
    for name in ("world", "isolation", "seccomp"):
        sys.modules.pop(name, None)


def test_every_package_dir_in_a_tree_is_found(world_module, tmp_path):
    """lib64, /usr/local, vendored and nested trees, and a link named site-packages: all found, nothing else."""
    fake = tmp_path / "root"
    wanted = ["usr/lib/python3.11/site-packages", "usr/lib/python3/dist-packages", "usr/lib64/python3.11/site-packages",
              "usr/local/lib/python3.12/dist-packages", "usr/lib/google-cloud-sdk/platform/bundled/lib/python3.12/site-packages",
              "usr/share/vendor/tool/venv/lib/python3.8/site-packages", "opt/python/lib/python3.13/site-packages",
              "usr/share/real-packages-target"]
    for path in wanted:
        (fake / path).mkdir(parents=True)
    (fake / "usr/lib/python3.11/site-packages/pkg/site-packages").mkdir(parents=True)  # inside one: hidden with it
    (fake / "usr/lib/python3.11/site-packagesx").mkdir()
    (fake / "usr/share/doc/site-packages.txt").parent.mkdir(parents=True)
    (fake / "usr/share/doc/site-packages.txt").write_text("a file, not a dir")
    (fake / "usr/lib/python3.10").mkdir()
    (fake / "usr/lib/python3.10/site-packages").symlink_to("../../share/real-packages-target")
    (fake / "usr/lib/python3.9").mkdir()
    (fake / "usr/lib/python3.9/dist-packages").symlink_to("/nonexistent-target")
    found = world_module.package_dirs([str(fake / "usr"), str(fake / "opt/python")])
    expected = sorted(str(fake / path) for path in wanted)
    assert found == expected


def test_every_package_dir_under_the_candidates_root_is_empty(sandbox, layers):
    """The host's own package dirs, found here by walking the system dirs, are all empty inside."""
    if not layers.get("built_root"):
        pytest.skip(f"no built root here (layers {layers})")
    host_dirs = []
    for top in ("/usr", "/lib64", "/lib", "/lib32", "/libx32", "/bin", "/sbin", os.path.realpath(sys.base_prefix)):
        if os.path.islink(top) or not os.path.isdir(top):
            continue
        for folder, dirs, _ in os.walk(top):
            for name in list(dirs):
                if name in ("site-packages", "dist-packages"):
                    host_dirs.append(os.path.join(folder, name))
                    dirs.remove(name)
    assert host_dirs  # a Python is installed, so at least its own package dir exists
    found = _probe(sandbox, f"import json, os\nseen = {{}}\nfor path in {host_dirs!r}:\n"
                            "    try:\n        seen[path] = os.listdir(path)\n    except OSError:\n        seen[path] = []\n"
                            "print(json.dumps(seen))\n")
    assert {path: names for path, names in found.items() if names} == {}


# ------------------------------------------------- an entry point named like a builtin

def test_an_entry_point_that_shadows_a_builtin_is_the_candidates(sandbox):
    """`def divmod(a, b): return None` scores 0 on a divmod row; the correct one scores 1; no definition fails."""
    program = assert_program(["assert divmod(7, 2) == (3, 1)", "assert divmod(9, 3) == (3, 0)"], entry_point="divmod")
    hack = sandbox.run("def divmod(a, b):\n    return None\n", program)
    assert hack.fraction_passed == 0.0, hack.summary()
    honest = sandbox.run("def divmod(a, b):\n    return (a // b, a % b)\n", program)
    assert honest.status == "pass", honest.summary()
    missing = sandbox.run("def something_else(a, b):\n    return 0\n", program)
    assert missing.fraction_passed == 0.0 and "NameError" in missing.tests[0].reason, missing.summary()
    # Only the entry point: a builtin the tests use for their own checks stays the judge's.
    liar = sandbox.run("def len(x):\n    return 5\ndef divmod(a, b):\n    return 'xy'\n",
                       assert_program(["assert len(divmod(1, 1)) == 5"], entry_point="divmod"))
    assert liar.fraction_passed == 0.0, liar.summary()
    check = check_program("def check(candidate):\n    assert candidate(7, 2) == (3, 1)\n    assert divmod(9, 3) == (3, 0)\n",
                          "divmod")
    assert sandbox.run("def divmod(a, b):\n    return None\n", check).fraction_passed == 0.0


def test_task_rows_carry_their_entry_point_to_the_judge(tmp_path):
    """hasten's own rows and MBPP rows build assert programs that know their entry point."""
    pytest.importorskip("numpy", reason="the task loaders need numpy (the sandbox alone does not)")
    from hasten.tasks.code import hasten_rows, mbpp_rows

    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"prompt": "def divmod(a, b):\n    \"\"\"Quotient, remainder.\"\"\"\n",
                               "entry_point": "divmod", "tests": ["assert divmod(7, 2) == (3, 1)"]}) + "\n")
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"text": "Quotient and remainder.", "code": "def divmod(a, b):\n    return a // b, a % b\n",
                                "test_list": ["assert divmod(7, 2) == (3, 1)"]}) + "\n")
    for row in hasten_rows(own, None) + mbpp_rows(mbpp, None):
        assert row["tests"]["entry_point"] == "divmod", row["tests"]


def test_no_uid_of_its_own_is_said_once_in_one_line():
    """Not root: the probe warns, in one line, that per-uid budgets are shared; as root nothing is said."""
    from hasten.sandbox.pool import Sandbox as Pool

    held = {"seccomp": True, "memory_cgroup": True, "pids_cgroup": True}
    with pytest.warns(RuntimeWarning) as caught:
        Pool._say_what_is_missing({**held, "own_uid": False})
    assert len(caught) == 1 and "\n" not in str(caught[0].message) and "your uid" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Pool._say_what_is_missing({**held, "own_uid": True})


def test_the_host_page_cache_of_system_files_is_not_visible(sandbox, layers):
    """mincore on a host file the code cannot write reports every page resident, whatever the host cached."""
    if not layers.get("seccomp") or os.geteuid() != 0:
        pytest.skip("evicting a host file's pages first needs root")
    libraries = "/usr/lib/x86_64-linux-gnu"
    target = max((entry for entry in os.scandir(libraries) if entry.is_file(follow_symlinks=False)),
                 key=lambda entry: entry.stat().st_size, default=None) if os.path.isdir(libraries) else None
    if target is None:
        pytest.skip("no system library to look at")
    fd = os.open(target.path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the host's cache of it, dropped
    finally:
        os.close(fd)
    code = (f"import ctypes, json, os\nPATH = {target.path!r}\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.mmap.restype = ctypes.c_void_p\n"
            "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
            "libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]\n"
            "fd = os.open(PATH, os.O_RDONLY)\nsize = os.fstat(fd).st_size\n"
            "address = libc.mmap(None, size, 1, 1, fd, 0)\n"  # PROT_READ, MAP_SHARED
            "page = os.sysconf('SC_PAGE_SIZE')\npages = (size + page - 1) // page\nvector = ctypes.create_string_buffer(pages)\n"
            "result = libc.mincore(address, size, vector)\n"
            "print(json.dumps({'result': result, 'pages': pages, 'resident': sum(b & 1 for b in vector.raw[:pages])}))\n")
    found = _probe(sandbox, code)
    assert found["result"] == 0 and found["resident"] == found["pages"], found
