"""The two test tiers (tests/conftest.py's rule): what it marks slow, and that its list cannot go stale."""

from __future__ import annotations

import ast
import types
from pathlib import Path

from conftest import SLOW, slow_reason

TESTS = Path(__file__).parent


def item(path: str, name: str, lib: str | None = None):
    callspec = types.SimpleNamespace(params={"lib": lib}) if lib else None
    return types.SimpleNamespace(path=TESTS / path, originalname=name, name=name, callspec=callspec)


def test_every_slow_entry_names_a_file_and_test_that_exist():
    for key in SLOW:
        file, _, test = key.partition("::")
        assert (TESTS / file).is_file(), key
        if test:
            tree = ast.parse((TESTS / file).read_text())
            assert test in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, key


def test_the_rule_marks_the_real_model_the_conformance_mirror_and_listed_tests_only():
    assert slow_reason(item("test_smollm2.py", "test_two_grpo_steps_through_the_cli"))
    assert slow_reason(item("conformance/test_trl_conformance.py", "test_training", lib="trl"))
    assert slow_reason(item("conformance/test_trl_conformance.py", "test_training", lib="hasten"))
    assert slow_reason(item("conformance/test_coverage.py", "test_coverage_names_only_existing_tests")) is None
    assert slow_reason(item("test_agent_api.py", "test_cli_tools_from_a_file_run"))
    assert slow_reason(item("test_agent_api.py", "test_calculator_tool_answers_and_refuses_code")) is None
    assert slow_reason(item("test_losses.py", "test_grpo_loss")) is None
