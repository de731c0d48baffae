"""The import rules docs/ARCHITECTURE.md states, checked on the source: layers import only downward, no
module takes part in an import circle, and no private name crosses a package boundary.

Every import counts, at the top of a module, inside a function (a lazy import still couples the two) or
under `if TYPE_CHECKING:` (a type a module names is a module it leans on: a circle through types is still
a circle to a reader, and the next refactor turns it into a real one).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hasten"

# Bottom first. A module may import its own package and anything listed before its package, nothing after.
LAYERS = [
    "errors", "console", "userfiles", "ticker", "features", "config_jobs", "config_yaml", "device", "profiles",
    "config",  # settings: plain data, no torch at import
    "kernels",  # numerical and process kernels: precision, attention, AdamW, allocator, threads, ...
    "sandbox", "games",  # self-contained: isolated execution; the vectorized game
    "models",  # name -> (model, tokenizer), the native Llama
    "rollout",  # engines (token ids in, ids + log-probs out), their factory
    "rewards",  # the TRL reward signature, its runner, pool, cache, gate, scoring
    "agent",  # multi-turn tool use above the engine: tools, template, environments, the tool loop
    "tasks",  # data, prompt format, rewards, check(); the prompt stream and curriculum
    "algo",  # advantages, losses, the batch policies (dynamic sampling, zero-advantage samples)
    "train",  # the loop, the learner, the GRPO step, outputs, distributed
    "rft", "compare", "api", "bench", "config_help", "cli",  # entry points and the TRL-style API
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("hasten", *parts[:-1])) if parts[-1] == "__init__" else ".".join(("hasten", *parts))


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names taken from it) for every hasten import in `path`."""
    is_package = path.name == "__init__.py"
    package = module_name(path).split(".") if is_package else module_name(path).split(".")[:-1]
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names = [alias.name for alias in node.names]
            submodules = [name for name in names if (PACKAGE.parent / module.replace(".", "/") / name).exists()
                          or (PACKAGE.parent / (module.replace(".", "/") + "/" + name + ".py")).exists()]
            found += [(f"{module}.{name}", []) for name in submodules]
            rest = [name for name in names if name not in submodules]
            if rest or not submodules:
                found.append((module, rest))
    return [(module, names) for module, names in found if module.split(".")[0] == "hasten"]


SOURCES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def test_every_package_has_a_layer():
    assert {layer_of(module) for module in SOURCES} - {"__init__"} <= set(LAYERS)


def test_imports_go_only_downward():
    rank = {layer: index for index, layer in enumerate(LAYERS)}
    upward = {}
    for module, path in SOURCES.items():
        mine = layer_of(module)
        if mine == "__init__":  # hasten/__init__.py: the top, lazily re-exporting the API
            continue
        bad = sorted(target for target, _ in imports(path)
                     if target != "hasten" and layer_of(target) != mine and rank[layer_of(target)] > rank[mine])
        if bad:
            upward[module] = bad
    assert upward == {}


def test_no_import_circles():
    graph = {module: {target for target, _ in imports(path) if target in SOURCES and target != "hasten"}
             for module, path in SOURCES.items()}
    # Tarjan's strongly connected components; a component of more than one module is a circle.
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert circles == []


def test_no_private_names_cross_modules():
    """A `_name` is its file's own: no other module imports it, in its package or outside."""
    crossing = {}
    for module, path in SOURCES.items():
        for target, names in imports(path):
            private = [name for name in names if name.startswith("_") and not name.startswith("__")]
            if private and target != module:
                crossing.setdefault(module, []).extend(f"{target}.{name}" for name in private)
    assert crossing == {}


@pytest.mark.parametrize("source, expected", [
    ("from . import loop\n", "hasten.train.loop"),  # a submodule through its package
    ("from ..kernels.precision import attention\n", "hasten.kernels.precision"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import Run\n", "hasten.train.loop"),
    ("def f():\n    from ..rollout import engine\n", "hasten.rollout.engine"),  # function-local
])
def test_the_rule_checker_sees_relative_imports(tmp_path, monkeypatch, source, expected):
    path = PACKAGE / "train" / "trainer.py"
    monkeypatch.setattr(Path, "read_text", lambda self, *args, **kwargs: source)
    assert expected in [module for module, _ in imports(path)]


def plant(monkeypatch, path: Path, line: str) -> None:
    """The checker reads `path` with `line` added at its end."""
    original = Path.read_text

    def read_text(self, *args, **kwargs):
        text = original(self, *args, **kwargs)
        return text + "\n" + line if self == path else text

    monkeypatch.setattr(Path, "read_text", read_text)


def test_the_checker_finds_an_upward_import_and_a_circle(monkeypatch):
    """The rules can fail: a planted kernels -> train import is upward, and with train -> kernels a circle."""
    plant(monkeypatch, PACKAGE / "kernels" / "precision.py", "from ..train import learner\n")
    with pytest.raises(AssertionError):
        test_imports_go_only_downward()
    with pytest.raises(AssertionError):
        test_no_import_circles()


def test_the_checker_finds_a_circle_through_type_checking(monkeypatch):
    """A circle only a type annotation closes (agent/tools -> isolation -> tools, as one was) is a circle."""
    plant(monkeypatch, PACKAGE / "agent" / "calls.py", "if TYPE_CHECKING:\n    from .tools import ToolRunner\n")
    with pytest.raises(AssertionError):
        test_no_import_circles()


def test_the_checker_finds_a_private_name_taken_from_a_sibling_module(monkeypatch):
    """Within one package too (rewards/scoring.py took runner's _Batch, as it did)."""
    plant(monkeypatch, PACKAGE / "rewards" / "scoring.py", "def late():\n    from .runner import _prompt_start\n")
    with pytest.raises(AssertionError):
        test_no_private_names_cross_modules()


def test_every_speed_flag_names_the_one_module_that_implements_it():
    import dataclasses

    from hasten.config import SpeedConfig
    from hasten.features import FEATURES

    assert sorted(FEATURES) == sorted(field.name for field in dataclasses.fields(SpeedConfig))
    missing = {flag: module for flag, module in FEATURES.items() if module not in SOURCES}
    assert missing == {}
    flags_of: dict[str, list[str]] = {}
    for flag, module in FEATURES.items():
        flags_of.setdefault(module, []).append(flag)
    silent = {module: flags for module, flags in flags_of.items()
              if not any(flag in SOURCES[module].read_text() for flag in flags)}
    assert silent == {}  # each named module reads (or documents) its feature's flag
