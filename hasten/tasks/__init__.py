"""Task registry: task.name -> a builder that turns a TaskConfig into a Task.

Adding a task means writing one `build_<name>(cfg) -> Task` function and one
line in `TASKS`; the trainer and CLI only ever call `make_task`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hasten.errors import UserError

if TYPE_CHECKING:
    from hasten.config import Config, TaskConfig


class TaskError(UserError):
    """A user-facing task or data problem; str() is the one-line message."""


def _lazy(module: str, builder: str) -> Callable[..., Any]:
    """A builder that imports hasten.tasks.<module> when first called: the task modules import the reward
    runner and with it torch (~1 s on 2 cores), which `hasten tasks` and a misspelled task name never need."""

    def build(*args) -> Any:  # a tasks.base.Task
        return getattr(importlib.import_module(f"hasten.tasks.{module}"), builder)(*args)

    return build


# One line per task for `hasten tasks` and error messages; the task modules show the same text as Task.description.
DESCRIPTIONS = {
    "arithmetic": "two-digit addition ('What is 47 + 38?'), exact answers",
    "unit-conversion": "unit conversions ('How many grams are there in 6 kg?'), within 5%",
    "jsonl": "your prompts from task.path (.jsonl, .json, .parquet, .csv, hub name), rewards from rewards.extra",
    "chess-a": "chess: apply a UCI move to a FEN, answer the new FEN and flags (FEN validity, Levenshtein)",
    "chess-p": "chess: list legal moves and pick the best (mate-in-one / 2-ply material heuristic)",
    "code": "write a Python function from its docstring; sandboxed tests (builtin, HumanEval, MBPP, jsonl)",
    "calculator": "3-4 digit products with a calculator tool (multi-turn, docs/agentic.md)",
    "guess": "guess a number in 1..100 from higher/lower replies (an environment, docs/agentic.md)",
}

# name -> (builder, one-line description for `--help` and listings)
TASKS: dict[str, tuple[Callable[..., Any], str]] = {
    "arithmetic": (_lazy("arithmetic", "build_arithmetic"), DESCRIPTIONS["arithmetic"]),
    "unit-conversion": (_lazy("unit_conversion", "build_unit_conversion"), DESCRIPTIONS["unit-conversion"]),
    "jsonl": (_lazy("jsonl", "build_jsonl"), DESCRIPTIONS["jsonl"]),
    "chess-a": (_lazy("chess", "build_chess_a"), DESCRIPTIONS["chess-a"]),
    "chess-p": (_lazy("chess", "build_chess_p"), DESCRIPTIONS["chess-p"]),
    "code": (_lazy("code", "build_code"), DESCRIPTIONS["code"]),
    "calculator": (_lazy("calculator", "build_calculator"), DESCRIPTIONS["calculator"]),
    "guess": (_lazy("guess", "build_guess"), DESCRIPTIONS["guess"]),
}


def __getattr__(name: str) -> Any:
    """Task and Verdict, imported (with torch) only when a caller asks for them."""
    if name in ("Task", "Verdict"):
        return getattr(importlib.import_module("hasten.tasks.base"), name)
    raise AttributeError(f"module 'hasten.tasks' has no attribute {name!r}")


def check_name(name: str) -> None:
    """A task.name that is no task: one line, before anything heavy is imported."""
    if name == "dataset" or name in TASKS:
        return
    from hasten.games import GAMES  # trained by train/policy_loop.py, but a valid task.name all the same

    if name not in GAMES:
        raise TaskError(f"config error: task.name must be one of {', '.join([*TASKS, *GAMES])} (got {name!r})")


DATA_FORMATS = (".jsonl", ".json", ".parquet", ".csv")  # what task.path's file may be (tasks/data.py reads them)


def check_data_path(source: str) -> bool:
    """What can be said of task.path without reading it: True for a data file, False for a hub dataset name;
    a missing file, a directory or another suffix is one TaskError (data.load_rows asks this first)."""
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix not in DATA_FORMATS and not path.exists():
        return False
    if path.is_dir():
        raise TaskError(f"data error: '{source}' is a directory, not a data file "
                        f"(expected a {', '.join(DATA_FORMATS)} file)")
    if not path.is_file():
        raise TaskError(f"data error: '{source}' does not exist")
    if suffix not in DATA_FORMATS:
        raise TaskError(f"data error: {source}: unsupported file type '{suffix or 'none'}' "
                        f"(use {', '.join(DATA_FORMATS)})")
    return True


def make_task(cfg: TaskConfig, config: Config | None = None) -> Any:  # a tasks.base.Task (not imported here: it imports this module)
    if cfg.name == "dataset":  # rows handed to the Python API live in no file this config could name
        raise TaskError("config error: task.name 'dataset' is rows given to GRPOTrainer(train_dataset=...); "
                        "continue it from Python with trainer.train(resume_from_checkpoint=...)")
    if cfg.name not in TASKS:
        from hasten.games import GAMES  # trained by train/policy_loop.py, but a valid task.name all the same

        raise TaskError(f"config error: task.name must be one of {', '.join([*TASKS, *GAMES])} (got {cfg.name!r})")
    builder, _ = TASKS[cfg.name]
    if cfg.name == "code":  # the one task with a config section of its own (code:)
        return builder(cfg, config.code if config is not None else None)
    return builder(cfg)


def list_tasks() -> list[tuple[str, str]]:
    """(name, description) for every registered task."""
    return [(name, description) for name, (_, description) in TASKS.items()]


__all__ = ["DATA_FORMATS", "DESCRIPTIONS", "check_data_path", "TASKS", "Task", "TaskError", "Verdict", "check_name", "list_tasks", "make_task"]
