"""Rewards for code completions, each a separate TRL-signature function.

Default weights (the seed's): tests 0.5, execution 0.2, syntax 0.15, lint 0.1,
complexity 0.05; an optional mypy type check is off by default. All of them:

1. extract the code: the first ```python block (or the first fenced block,
   or the whole text when there is no fence; an unclosed fence, as a
   truncated generation leaves it, runs to the end);
2. prepend the row's `preamble` (the prompt's imports and helper functions,
   which the model is not asked to repeat);
3. apply the syntax gate: code that does not parse gets GATE_REWARD from
   every function and is never linted, type-checked or executed. That is the
   early-termination rule of the seed, done here per sample so it holds
   whatever runner calls these functions.

Execution and tests share one sandboxed run per distinct (code, tests): the
second function to ask finds it in the sandbox's cache, or waits for the run
already under way (sandbox/pool.py). The preamble also goes to the sandbox's
judge, which runs its own copy, so helpers the tests call stay the task's. Rows without `tests`
get None (the reward does not apply). Lint runs ruff once per batch over all
distinct programs; it parses but never executes them.

Reward objects hold only settings (no processes), so they pickle; the sandbox
itself is created per process on first use (`shared_sandbox`).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from hasten.rewards.builtin import completion_text
from hasten.rewards.runner import RewardError, RewardFunction
from hasten.sandbox import ExecutionResult, Limits, TestProgram, shared_sandbox
from hasten.sandbox.results import syntax_error_result

GATE_REWARD = 0.0  # every code reward for a completion whose code does not parse
DEFAULT_WEIGHTS = {"tests": 0.5, "execution": 0.2, "syntax": 0.15, "lint": 0.1, "complexity": 0.05}
TYPECHECK_WEIGHT = 0.1
# ruff's default rule families plus warnings; F401/F811 stay quiet because the preamble's
# imports and helpers may be unused or redefined by a complete answer.
LINT_SELECT, LINT_IGNORE = "E4,E7,E9,F,W", "F401,F811"

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL)


# ------------------------------------------------------------------ parsing


def extract_code(text: str) -> str:
    """The code in a completion: first python fence, else first fence, else the text itself."""
    blocks = _FENCE.findall(text)
    for language, body in blocks:
        if language.lower() in ("python", "py", "python3"):
            return body
    if blocks:
        return blocks[0][1]
    return text


@functools.lru_cache(maxsize=8192)
def parses(code: str) -> bool:
    """True if `code` is non-empty Python that compiles (the syntax gate)."""
    if not code.strip():
        return False
    try:
        compile(code, "<completion>", "exec", flags=ast.PyCF_ONLY_AST)
    except Exception:  # noqa: BLE001 - SyntaxError; ValueError (NUL bytes); RecursionError, MemoryError (deep nesting)
        return False  # whatever compile raises is this completion's failure, never the run's
    return True


def code_parses(completion: Any, preamble: str | None) -> bool:
    """The syntax gate: the model wrote some code, and with the preamble it parses."""
    code, source = program_source(completion, preamble)
    return parses(code) and parses(source)


def program_source(completion: Any, preamble: str | None) -> tuple[str, str]:
    """(code the model wrote, full source to run = preamble + code)."""
    code = extract_code(completion_text(completion))
    return code, (preamble + "\n\n" + code) if preamble else code


def _columns(count: int, kwargs: dict, name: str) -> list:
    values = kwargs.get(name)
    return list(values) if values is not None else [None] * count


# ------------------------------------------------------------- fast rewards


def syntax_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """1.0 if the extracted code (with the row's preamble) parses, else 0.0."""
    preambles = _columns(len(completions), kwargs, "preamble")
    return [1.0 if code_parses(c, p) else GATE_REWARD for c, p in zip(completions, preambles)]


@dataclass
class Complexity:
    depth: int  # deepest nesting of control blocks (if/for/while/try/with/def inside def ...)
    branches: int  # decision points: if, loops, except, boolean operators, comprehensions
    lines: int  # non-blank lines


_BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith,
           ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BRANCHES = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.BoolOp, ast.IfExp,
             ast.comprehension)


def measure_complexity(code: str) -> Complexity:
    tree = ast.parse(code)

    def depth(node: ast.AST) -> int:
        inner = max((depth(child) for child in ast.iter_child_nodes(node)), default=0)
        return inner + isinstance(node, _BLOCKS)

    branches = sum(isinstance(node, _BRANCHES) for node in ast.walk(tree))
    return Complexity(depth(tree), branches, sum(1 for line in code.splitlines() if line.strip()))


def complexity_score(measure: Complexity) -> float:
    """1.0 for small, flat code, falling with nesting past 3, branches past 10, length past 30 lines."""
    penalty = (0.25 * max(0, measure.depth - 3) + 0.05 * max(0, measure.branches - 10)
               + 0.01 * max(0, measure.lines - 30))
    return max(0.0, 1.0 - penalty)


def complexity_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """Simplicity of the model's own code (preamble excluded); GATE_REWARD when it does not parse."""
    preambles = _columns(len(completions), kwargs, "preamble")
    scores = []
    for completion, preamble in zip(completions, preambles):
        code, source = program_source(completion, preamble)
        try:
            scores.append(complexity_score(measure_complexity(code)) if parses(code) and parses(source)
                          else GATE_REWARD)
        except RecursionError:  # parses, but nests deeper than the measuring walk recurses
            scores.append(GATE_REWARD)
    return scores


# ----------------------------------------------------------- lint and types


def ruff_binary() -> str | None:
    """Path of the ruff executable (the `ruff` PyPI package ships one), or None."""
    try:
        from ruff.__main__ import find_ruff_bin

        return os.fsdecode(find_ruff_bin())
    except (ImportError, FileNotFoundError):
        return shutil.which("ruff")


def _issue_counts(command: list[str], sources: list[tuple[str, int]], parse) -> list[int]:
    """Write each source to its own file, run `command` once on the directory, count issues per file.

    `sources` are (text, first line of the model's code); issues above that line are the preamble's.
    """
    with tempfile.TemporaryDirectory(prefix="hasten-lint-") as directory:
        paths = []
        for index, (text, _) in enumerate(sources):
            path = os.path.join(directory, f"sample_{index}.py")
            with open(path, "w", encoding="utf-8") as file:
                file.write(text if text.endswith("\n") else text + "\n")  # the fence ate the last newline
            paths.append(path)
        completed = subprocess.run([*command, directory], capture_output=True, text=True, timeout=120,
                                   cwd=directory)
        counts = [0] * len(sources)
        for file_name, line in parse(completed):
            index = int(os.path.basename(file_name).removeprefix("sample_").removesuffix(".py"))
            if line >= sources[index][1]:
                counts[index] += 1
        return counts


def _ruff_issues(completed: subprocess.CompletedProcess) -> list[tuple[str, int]]:
    if completed.returncode not in (0, 1):
        raise RewardError(f"reward error: ruff failed: {completed.stderr.strip()[:200]}")
    return [(item["filename"], item["location"]["row"]) for item in json.loads(completed.stdout or "[]")]


def _mypy_issues(completed: subprocess.CompletedProcess) -> list[tuple[str, int]]:
    issues = []
    for line in completed.stdout.splitlines():
        match = re.match(r"(.+?\.py):(\d+)(?::\d+)?: error:", line)
        if match:
            issues.append((match.group(1), int(match.group(2))))
    return issues


def _issue_rewards(completions: list, kwargs: dict, command: list[str], parse) -> list[float]:
    """1 / (1 + issues in the model's code), GATE_REWARD for code that does not parse."""
    preambles = _columns(len(completions), kwargs, "preamble")
    sources: dict[tuple[str, int], int] = {}  # distinct (source, first code line) -> position
    keys: list[tuple[str, int] | None] = []
    for completion, preamble in zip(completions, preambles):
        code, source = program_source(completion, preamble)
        if not (parses(code) and parses(source)):
            keys.append(None)
            continue
        key = (source, source.count("\n") - code.count("\n") + 1)
        sources.setdefault(key, len(sources))
        keys.append(key)
    counts = _issue_counts(command, list(sources), parse) if sources else []
    return [GATE_REWARD if key is None else 1.0 / (1.0 + counts[sources[key]]) for key in keys]


def lint_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """ruff: 1.0 with no issues, 1/(1+n) with n; GATE_REWARD when the code does not parse."""
    binary = ruff_binary()
    if binary is None:
        raise RewardError("reward error: lint needs ruff (pip install 'hasten[code]')")
    command = [binary, "check", "--isolated", "--no-cache", "--output-format", "json", "--line-length", "120",
               "--select", LINT_SELECT, "--ignore", LINT_IGNORE, "--exit-zero"]
    return _issue_rewards(completions, kwargs, command, _ruff_issues)


def typecheck_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """mypy: 1/(1 + type errors in the model's code); GATE_REWARD when it does not parse."""
    command = [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-error-summary",
               "--hide-error-context", "--no-incremental", "--cache-dir", os.devnull, "--show-column-numbers"]
    return _issue_rewards(completions, kwargs, command, _mypy_issues)


def mypy_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("mypy") is not None


# ------------------------------------------------------------ sandbox rewards


@dataclass
class SandboxSettings:
    workers: int = 0
    limits: Limits = field(default_factory=Limits)
    cache_size: int = 4096
    fallback: bool = False  # code.sandbox_fallback: run where namespaces are refused (docs/sandbox.md)

    def sandbox(self):
        return shared_sandbox(self.workers, self.limits, self.cache_size, self.fallback)


def run_completions(settings: SandboxSettings, completions: list, kwargs: dict) -> list[ExecutionResult | None]:
    """One sandbox result per completion (None where the row has no tests), run as one batch."""
    preambles = _columns(len(completions), kwargs, "preamble")
    tests = _columns(len(completions), kwargs, "tests")
    jobs, positions = [], []
    results: list[ExecutionResult | None] = [None] * len(completions)
    for index, (completion, preamble, program) in enumerate(zip(completions, preambles, tests)):
        if program is None:
            continue
        program = program if isinstance(program, TestProgram) else TestProgram.from_dict(program)
        code, source = program_source(completion, preamble)
        if not (parses(code) and parses(source)):  # the gate: blank or unparsable code never runs
            results[index] = syntax_error_result(program, "the completion has no code that parses")
            continue
        jobs.append((source, program, preamble or ""))
        positions.append(index)
    for index, result in zip(positions, settings.sandbox().run_many(jobs)):
        results[index] = result
    return results


@dataclass
class TestsReward:
    """Fraction of the row's tests passed (each test isolated); GATE_REWARD without executing on a parse failure."""

    settings: SandboxSettings = field(default_factory=SandboxSettings)
    __name__ = "tests_reward"

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        results = run_completions(self.settings, completions, kwargs)
        return [None if r is None else GATE_REWARD if r.status == "syntax_error" else r.fraction_passed
                for r in results]


@dataclass
class ExecutionReward:
    """1.0 if the code itself runs to completion without raising (tests aside), else 0.0."""

    settings: SandboxSettings = field(default_factory=SandboxSettings)
    __name__ = "execution_reward"

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        results = run_completions(self.settings, completions, kwargs)
        return [None if r is None else 1.0 if r.loaded else GATE_REWARD for r in results]


def code_rewards(settings: SandboxSettings | None = None, typecheck: bool = False) -> list[RewardFunction]:
    """The code task's reward functions with their default weights and speed flags."""
    settings = settings or SandboxSettings()
    functions = [
        RewardFunction("tests", TestsReward(settings), DEFAULT_WEIGHTS["tests"], slow=True, deterministic=True),
        RewardFunction("execution", ExecutionReward(settings), DEFAULT_WEIGHTS["execution"], slow=True,
                       deterministic=True),
        RewardFunction("syntax", syntax_reward, DEFAULT_WEIGHTS["syntax"], deterministic=True),
        RewardFunction("lint", lint_reward, DEFAULT_WEIGHTS["lint"], slow=True, deterministic=True),
        RewardFunction("complexity", complexity_reward, DEFAULT_WEIGHTS["complexity"], deterministic=True),
    ]
    if typecheck:
        functions.append(RewardFunction("typecheck", typecheck_reward, TYPECHECK_WEIGHT, slow=True,
                                        deterministic=True))
    return functions
