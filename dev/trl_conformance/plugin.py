"""pytest plugin loaded into both runs (TRL's and hasten's) of TRL's test files.

- `load_dataset("trl-internal-testing/<name>", config, split=..., streaming=...)`
  reads the local copies hub.py built with TRL's scripts (split slices like
  "train[:2]" included); any other dataset id goes to the real `load_dataset`,
  which fails offline.
- Names the newer test files import from trl that the installed release lacks
  (`is_joblib_available`, SFT's `dft_loss`, ...) get stand-ins so the files
  import at all: an `is_<package>_available` checks for the package; any other
  raises when used, so the tests that use it fail on the control and are out
  of the count (run.py lists them).
- Nothing is skipped or deselected here: only pytest's own marks (require_cuda,
  require_vllm, ...) skip, and they skip on both sides alike.
- Each test gets a wall-clock limit (SIGALRM), so one hang cannot eat the run.
- Each test's outcome and the first line of its error (a skip's reason) go to
  $TRL_CONFORMANCE_RESULTS (JSON, nodeid -> [status, line, kind]); the kind is "trainer" when
  its source (or its class's) names one of the switched public classes, else
  "internal": those exercise TRL's private helpers, which stay TRL's on both
  sides. They are counted like any other; run.py says how many there are.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import re
import signal
from pathlib import Path

import datasets
import pytest

DATA = Path(os.environ["TRL_CONFORMANCE_DATA"])
TEST_SECONDS = int(os.environ.get("TRL_CONFORMANCE_TEST_SECONDS", "300"))
PUBLIC = re.compile(r"\b(GRPOConfig|GRPOTrainer|SFTConfig|SFTTrainer)\b")

_real_load_dataset = datasets.load_dataset


def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    local = DATA / path.removeprefix("trl-internal-testing/") / str(name)
    if not (path.startswith("trl-internal-testing/") and local.is_dir()):
        return _real_load_dataset(path, name, *args, split=split, streaming=streaming, **kwargs)
    splits = datasets.load_from_disk(str(local))
    if split is None:
        if streaming:
            return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in splits.items()})
        return splits
    match = re.fullmatch(r"(\w+)(?:\[:(\d+)(%?)\])?", split)
    dataset = splits[match.group(1)]
    if match.group(2):
        count = int(match.group(2))
        count = len(dataset) * count // 100 if match.group(3) else count
        dataset = dataset.select(range(count))
    return dataset.to_iterable_dataset() if streaming else dataset


datasets.load_dataset = load_dataset


class MissingInRelease:
    """Stands for a name the test files import from trl and the installed trl lacks; fails when used."""

    def __init__(self, where: str):
        self.where = where

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"the installed trl has no {self.where} (the test files are newer)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise NotImplementedError(f"the installed trl has no {self.where} (the test files are newer)")


def _availability(package: str):
    return lambda: importlib.util.find_spec(package) is not None


def stand_in_missing(paths: list[Path]) -> list[str]:
    """Give the trl modules every name `paths` import from them that they lack; returns those names."""
    added = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trl")):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError:  # a whole module the release lacks: the import fails as it would for a user
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                package = re.fullmatch(r"is_(\w+)_available", alias.name)
                where = f"{node.module}.{alias.name}"
                setattr(module, alias.name, _availability(package.group(1)) if package else MissingInRelease(where))
                added.append(where)
    return added


STOOD_IN: list[str] = []


def pytest_configure(config):
    """Before collection: stand-ins for what the files about to run (and their helpers) import."""
    tests = Path.cwd() / "tests"
    paths = [tests / "conftest.py", tests / "testing_utils.py"] + [Path(arg.split("::")[0]) for arg in config.args]
    STOOD_IN.extend(stand_in_missing([path for path in paths if path.is_file() and path.suffix == ".py"]))


def _kind(item) -> str:
    source = ""
    for owner in (getattr(item, "cls", None), getattr(item, "function", None)):
        try:
            source += inspect.getsource(owner) if owner is not None else ""
        except (OSError, TypeError):
            pass
    return "trainer" if PUBLIC.search(source) else "internal"


def pytest_collection_finish(session):
    """The selected tests (after -k), each "missing" until it reports."""
    RESULTS.update({item.nodeid: ["missing", "not run", _kind(item)] for item in session.items})


RESULTS: dict[str, list] = {}


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:200]


def pytest_runtest_logreport(report):
    entry = RESULTS.setdefault(report.nodeid, ["missing", "not run", "trainer"])
    if report.skipped and entry[0] in ("missing", "passed"):
        reason = (f"xfail: {report.wasxfail}" if hasattr(report, "wasxfail")
                  else report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr))
        entry[:2] = ["skipped", reason.removeprefix("Skipped: ")[:200]]
    elif report.failed:
        entry[:2] = ["failed", _first_line(report)] if entry[0] != "failed" else entry[:2]
    elif report.when == "call" and report.passed and entry[0] == "missing":
        entry[:2] = ["passed", ""]
    if report.when == "teardown":
        _write()  # after every test, so that an interrupted run keeps what it measured


def _write() -> None:
    out = os.environ.get("TRL_CONFORMANCE_RESULTS")
    if out:
        Path(out + ".part").write_text(json.dumps({"tests": RESULTS, "stand-ins": STOOD_IN}, indent=0))
        os.replace(out + ".part", out)


def pytest_sessionfinish(session):
    _write()


class TestTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise TestTimeout(f"test ran past {TEST_SECONDS} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TEST_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
