"""environment_factory, TRL 1.16's contract: one environment instance per rollout, its methods as tools.

    class Game:
        def reset(self, **row) -> str | None: ...     # required; text returned is appended to the prompt
        def guess(self, number: int) -> str: ...      # public methods (type hints + docstring) are tools
        def get_reward(self) -> float: ...            # optional: the environment owns (part of) the reward

A factory is a class or any zero-argument callable; a dict of them selects
one per row by the row's `environment` column (only that environment's tools
appear in its prompt; the column is not passed to reset). Instances are
pooled per name and reused across steps ("construct once, reset often"):
more are made only when a batch needs more at once. `get_reward` becomes a
reward function named after the class, weight 1, returning None for rollouts
of other environments, beside the task's rewards, which then become optional.

What a checkpoint does not hold: the instances' state. It is the user's (as
in TRL); a resumed run makes fresh instances and calls reset as usual, so an
environment whose reset depends only on the row resumes exactly, and one that
carries state across episodes (counters, its own RNG) does not.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from ..rewards.runner import RewardFunction
from ..userfiles import one_line
from .tools import Tool, ToolError, load_attribute, make_tool

RESERVED = ("reset", "get_reward")


class Environments:
    def __init__(self, factory: Callable[[], Any] | dict[str, Callable[[], Any]]):
        self.by_column = isinstance(factory, dict)
        self.factories: dict[str | None, Callable[[], Any]] = dict(factory) if self.by_column else {None: factory}
        if not self.factories:
            raise ToolError("environment error: environment_factory is an empty dict")
        self.pool: dict[str | None, list[Any]] = {}
        self.last: list[Any] = []  # the last batch's instances, one per rollout (TRL's trainer.environments)
        self.schemas: dict[str | None, dict[str, Tool]] = {}  # per environment: its methods as Tools (probe instance)
        for name, make in self.factories.items():
            label = _label(make, name)
            if not callable(make):
                raise ToolError(f"environment error: {label} is not a class or callable")
            try:
                instance = make()
            except Exception as error:
                raise ToolError(f"environment error: {label}() raised {_error_line(error)}") from None
            if not callable(getattr(instance, "reset", None)):
                raise ToolError(f"environment error: {label} has no reset method (reset(**row) -> str | None)")
            self.schemas[name] = {tool.name: tool for tool in (
                make_tool(getattr(instance, method), origin=f"{label}.{method}") for method in _methods(instance))}
            self.pool[name] = [instance]

    def check_rows(self, rows: list[dict], where: str) -> None:
        """A dict of environments needs every row's `environment` column to name one of them."""
        if not self.by_column:
            return
        for index, row in enumerate(rows):
            if row.get("environment") not in self.factories:
                raise ToolError(f"environment error: {where} row {index}: {self._unknown(row.get('environment'))}")

    def _unknown(self, name: Any) -> str:
        """TRL's words, which its users' `except ValueError` and tests match (ToolError is a ValueError)."""
        return (f"Example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(self.factories)}.")

    def take(self, rows: list[dict], num_generations: int) -> list[tuple[Any, str | None]]:
        """One instance per rollout (group-major), drawn from the pools, made when a pool runs short."""
        cursor: dict[str | None, int] = {}
        taken = []
        for row in rows:
            name = row.get("environment") if self.by_column else None
            if name not in self.factories:  # rows the Python API left to batch time, as TRL checks them
                raise ToolError(f"environment error: {self._unknown(name)}")
            for _ in range(num_generations):
                pool, index = self.pool[name], cursor.get(name, 0)
                if index == len(pool):
                    pool.append(self.factories[name]())
                cursor[name] = index + 1
                taken.append((pool[index], name))
        self.last = [instance for instance, _ in taken]
        return taken

    def reset(self, instance: Any, name: str | None, row: dict) -> str | None:
        """The instance's reset(**row); one that raises is a ToolError naming the class (exit 2), as a bad
        environment is a bad input: every rollout of it would fail the same way (TRL: a traceback)."""
        columns = {key: value for key, value in row.items() if key != "environment" or not self.by_column}
        try:
            observation = instance.reset(**columns)
        except Exception as error:
            raise ToolError(f"environment error: {_label(self.factories[name], name)}.reset raised "
                            f"{_error_line(error)}") from None
        return observation if isinstance(observation, str) else None

    def bound_tools(self, instance: Any, name: str | None) -> dict[str, Tool]:
        """The instance's methods as Tools; they run in the trainer (in_trainer), as the state they change is
        what get_reward and the reward functions read."""
        return {tool_name: dataclasses.replace(tool, fn=getattr(instance, tool_name), in_trainer=True)
                for tool_name, tool in self.schemas[name].items()}

    def reward_functions(self) -> list[RewardFunction]:
        """One per environment class with get_reward (TRL: named after the class, weight 1)."""
        functions, seen = [], []
        for pool in self.pool.values():
            kind = type(pool[0])
            if not callable(getattr(kind, "get_reward", None)) or kind in seen:
                continue
            seen.append(kind)
            functions.append(RewardFunction(kind.__name__, _environment_reward(kind)))
        return functions


def _environment_reward(kind: type) -> Callable[..., list]:
    if inspect.iscoroutinefunction(kind.get_reward):
        async def get_reward(environments, **_):
            return [await e.get_reward() if type(e) is kind else None for e in environments]
    else:
        def get_reward(environments, **_):
            return [e.get_reward() if type(e) is kind else None for e in environments]
    return get_reward


def _methods(instance: Any) -> list[str]:
    """Public methods of the instance's class (listed on the class: properties are not evaluated)."""
    return [name for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def _error_line(error: BaseException) -> str:
    try:
        return one_line(error)
    except Exception:  # an exception whose own __str__ raises
        return type(error).__name__


def _label(make: Any, name: str | None) -> str:
    base = getattr(make, "__name__", type(make).__name__)
    return base if name is None else f"environment '{name}' ({base})"


def load_environment(spec: str) -> Callable[[], Any]:
    """'path/to/file.py:Class' (task.environment) -> the factory."""
    path_text, separator, name = spec.rpartition(":")
    if not separator or not path_text or not name:
        raise ToolError(f"environment error: '{spec}' must look like path/to/file.py:Class")
    return load_attribute(path_text, name, "environment")
