"""The conformance summary: "hasten passes N of the M tests that pass on TRL", and TRL's stored control.

Its hooks are registered by tests/conftest.py, the conftest every pytest process loads, the
pytest-xdist controller included: the controller collects nothing, so tests/conformance/conftest.py
is not loaded there, and the summary would not be printed (`make test` runs `-n auto`). A test's
outcome travels on its report (user_properties, set by tests/conformance/conftest.py), so the
process that prints the summary sees every worker's tests.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

_OUTCOMES: dict[str, dict[str, str]] = {}  # test id without the library -> {"trl": outcome, "hasten": outcome}
_UNSUPPORTED: dict[str, str] = {}
PROPERTY = "trl_conformance"
CONTROL = Path(__file__).parent / "trl_control"


def conformance_key(item) -> tuple[str, str] | None:
    """(library, "file::test[params]" without the library) for a conformance test, else None."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or "lib" not in callspec.params or "conformance" not in str(item.path):
        return None
    name = callspec.params["lib"]
    rest = [part for part in callspec.id.split("-") if part != name]
    return name, f"{item.path.name}::{item.originalname}" + (f"[{'-'.join(rest)}]" if rest else "")


def trl_version() -> str | None:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return None


def stored_control(version: str) -> dict[str, str]:
    """The stored TRL outcomes for `version`, {} when none are stored or a fresh control is asked for."""
    path = CONTROL / f"{version}.json"
    if os.environ.get("HASTEN_TRL_CONTROL") == "1" or not path.exists():
        return {}
    data = json.loads(path.read_text())
    assert data["trl"] == version, f"{path} holds trl {data['trl']}'s control"
    return data["outcomes"]


def pytest_runtest_logreport(report):
    found = [value for name, value in report.user_properties if name == PROPERTY]
    if not found or (report.when != "call" and report.passed):
        return
    name, test, unsupported = found[0]
    if unsupported:
        _UNSUPPORTED[test] = unsupported
    result = "passed" if report.passed else "skipped" if report.skipped else "failed"
    if _OUTCOMES.setdefault(test, {}).get(name) in (None, "passed"):
        _OUTCOMES[test][name] = result


def pytest_sessionfinish(session):
    """Add this session's TRL outcomes to the stored control (a test's latest outcome replaces its earlier).

    A failure on TRL is not stored: it is this run's failure, and the next run tries TRL again. The file
    is read again here, so sessions that ran TRL's side of different files at once each add theirs. An
    xdist worker leaves it to the controller, which has every worker's outcomes."""
    version = trl_version()
    ran = {test: result["trl"] for test, result in _OUTCOMES.items() if result.get("trl") in ("passed", "skipped")}
    if not version or not ran or hasattr(session.config, "workerinput"):
        return
    path = CONTROL / f"{version}.json"
    earlier = json.loads(path.read_text())["outcomes"] if path.exists() else {}
    outcomes = {**earlier, **ran}
    if outcomes != earlier:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"trl": path.stem, "outcomes": dict(sorted(outcomes.items()))}, indent=1) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _OUTCOMES:
        return
    write = terminalreporter.write_line
    terminalreporter.section("TRL conformance (tests/conformance)")
    version = trl_version()
    stored = stored_control(version) if version else {}
    cached = [test for test, result in _OUTCOMES.items() if "trl" not in result and test in stored]
    outcomes = {test: {**result, **({"trl": stored[test]} if test in cached else {})}
                for test, result in _OUTCOMES.items()}
    if cached:
        write(f"TRL's side of {len(cached)} tests read from trl_control/{version}.json "
              "(HASTEN_TRL_CONTROL=1 runs it again)")
    if not any("hasten" in result for result in outcomes.values()):  # TRL's side alone (make trl-control)
        passed = sum(result.get("trl") == "passed" for result in outcomes.values())
        write(f"hasten's side not run (deselected): TRL passes {passed} of {len(outcomes)} tests")
        return
    on_trl = [test for test, result in outcomes.items() if result.get("trl") == "passed" and "hasten" in result]
    if on_trl:
        supported = [test for test in on_trl if outcomes[test].get("hasten") == "passed"
                     and test not in _UNSUPPORTED]
        write(f"hasten passes {len(supported)} of the {len(on_trl)} tests that pass on TRL "
              f"({100 * len(supported) / len(on_trl):.0f}%)")
    else:
        ran = [test for test, result in outcomes.items() if "hasten" in result]
        passed = [test for test in ran if outcomes[test]["hasten"] == "passed" and test not in _UNSUPPORTED]
        write(f"TRL side not run (trl not installed, or deselected): hasten passes {len(passed)} of {len(ran)} tests")
    failing = sorted(test for test, result in outcomes.items() if result.get("hasten") == "failed")
    for test in failing:
        write(f"  fails on hasten: {test}")
    for test, reason in sorted(_UNSUPPORTED.items()):
        write(f"  not supported by hasten: {test}: {reason}")
