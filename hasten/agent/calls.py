"""What a tool is (Tool) and what the model asked of it (ToolCall): plain data, the bottom of agent/.

Every side of a call reads these: the parser and the runner (agent/tools.py),
the child that runs a call (agent/child.py), the fork server that forks it
(agent/forkserver.py) and the trainer's end of process isolation
(agent/isolation.py); so they import nothing of those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
    is_async: bool
    origin: str = ""  # where it came from (file.py:function, module.function, Class.method), for messages
    in_trainer: bool = False  # hasten's bounded tools and environment methods: never in a child process


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # the call could not be read; the model gets this back instead of a result
