"""What the hostile sandbox tests (tests/test_sandbox_hostile_*.py) share: their limits, the fixtures
`sandbox` (one per test module) and `layers` (the isolation it recorded), and `probe`, which runs code
that prints its findings.

The corpus is split by what the sandbox defends (docs/sandbox.md): the verdict
(test_sandbox_hostile_verdict.py), the host (test_sandbox_hostile_host.py) and the run
(test_sandbox_hostile_run.py). Run them as root and as nobody
(`setpriv --reuid=nobody --regid=nogroup --clear-groups`), with the venv and with /usr/bin/python3.
"""

from __future__ import annotations

import json

import pytest

from hasten.sandbox import Limits, Sandbox, assert_program

LIMITS = Limits(wall_seconds=5.0, test_seconds=1.0, cpu_seconds=3, memory_bytes=256 << 20, output_bytes=8192)


# Named by `name=` so a test module imports them under other names: its tests' `sandbox` and `layers`
# arguments then shadow no import.
@pytest.fixture(scope="module", name="sandbox")
def module_sandbox():
    """One sandbox per test module: 2 workers, no result cache (every run executes)."""
    box = Sandbox(workers=2, limits=LIMITS, cache_size=0)
    yield box
    box.close()


@pytest.fixture(scope="module", name="layers")
def recorded_layers(sandbox):
    """The isolation layers that held for a harmless run in the module's sandbox."""
    result = sandbox.run("def f():\n    return 1\n", assert_program(["assert f() == 1"]))
    assert result.status == "pass", result.summary()
    return result.layers


def probe(sandbox, code: str) -> dict:
    """Run code that prints one JSON line of findings; return them."""
    result = sandbox.run(code + "\ndef f():\n    return 1\n", assert_program(["assert f() == 1"]))
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.summary() + result.stderr[-500:]
    return json.loads(lines[-1])
