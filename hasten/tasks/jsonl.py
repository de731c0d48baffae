"""Your own prompts from a data file: JSON Lines, JSON, Parquet, CSV, or a hub dataset.

Each row (tasks/data.py reads them) has a "prompt" (a non-empty string, or
a list of {"role", "content"} messages) and any other columns, which reach
reward functions as keyword arguments exactly as in TRL. task.path is the
training file; task.eval_path the held-out file. Without eval_path the last
10% of the training file's rows (at least one) are held out: the file's own
order, not a shuffle, so the split is reproducible and visible.

This task brings no reward functions of its own (they come from
rewards.extra). Its checker grades against an "answer" column when a row has
one: numerically within the row's "tolerance" (default 5%) when both sides
are numbers, otherwise as an exact string match of the <answer> text.
A malformed file or row is reported with its line or row number.
"""

from __future__ import annotations

from typing import Any

from hasten.config import TaskConfig
from hasten.rewards.builtin import answer_value, extract_answer, parse_number
from hasten.tasks import DESCRIPTIONS
from hasten.tasks.base import Task, TaskError, Verdict, check_numeric_answer
from hasten.tasks.data import load_rows

DESCRIPTION = DESCRIPTIONS["jsonl"]  # one text, in the registry (listed without importing this)
EVAL_FRACTION = 0.1


def read_rows(path: str) -> list[dict[str, Any]]:
    """Validated rows of a data file or hub dataset (tasks/data.py); TaskError naming the line or row."""
    return load_rows(path)


def check_answer_column(text: str, row: dict[str, Any]) -> Verdict | None:
    """Grade against row["answer"]; None when the row has no answer to grade against."""
    if row.get("answer") is None:
        return None
    if answer_value(row["answer"]) is not None and parse_number(extract_answer(text)) is not None:
        return check_numeric_answer(text, row)
    extracted = extract_answer(text)
    if extracted is None:
        return Verdict(parsed=False, correct=False)
    return Verdict(parsed=True, correct=extracted == str(row["answer"]).strip())


def build_jsonl(cfg: TaskConfig) -> Task:
    if not cfg.path:
        raise TaskError("config error: task.path is required when task.name is jsonl")
    rows = read_rows(cfg.path)
    if cfg.eval_path:
        train_rows, eval_rows = rows, read_rows(cfg.eval_path)
    else:
        if len(rows) < 2:
            raise TaskError(
                f"data error: {cfg.path} has 1 row; holding one out for eval needs at least 2 "
                "(or set task.eval_path)"
            )
        held_out = max(1, int(len(rows) * EVAL_FRACTION))
        train_rows, eval_rows = rows[:-held_out], rows[-held_out:]
    return Task(
        name="jsonl",
        description=DESCRIPTION,
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_functions=[],
        check=check_answer_column,
    )
