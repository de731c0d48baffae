"""Task registry: task.name -> a builder that turns a TaskConfig into a Task.

Adding a task means writing one `build_<name>(cfg) -> Task` function and one
line in `TASKS`; the trainer and CLI only ever call `make_task`.
"""

from __future__ import annotations

import importlib
from typing import Callable

from hasten.config import Config, TaskConfig
from hasten.tasks import arithmetic, code, jsonl, unit_conversion
from hasten.tasks.base import Task, TaskError, Verdict


def _lazy(module: str, builder: str) -> Callable[[TaskConfig], Task]:
    """A builder that imports hasten.tasks.<module> when first called (chess loads python-chess and rapidfuzz)."""

    def build(cfg: TaskConfig) -> Task:
        return getattr(importlib.import_module(f"hasten.tasks.{module}"), builder)(cfg)

    return build


# name -> (builder, one-line description for `--help` and listings)
TASKS: dict[str, tuple[Callable[[TaskConfig], Task], str]] = {
    "arithmetic": (arithmetic.build_arithmetic, arithmetic.DESCRIPTION),
    "unit-conversion": (unit_conversion.build_unit_conversion, unit_conversion.DESCRIPTION),
    "jsonl": (jsonl.build_jsonl, jsonl.DESCRIPTION),
    "chess-a": (_lazy("chess", "build_chess_a"),
                "chess: apply a UCI move to a FEN, answer the new FEN and flags (FEN validity, Levenshtein)"),
    "chess-p": (_lazy("chess", "build_chess_p"),
                "chess: list legal moves and pick the best (mate-in-one / 2-ply material heuristic)"),
    "code": (code.build_code, code.DESCRIPTION),
    "calculator": (_lazy("calculator", "build_calculator"),
                   "3-4 digit products with a calculator tool (multi-turn, docs/agentic.md)"),
    "guess": (_lazy("guess", "build_guess"),
              "guess a number in 1..100 from higher/lower replies (an environment, docs/agentic.md)"),
}


def make_task(cfg: TaskConfig, config: Config | None = None) -> Task:
    if cfg.name == "dataset":  # rows handed to the Python API live in no file this config could name
        raise TaskError("config error: task.name 'dataset' is rows given to GRPOTrainer(train_dataset=...); "
                        "continue it from Python with trainer.train(resume_from_checkpoint=...)")
    if cfg.name not in TASKS:
        from hasten.games import GAMES  # trained by train/policy_loop.py, but a valid task.name all the same

        raise TaskError(f"config error: task.name must be one of {', '.join([*TASKS, *GAMES])} (got {cfg.name!r})")
    builder, _ = TASKS[cfg.name]
    if cfg.name == "code":  # the one task with a config section of its own (code:)
        return code.build_code(cfg, config.code if config is not None else None)
    return builder(cfg)


def list_tasks() -> list[tuple[str, str]]:
    """(name, description) for every registered task."""
    return [(name, description) for name, (_, description) in TASKS.items()]


__all__ = ["TASKS", "Task", "TaskError", "Verdict", "list_tasks", "make_task"]
