"""What a task is: training and held-out rows, default rewards, and a checker.

A task is plain data plus functions; it never touches a model or tokenizer.
Each row is a dict with a "prompt" (a string, or a list of chat messages) and
any other columns ("answer", "question", "tolerance", ...). Those columns go
to reward functions as per-sample keyword arguments, the way TRL passes
dataset columns.

`check` answers a narrower question than the rewards: did the completion give
a parseable answer, and was it right? Evaluation reports that as accuracy, so
it stays comparable even when the reward functions or their weights change.

The helpers here (chat prompts, disjoint train/eval generation, the numeric
checker) are shared by the generated tasks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from hasten.rewards.builtin import (
    DEFAULT_TOLERANCE,
    answer_value,
    extract_answer,
    parse_number,
    within_tolerance,
)
from hasten.tasks import TaskError  # defined with the registry, which raises it without importing this module
from hasten.rewards.runner import RewardFunction




@dataclass
class Verdict:
    parsed: bool  # an answer was found in the completion and could be read
    correct: bool  # ...and it matches the row's answer


@dataclass
class Task:
    name: str
    description: str
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_functions: list[RewardFunction]  # with the task's default weights
    check: Callable[[str, dict[str, Any]], Verdict | None]  # None: no notion of a correct answer
    # Task-specific held-out metrics: (completion texts, their rows) -> {name: value}, added to eval's.
    metrics: Callable[[list[str], list[dict[str, Any]]], dict[str, float]] | None = None
    # Task-specific eval metrics (e.g. the code task's pass@k), called by train/evaluate.py as
    # evaluate_more(engine, tokenizer, rows, samples, max_new_tokens, batch_size) -> metrics.
    evaluate_more: Callable[..., dict[str, float]] | None = None
    # Agentic tasks (docs/agentic.md): tools the model may call, and TRL's environment_factory
    # (a class or {name: class}); agent/__init__.py make_agent adds the config's and the API's to these.
    tools: list[Callable[..., Any]] = field(default_factory=list)
    environment: Any = None
    # A correct completion for a row, as TRL's conversational completion (assistant turns with their
    # tool_calls, tool turns with the tool's real result, the final answer): the SFT warm start's data
    # (`hasten sft --sft.source=task`, rft/demonstrations.py). None: the task has no demonstrations.
    demonstrate: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None

    @staticmethod
    def columns(rows: list[dict[str, Any]]) -> dict[str, list]:
        """Every non-prompt column as a list over `rows` (None where a row lacks it)."""
        names: dict[str, None] = {}  # ordered set: columns in first-seen order
        for row in rows:
            names.update((name, None) for name in row if name != "prompt")
        return {name: [row.get(name) for row in rows] for name in names}


def chat_prompt(
    question: str,
    system_prompt: str | None = None,
    examples: tuple[tuple[str, str], ...] = (),
) -> list[dict[str, str]]:
    """Messages: optional system prompt, worked (user, assistant) pairs, then the question."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for user_text, assistant_text in examples:
        messages.append({"role": "user", "content": user_text})
        messages.append({"role": "assistant", "content": assistant_text})
    messages.append({"role": "user", "content": question})
    return messages


def generate_split(
    sample: Callable[[random.Random], dict[str, Any]],
    num_train: int,
    num_eval: int,
    seed: int,
    exclude: Iterable[str] = (),
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Draw (train_rows, eval_rows) from `sample`, keyed by their "question".

    Eval rows are drawn first and are distinct, so the held-out set for a seed
    does not change when num_train does. Train rows skip eval questions and
    `exclude` (e.g. a worked example in the prompt) while the question space
    allows; once draws keep colliding, repeats are accepted rather than
    looping forever on a small space.
    """
    rng = random.Random(seed)
    held_out = set(exclude)
    eval_rows: list[dict[str, Any]] = []
    attempts = 0
    while len(eval_rows) < num_eval and attempts < 100 * num_eval:
        attempts += 1
        row = sample(rng)
        if row["question"] not in held_out:
            held_out.add(row["question"])
            eval_rows.append(row)
    train_rows: list[dict[str, Any]] = []
    attempts = 0
    while len(train_rows) < num_train:
        attempts += 1
        row = sample(rng)
        if row["question"] not in held_out or attempts > 100 * num_train:
            train_rows.append(row)
    return train_rows, eval_rows


def check_numeric_answer(text: str, row: dict[str, Any]) -> Verdict:
    """Verdict for a numeric row: parsed = <answer> holds a number; correct = within tolerance."""
    predicted = parse_number(extract_answer(text))
    target = answer_value(row.get("answer"))
    if predicted is None or target is None:
        return Verdict(parsed=predicted is not None, correct=False)
    tolerance = row.get("tolerance")
    tolerance = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
    return Verdict(parsed=True, correct=within_tolerance(predicted, target, tolerance))


def data_file(path: str | Path) -> Path:
    """`path` as a readable file, or TaskError saying it is missing or is a directory."""
    file = Path(path)
    if file.is_dir():
        raise TaskError(f"data error: '{path}' is a directory, not a data file")
    if not file.is_file():
        raise TaskError(f"data error: '{path}' does not exist")
    return file


def json_objects(text: str, label: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank JSONL line; a bad line is a TaskError naming it."""
    import json

    rows: list[tuple[int, dict[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"data error: {label} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise TaskError(f"{where}: expected a JSON object, got {json_type(row)}")
        rows.append((number, row))
    return rows


def json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
