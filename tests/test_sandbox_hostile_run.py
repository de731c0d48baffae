"""Hostile code against the run: nothing a completion does ends training or stalls its neighbours.

Code the gate cannot compile scores 0; a refused isolation is one line at the
probe and a scored crash after it; a slow completion holds one worker; the
fallback (every namespace refused, opted in) still runs and says which layers
held; concurrent reward functions share executions; the result cache is
bounded in bytes (docs/sandbox.md). Shared limits, fixtures and how to run
these: tests/sandbox_hostile.py.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from hasten.sandbox import Sandbox, assert_program
from hasten.sandbox.pool import SandboxRefused
from tests.sandbox_hostile import LIMITS, module_sandbox  # noqa: F401 (the fixture sandbox)


def test_one_execution_per_distinct_completion_from_concurrent_rewards():
    """tests and execution from two reward threads at once: 16 distinct completions run 16 times."""
    pytest.importorskip("torch")  # the reward runner needs it; the sandbox tests also run on a bare Python
    from hasten.rewards.code import ExecutionReward, SandboxSettings, TestsReward

    settings = SandboxSettings(workers=2, limits=LIMITS)
    program = assert_program(["assert f() == 1"]).as_dict()
    completions = [f"```python\ndef f():\n    return 1  # {index}\n```" for index in range(16)]
    columns = {"tests": [program] * 16, "preamble": [""] * 16}
    sandbox = settings.sandbox()
    before = sandbox.stats.executions
    scores: dict[str, list] = {}
    threads = [threading.Thread(target=lambda name=name, reward=reward: scores.__setitem__(
        name, reward([], completions, **columns))) for name, reward in
        (("tests", TestsReward(settings)), ("execution", ExecutionReward(settings)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert scores["tests"] == [1.0] * 16 and scores["execution"] == [1.0] * 16
    assert sandbox.stats.executions - before == 16


def test_cache_is_bounded_in_bytes():
    box = Sandbox(workers=2, limits=LIMITS, cache_bytes=40_000)
    try:
        box.run_many([(f"print('x' * 8000)\ndef f():\n    return {index}\n", assert_program(["assert f() == 1"]))
                      for index in range(12)])
        assert 0 < box._cached_bytes <= 40_000 and len(box._cache) < 12
    finally:
        box.close()


def test_refused_namespaces_are_one_line_user_error():
    box = Sandbox(workers=1, limits=LIMITS)
    try:
        with pytest.raises(SandboxRefused, match="code.sandbox_fallback=true") as caught:
            box._check_isolation({"events": [{"event": "refused", "reason": "unshare failed: EPERM"}]})
        assert "\n" not in str(caught.value)
    finally:
        box.close()


# ------------------------------------------------- nothing a completion does ends the run

DEEP_UNARY = "def f():\n    return " + "-" * 5000 + "1\n"  # compile raises RecursionError, not SyntaxError


def test_deeply_nested_code_is_a_failed_completion_not_an_exception(sandbox):
    result = sandbox.run(DEEP_UNARY, assert_program(["assert f() == -1"]))
    assert result.status == "syntax_error" and "RecursionError" in result.reason
    assert sandbox.stats.syntax_errors >= 1


def test_deeply_nested_code_scores_zero_in_every_code_reward():
    pytest.importorskip("numpy", reason="the reward runner needs numpy (the sandbox alone does not)")
    from hasten.rewards.code import ExecutionReward, SandboxSettings, TestsReward, complexity_reward, syntax_reward

    program = assert_program(["assert f() == -1"])
    completions = [f"```python\n{DEEP_UNARY}```", "```python\ndef f():\n    return -1\n```"]
    rows = {"tests": [program.as_dict()] * 2}
    assert syntax_reward([], completions) == [0.0, 1.0]
    assert complexity_reward([], completions)[0] == 0.0
    settings = SandboxSettings(workers=1, limits=LIMITS, cache_size=0)
    assert TestsReward(settings)([], completions, **rows) == [0.0, 1.0]
    assert ExecutionReward(settings)([], completions, **rows) == [0.0, 1.0]


def test_a_refusal_after_the_probe_is_that_jobs_crash():
    """Isolation is probed once; a later per-job refusal (namespace limit exhausted) never reaches the trainer."""
    from hasten.sandbox import pool

    box = Sandbox(workers=1, limits=LIMITS, cache_size=0)
    try:
        assert box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"])).status == "pass"
        worker = box._all[0]
        refusal = {"events": [{"event": "refused", "reason": "unshare failed: No space left on device"}]}
        worker.call = lambda job: refusal
        result = box.run("def f():\n    return 2\n", assert_program(["assert f() == 2"]))
        assert result.status == "crash" and "refused" in result.reason and result.fraction_passed == 0.0
        assert box.stats.refused == 1
        worker.call = lambda job: {"events": "garbage", "stdout": object()}
        assert box.run("def f():\n    return 3\n", assert_program(["assert f() == 3"])).status == "crash"
        def broken(job):
            raise RuntimeError("host side broke")
        worker.call = broken
        result = box.run("def f():\n    return 4\n", assert_program(["assert f() == 4"]))
        assert result.status == "crash" and "host side broke" in result.reason and box.stats.internal_errors == 1
    finally:
        box.close()
    assert pool.SandboxStats().refused == 0


def test_a_refusal_at_the_probe_is_one_line_user_error(monkeypatch):
    from hasten.sandbox import pool

    refusal = {"events": [{"event": "refused", "reason": "unshare failed: EPERM"}]}
    monkeypatch.setattr(pool._Worker, "call", lambda self, job: refusal)
    box = Sandbox(workers=1, limits=LIMITS, cache_size=0)
    try:
        for _ in range(2):  # probed once, the same error every time after
            with pytest.raises(SandboxRefused, match="code.sandbox_fallback=true"):
                box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"]))
    finally:
        box.close()


# ------------------------------------------------- throughput under attack

def test_a_slow_completion_holds_one_worker_not_its_neighbours():
    """While one completion spins to its wall clock, a neighbour asked for from another thread is answered."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    box = Sandbox(workers=2, limits=replace(LIMITS, wall_seconds=8.0, test_seconds=8.0, cpu_seconds=9), cache_size=0)
    try:
        box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"]))  # probed, workers started
        with ThreadPoolExecutor(2) as threads:
            slow = threads.submit(box.run, "while True:\n    pass\n", assert_program(["assert f() == 1"]))
            neighbours = [box.run(f"def f():\n    return {n}\n", assert_program([f"assert f() == {n}"]))
                          for n in range(3)]
            assert not slow.done()  # three neighbours in turn, all while the slow one still runs
            assert [r.status for r in neighbours] == ["pass"] * 3
            assert slow.result().status == "timeout"
    finally:
        box.close()


# ------------------------------------------------- the fallback

FALLBACK_RUN = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import isolation, worker
class Refusing:
    def __init__(self, real):
        self.real = real
    def __getattr__(self, name):
        return getattr(self.real, name)
    def unshare(self, flags):
        return -1  # as in a container that forbids every namespace
isolation.libc = Refusing(isolation.libc)
job = json.loads(sys.argv[2])
box = worker.Worker()
try:
    print(json.dumps(box.run(job)))
finally:
    box.group.remove()
'''


def test_the_fallback_runs_with_the_layers_that_hold():
    """Where every namespace is refused and the fallback is opted in, a job still runs and says what held."""
    import subprocess
    import sys

    from hasten.sandbox.pool import WORKER_SCRIPT
    from hasten.sandbox.results import interpret

    program = assert_program(["assert f() == 1"])
    job = {"code": "def f():\n    return 1\n", "program": program.as_dict(), "preamble": "",
           "limits": LIMITS.as_dict(), "fallback": True}
    completed = subprocess.run([sys.executable, "-I", "-S", "-c", FALLBACK_RUN, str(WORKER_SCRIPT.parent),
                                json.dumps(job)], capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr[-1000:]
    result = interpret(json.loads(completed.stdout.splitlines()[-1]), program, LIMITS)
    assert result.status == "pass", result.summary()
    assert result.layers["user_namespace"] is False and result.layers["built_root"] is False
    assert result.layers["no_new_privs"] and result.layers["no_capabilities"] and result.layers["rlimits"]
    assert result.layers.get("seccomp") is (os.uname().machine == "x86_64")
