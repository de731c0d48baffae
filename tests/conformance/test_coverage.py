"""COVERAGE.md cannot go stale: every conformance test it names as a mirror exists (no training here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

HERE = Path(__file__).parent
FILES = {"main": "test_trl_conformance.py", "more": "test_trl_conformance_more.py", "options": "test_sft_options.py"}


def _tests(file: str) -> set[str]:
    tree = ast.parse((HERE / file).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def named_mirrors() -> list[tuple[str, str]]:
    """(file key, test name) for every `main::test_x` / `more::test_x` / `options::test_x` in COVERAGE.md."""
    return re.findall(r"`(main|more|options)::(test_\w+)`", (HERE / "COVERAGE.md").read_text())


def test_coverage_names_only_existing_tests():
    mirrors = named_mirrors()
    assert len(mirrors) > 50  # the parse found the table
    defined = {key: _tests(file) for key, file in FILES.items()}
    missing = sorted(f"{key}::{name}" for key, name in mirrors if name not in defined[key])
    assert not missing, f"COVERAGE.md names tests that do not exist: {missing}"


def test_every_added_conformance_test_is_in_coverage():
    """test_trl_conformance_more.py's tests each mirror a TRL test COVERAGE.md names (the older file is
    edited on other branches too; its new tests are listed when they land)."""
    named = {name for key, name in named_mirrors() if key == "more"}
    unlisted = sorted(f"more::{name}" for name in _tests(FILES["more"]) if name not in named)
    assert not unlisted, f"conformance tests COVERAGE.md does not list (map them to TRL's, or as additions): {unlisted}"


def test_stored_trl_controls_name_only_existing_tests_and_store_no_failure():
    """trl_control/<version>.json (conftest.py): each outcome is a test of this folder (file::name[params])
    that exists, and is one TRL passed or skipped (a failure on TRL is never stored as the control)."""
    import json

    controls = sorted((HERE / "trl_control").glob("*.json"))
    assert controls, "no stored TRL control: `make trl-control` writes one"
    for path in controls:
        data = json.loads(path.read_text())
        assert data["trl"] == path.stem
        for test, outcome in data["outcomes"].items():
            file, _, name = test.partition("::")
            assert name.split("[")[0] in _tests(file), f"{path.name}: {test} does not exist"
            assert outcome in ("passed", "skipped"), f"{path.name}: {test} {outcome}"
