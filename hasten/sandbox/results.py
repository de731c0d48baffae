"""The record the trainer gets back for every execution, whatever the code did.

The worker reports raw events (code loaded, one line per test, how the
process ended); `interpret` turns them into one `ExecutionResult` with an
overall status and a verdict per test. Statuses:

    pass          the code loaded and every test passed
    fail          it ran to the end, but the code raised on load or a test failed
    timeout       the wall-clock or CPU limit ended it (tests finished before keep their verdict)
    crash         the process died (signal, os._exit, out of memory in C code, ...)
    syntax_error  never executed: the code does not parse (the early-termination gate)

Per test: pass | fail (assertion) | error (other exception) | timeout | not_run.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from hasten.sandbox.programs import Limits, TestProgram


@dataclass
class TestOutcome:
    name: str  # the test's source, shortened
    status: str  # pass | fail | error | timeout | not_run
    reason: str = ""


@dataclass
class ExecutionResult:
    status: str  # pass | fail | timeout | crash | syntax_error
    reason: str  # one line; empty on pass
    loaded: bool  # the code itself ran to completion without raising (the execution reward)
    tests: list[TestOutcome]
    stdout: str = ""
    stderr: str = ""
    output_truncated: bool = False
    seconds: float = 0.0
    layers: dict[str, bool] = field(default_factory=dict)  # isolation steps that held (docs/sandbox.md)
    cached: bool = False
    malformed: bool = False  # the sandbox's report could not be read: scored 0, reason says why

    def size_bytes(self) -> int:
        """Rough memory held (the cache is bounded by this)."""
        return 512 + len(self.stdout) + len(self.stderr) + len(self.reason) + sum(
            96 + len(test.name) + len(test.reason) for test in self.tests)

    @property
    def passed(self) -> int:
        return sum(test.status == "pass" for test in self.tests)

    @property
    def fraction_passed(self) -> float:
        return self.passed / len(self.tests) if self.tests else 0.0

    def summary(self) -> str:
        return f"{self.status}: {self.passed}/{len(self.tests)} tests" + (f" ({self.reason})" if self.reason else "")


def syntax_error_result(program: TestProgram, reason: str) -> ExecutionResult:
    tests = [TestOutcome(name, "not_run", "syntax error") for name in program.tests]
    return ExecutionResult("syntax_error", reason, loaded=False, tests=tests)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _ending(raw: dict[str, Any], events: list[dict], limits: Limits) -> tuple[str, str]:
    """(status, reason) for a run that did not reach the end of its tests."""
    if raw.get("timed_out"):
        return "timeout", f"wall-clock limit of {limits.wall_seconds:g}s"
    internal = next((e for e in events if e.get("event") == "internal"), None)
    exit_event = next((e for e in events if e.get("event") == "exit"), None)
    lost = next((e for e in events if e.get("event") == "lost"), None)
    if exit_event is not None and isinstance(exit_event.get("signal"), int):
        number = exit_event["signal"]
        if number in (signal.SIGXCPU, signal.SIGKILL) and raw.get("seconds", 0) >= limits.cpu_seconds:
            return "timeout", f"CPU limit of {limits.cpu_seconds}s ({_signal_name(number)})"
        return "crash", f"killed by {_signal_name(number)}"
    if lost is not None and "answering" in str(lost.get("reason")):
        return "timeout", str(lost.get("reason"))[:200]
    if exit_event is not None:
        return "crash", f"process exited with code {exit_event.get('code')} before the tests finished"
    if internal is not None:
        return "crash", f"sandbox error: {(str(internal.get('reason', '')).strip().splitlines() or [''])[-1][:200]}"
    return "crash", "the sandboxed process ended without a report"


def interpret(raw: Any, program: TestProgram, limits: Limits) -> ExecutionResult:
    """Worker events -> ExecutionResult. Never raises: a report it cannot read scores 0 with the reason."""
    try:
        return _interpret(raw, program, limits)
    except Exception as error:  # noqa: BLE001 - whatever came back, the trainer gets a result
        return malformed_result(program, f"unreadable sandbox report ({type(error).__name__}: {error})"[:300])


def malformed_result(program: TestProgram, reason: str) -> ExecutionResult:
    tests = [TestOutcome(name, "not_run", reason) for name in program.tests]
    return ExecutionResult("crash", reason, loaded=False, tests=tests, malformed=True)


def crash_result(program: TestProgram, reason: str) -> ExecutionResult:
    """A job the sandbox could not run as asked (isolation refused, host-side failure): scored 0."""
    tests = [TestOutcome(name, "not_run", reason) for name in program.tests]
    return ExecutionResult("crash", reason, loaded=False, tests=tests)


_SOURCES = {"judge": ("loaded", "test", "tests_aborted", "done", "lost", "internal", "malformed", "judge_layers"),
            "tree": ("layers", "exit", "refused", "internal", "malformed")}
_TEST_STATUSES = ("pass", "fail", "error", "timeout")


def _interpret(raw: dict[str, Any], program: TestProgram, limits: Limits) -> ExecutionResult:
    events = raw.get("events", [])
    if not isinstance(events, list) or not all(isinstance(event, dict) for event in events):
        return malformed_result(program, "malformed sandbox report: events are not records")
    # Verdicts only from the judge's own pipe; layers and the exit status only from B's (the tree's).
    events = [event for event in events if event.get("source") is None  # the worker's own, or a test's
              or event.get("event") in _SOURCES.get(event.get("source"), ())]
    broken = next((e for e in events if e.get("event") == "malformed"), None)
    if broken is not None:
        return malformed_result(program, f"malformed event from the {broken.get('source')}: {broken.get('reason')}")
    layers: dict[str, bool] = {}
    for event in events:
        if (event.get("event") in ("layers", "exit", "refused") and event.get("source") == "tree"
                or event.get("event") == "judge_layers" and event.get("source") == "judge") \
                and isinstance(event.get("layers"), dict):
            layers.update({str(k): v for k, v in event["layers"].items() if isinstance(v, bool)})
    verdicts: dict[int, tuple[str, str]] = {}
    loaded_event = next((e for e in events if e.get("event") == "loaded"), None)
    aborted = next((e for e in events if e.get("event") == "tests_aborted"), None)
    for event in events:
        index = event.get("index")
        if event.get("event") == "test" and type(index) is int and 0 <= index < len(program.tests) \
                and event.get("status") in _TEST_STATUSES:
            verdicts.setdefault(index, (event["status"], str(event.get("reason", ""))[:300]))
    finished = any(e.get("event") == "done" for e in events)

    if loaded_event is not None and loaded_event.get("ok") is not True and loaded_event.get("status") != "died":
        status = "timeout" if loaded_event.get("status") == "timeout" else "fail"
        reason = f"the code raised on load: {str(loaded_event.get('reason', ''))[:300]}"
        why_not_run = "the code did not load"
    elif finished:
        status = "pass" if len(verdicts) == len(program.tests) and all(
            s == "pass" for s, _ in verdicts.values()) else "fail"
        reason = ""
        why_not_run = "not reported"
    elif aborted is not None:
        status, reason = "fail", f"the tests stopped: {str(aborted.get('reason', ''))[:300]}"
        why_not_run = reason
    else:
        status, reason = _ending(raw, events, limits)
        why_not_run = reason
    if status == "fail" and not reason:
        failed = next(((i, v) for i, v in sorted(verdicts.items()) if v[0] != "pass"), None)
        if failed is not None:
            reason = f"test {failed[0]} {failed[1][0]}" + (f": {failed[1][1]}" if failed[1][1] else "")
        elif len(verdicts) < len(program.tests):
            reason = "not every test reported"
    tests = [
        TestOutcome(name, *verdicts.get(index, ("not_run", why_not_run)))
        for index, name in enumerate(program.tests)
    ]
    return ExecutionResult(
        status=status,
        reason=reason,
        loaded=bool(loaded_event and loaded_event.get("ok") is True),
        tests=tests,
        stdout=str(raw.get("stdout", "")),
        stderr=str(raw.get("stderr", "")),
        output_truncated=bool(raw.get("output_truncated")),
        seconds=float(raw.get("seconds", 0.0)),
        layers=layers,
    )
