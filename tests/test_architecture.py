"""The import rules docs/ARCHITECTURE.md states: lower layers never import train/, and models/ only what is below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hasten"


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every hasten module `path` imports (top level or inside functions)."""
    package = ["hasten", *path.relative_to(PACKAGE).with_suffix("").parts[:-1]]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("hasten")}


@pytest.mark.parametrize("layer", ["models", "rollout", "tasks", "rewards", "algo", "speed"])
def test_lower_layers_never_import_train(layer):
    offenders = {str(path.relative_to(PACKAGE)): sorted(n for n in imported_modules(path) if n.startswith("hasten.train"))
                 for path in (PACKAGE / layer).rglob("*.py")}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_models_import_only_what_is_below_them():
    allowed = ("hasten.models", "hasten.config", "hasten.errors", "hasten.speed.grouped_attention",
               "hasten.speed.precision")
    offenders = {str(path.relative_to(PACKAGE)): sorted(n for n in imported_modules(path)
                                                         if not n.startswith(allowed))
                 for path in (PACKAGE / "models").rglob("*.py")}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_rule_checker_sees_relative_imports(tmp_path):
    assert "hasten.train.loop" in imported_modules(PACKAGE / "train" / "trainer.py")  # `from . import loop`
