"""Isolated execution of untrusted code (model completions) against tests.

    from hasten.sandbox import Sandbox, assert_program
    sandbox = Sandbox()
    result = sandbox.run("def add(a, b):\n    return a + b\n", assert_program(["assert add(1, 2) == 3"]))
    result.status, result.fraction_passed  # ('pass', 1.0)

worker.py is the process that forks each execution's tree; isolation.py the
namespaces and rlimits; world.py the root built for the candidate; seccomp.py
its syscall allowlist; accounting.py the per-execution cgroup; candidate.py the only code in the
process with the model's code; judge.py the separate process that runs the
tests and decides the verdicts; wire.py the plain data between them; pool.py
the host side (pre-started workers, cache, one run per distinct job);
programs.py the test shapes and limits; results.py the record every
execution returns. Threat model and defences: docs/sandbox.md.
"""

from hasten.sandbox.pool import Sandbox, SandboxRefused, SandboxStats, default_workers, shared_sandbox
from hasten.sandbox.programs import Limits, ProgramError, TestProgram, assert_program, check_program
from hasten.sandbox.results import ExecutionResult, TestOutcome

__all__ = [
    "ExecutionResult",
    "Limits",
    "ProgramError",
    "Sandbox",
    "SandboxRefused",
    "SandboxStats",
    "TestOutcome",
    "TestProgram",
    "assert_program",
    "check_program",
    "default_workers",
    "shared_sandbox",
]
