"""Test programs: what the sandbox runs after the code, one verdict per test.

Two shapes, both plain JSON so they travel to the worker and sit in dataset rows:

- "asserts": a list of statements (MBPP's `test_list`, hasten's own format),
  each run on its own after an optional setup snippet, so one failing
  assertion does not hide the rest.
- "check": a HumanEval test file defining `check(candidate)`. The judge
  (judge.py) really calls `check(<entry_point>)`, the entry point being a
  handle on the candidate's function; to score each assertion separately,
  every top-level statement of check's body that contains an `assert` is
  wrapped in begin/end hooks (a try/except that records the verdict and
  carries on). Other statements (imports, helper values) run unchanged.

Limits travel with the job as a dict built from `Limits`.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hasten.errors import UserError


class ProgramError(UserError):
    """A test program that cannot be built (bad test code in the data); one line."""


@dataclass(frozen=True)
class Limits:
    """Per-execution limits; docs/sandbox.md says which layer enforces each."""

    wall_seconds: float = 10.0  # whole run, enforced by the worker (SIGKILL of the namespace)
    test_seconds: float = 3.0  # one test (or loading the code); an interval timer in the process
    cpu_seconds: int = 10  # RLIMIT_CPU per process
    memory_bytes: int = 512 << 20  # RLIMIT_AS per process
    max_processes: int = 8  # RLIMIT_NPROC (per user namespace): processes and threads
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the code may write
    disk_bytes: int = 32 << 20  # size of the tmpfs working directory
    tmp_inodes: int = 4096  # files and dirs it may hold (each costs kernel memory beyond disk_bytes)
    output_bytes: int = 64 << 10  # stdout and stderr each kept up to this, then the pipe closes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TestProgram:
    mode: str  # "asserts" | "check"
    tests: tuple[str, ...]  # asserts: the statements; check: each test's source, for reports
    setup: str = ""  # asserts: run once after the code (imports, helpers)
    source: str = ""  # check: the rewritten test file
    entry_point: str = ""  # check: the function handed to check(); both: a name always taken from the code
    extra: dict[str, Any] = field(default_factory=dict)  # room for task metadata; not sent

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "tests": list(self.tests), "setup": self.setup,
                "source": self.source, "entry_point": self.entry_point}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> TestProgram:
        return TestProgram(mode=data["mode"], tests=tuple(data["tests"]), setup=data.get("setup", ""),
                           source=data.get("source", ""), entry_point=data.get("entry_point", ""))

    def key(self) -> str:
        """Stable digest of what the worker runs (for the result cache)."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()


def assert_program(tests: list[str], setup: str = "", where: str = "tests", entry_point: str = "") -> TestProgram:
    """A program of independent statements; each must parse on its own.

    entry_point, when given, is the function under test: the judge takes that name from the code
    even when it is also a builtin's (a row testing its own `divmod`), and never the builtin.
    """
    if not tests:
        raise ProgramError(f"data error: {where} is empty (a problem needs at least one test)")
    for index, test in enumerate(tests):
        if not isinstance(test, str):
            raise ProgramError(f"data error: {where}[{index}] must be a string (got {type(test).__name__})")
        try:
            ast.parse(test)
        except SyntaxError as exc:
            raise ProgramError(f"data error: {where}[{index}] is not valid Python ({exc.msg})") from None
    try:
        ast.parse(setup)
    except SyntaxError as exc:
        raise ProgramError(f"data error: test setup of {where} is not valid Python ({exc.msg})") from None
    return TestProgram(mode="asserts", tests=tuple(tests), setup=setup, entry_point=entry_point)


def check_program(test_source: str, entry_point: str, where: str = "test") -> TestProgram:
    """Rewrite a HumanEval-style `check(candidate)` so each of its tests reports separately."""
    try:
        module = ast.parse(test_source)
    except SyntaxError as exc:
        raise ProgramError(f"data error: {where} is not valid Python ({exc.msg})") from None
    check = next((node for node in module.body
                  if isinstance(node, ast.FunctionDef) and node.name == "check"), None)
    if check is None:
        raise ProgramError(f"data error: {where} defines no check(candidate) function")
    names: list[str] = []
    body: list[ast.stmt] = []
    for statement in check.body:
        if not any(isinstance(node, ast.Assert) for node in ast.walk(statement)) or _always_true(statement):
            body.append(statement)  # setup inside check() (or `assert True`): runs as written
            continue
        index = len(names)
        names.append((ast.get_source_segment(test_source, statement) or ast.unparse(statement))[:300])
        body.append(_wrapped(statement, index))
    if not names:
        raise ProgramError(f"data error: {where}: check() contains no assert")
    check.body = body
    return TestProgram(mode="check", tests=tuple(names), source=ast.unparse(ast.fix_missing_locations(module)),
                       entry_point=entry_point)


def _always_true(statement: ast.stmt) -> bool:
    """`assert True, "..."`: HumanEval's debugging markers, not tests (they would pad every score)."""
    return (isinstance(statement, ast.Assert) and isinstance(statement.test, ast.Constant)
            and statement.test.value is True)


def _wrapped(statement: ast.stmt, index: int) -> ast.stmt:
    """try: begin(i); <statement> / except BaseException as e: end(i, e) / else: end(i, None)."""
    template = ast.parse(
        f"try:\n    __hasten_begin__({index})\n    pass\n"
        f"except BaseException as __hasten_error__:\n    __hasten_end__({index}, __hasten_error__)\n"
        f"else:\n    __hasten_end__({index}, None)\n"
    ).body[0]
    assert isinstance(template, ast.Try)
    template.body[1] = statement
    return template
