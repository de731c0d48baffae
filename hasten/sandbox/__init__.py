"""Isolated execution of untrusted code (model completions) against tests.

    from hasten.sandbox import Sandbox, assert_program
    sandbox = Sandbox()
    result = sandbox.run("def add(a, b):\n    return a + b\n", assert_program(["assert add(1, 2) == 3"]))
    result.status, result.fraction_passed  # ('pass', 1.0)

worker.py is the process that forks and isolates each execution; pool.py the
host side (pre-started workers, LRU cache, batches); programs.py the test
shapes and limits; results.py the record every execution returns. The threat
model and which layer enforces what: docs/sandbox.md.
"""

from hasten.sandbox.pool import Sandbox, SandboxStats, default_workers, shared_sandbox
from hasten.sandbox.programs import Limits, ProgramError, TestProgram, assert_program, check_program
from hasten.sandbox.results import ExecutionResult, TestOutcome

__all__ = [
    "ExecutionResult",
    "Limits",
    "ProgramError",
    "Sandbox",
    "SandboxStats",
    "TestOutcome",
    "TestProgram",
    "assert_program",
    "check_program",
    "default_workers",
    "shared_sandbox",
]
