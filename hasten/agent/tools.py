"""Tools the model may call during a rollout: schemas, parsing, and guarded execution.

TRL 1.16's contract (GRPOTrainer(tools=[...])): a tool is a plain Python
callable, sync or async, with type-hinted arguments and a Google-style
docstring; its JSON schema is what transformers' `get_json_schema` builds
from them and is what the chat template shows the model. A callable without
them is a user error (one line naming the function), found before the run.

Calls follow the Hermes/Qwen convention the shipped template teaches
(agent/template.py): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one or more per assistant turn. Every way a call can go wrong (text that is
not JSON, an unknown tool, arguments the function rejects, an exception, a
timeout) becomes an error string handed back to the model and counted as a
failure (TRL's tools/failure_frequency), never an exception in the trainer.

Execution (ToolRunner) follows generation.tool_isolation for user tools:

  process  (the default) each call runs in a child forked from the trainer at
           the time of the call (agent/isolation.py), killed at its deadline:
           a tool that holds the GIL, never returns, crashes, calls os._exit
           or leaves threads behind costs its rollout an error string.
  thread   TRL's contract: the call runs in the trainer's process, sync tools
           each on a daemon thread, async ones on one background event loop.
           A tool can then share state with the trainer, but a timed-out call
           cannot be stopped (its thread is abandoned) and a crash is the run's.

hasten's own tools (Tool.in_trainer: the bounded calculator, the sandboxed
python) and environment methods (their state is the environment's, read by
get_reward) always run in the trainer on threads. Either way all of a turn's
calls, across rollouts, are started at once (children first, then threads),
each with its own deadline, its start + generation.tool_timeout: a call
still running then, or that finished after it, is "timed out", and the turn
waits about one timeout (plus the time to start its calls), never calls x
timeout.
A result becomes text (a str as is, anything else as JSON) in the tool's own
thread or child, and text longer than the turn's limit (result_limit) is
refused there, before a copy of it reaches the trainer.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import UserError
from ..userfiles import load_attribute as load_user_attribute, one_line
from .builtin_tools import BUILTIN_TOOLS, set_call_deadline
from .calls import Tool, ToolCall
from .isolation import Children
from .results import MIN_RESULT_CHARS, CallResult, failure_text, timed_out, to_text

if TYPE_CHECKING:
    from .forkserver import ForkServer

CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
ISOLATION = ("process", "thread")  # generation.tool_isolation


class ToolError(UserError):
    """A tool the run cannot use (no type hints, no docstring, not callable); one line."""


def make_tool(fn: Callable[..., Any], origin: str | None = None) -> Tool:
    """A callable -> Tool, its schema from type hints + docstring (transformers' get_json_schema)."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", None) or type(fn).__name__
    where = origin or name
    if not callable(fn):
        raise ToolError(f"tool error: {where} is not callable")
    try:
        schema = get_json_schema(fn)
    except Exception as error:  # DocstringParsingException, TypeHintParsingException, ...
        raise ToolError(f"tool error: {where}: {one_line(error)} (a tool needs type hints on every "
                        "argument and a Google-style docstring with an Args: section)") from None
    if origin is None:
        module, qualified = getattr(fn, "__module__", None), getattr(fn, "__qualname__", name)
        where = f"{module}.{qualified}" if module else qualified
    # hasten's own tools are bounded (calculator) or sandboxed (python): they run in the trainer, whether
    # named in generation.tools or brought by a task (the calculator task) or passed to the API
    builtin = any(fn is builtin_fn for builtin_fn in BUILTIN_TOOLS.values())
    return Tool(name, fn, schema, inspect.iscoroutinefunction(fn), where, in_trainer=builtin)


def unique_tools(tools: list[Tool]) -> dict[str, Tool]:
    """By name; two with the same name are a ToolError naming both (else one would silently shadow the other)."""
    by_name: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ToolError(f"tool error: two tools are named '{tool.name}': {by_name[tool.name].origin} and "
                            f"{tool.origin}; tool names must be unique")
        by_name[tool.name] = tool
    return by_name


def load_tool(spec: str) -> Tool:
    """'path/to/file.py:function', or a built-in tool's name (calculator, python) -> Tool (generation.tools)."""
    if spec in BUILTIN_TOOLS:
        return make_tool(BUILTIN_TOOLS[spec], origin=f"built-in {spec}")
    path_text, separator, name = spec.rpartition(":")
    if not separator or not path_text or not name:
        raise ToolError(f"tool error: '{spec}' must look like path/to/file.py:function or be a built-in tool "
                        "(calculator, python)")
    return make_tool(load_attribute(path_text, name, "tool"), origin=spec)


def load_attribute(path_text: str, name: str, kind: str) -> Any:
    """The attribute `name` of the Python file at path_text (a tool function, an environment class)."""
    return load_user_attribute(path_text, name, kind, ToolError)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every <tool_call>...</tool_call> block of one assistant turn, in order; unreadable ones carry an error."""
    calls = []
    for body in CALL_PATTERN.findall(text):
        try:
            payload = json.loads(body.strip())
        except json.JSONDecodeError as error:
            calls.append(ToolCall("unknown", {}, f"the tool call is not valid JSON ({error.msg})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            calls.append(ToolCall("unknown", {}, 'a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(payload["name"], {}, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(payload["name"], arguments))
    return calls


class ToolExit(BaseException):
    """os._exit called on a tool's thread (thread isolation): the call fails, the run goes on.

    A BaseException, like SystemExit, so the tool's own `except Exception` does not eat it."""


class ToolRunner:
    """Runs one turn's calls of every rollout at once, each with its timeout; errors come back as text."""

    def __init__(self, timeout: float, isolation: str = "process", fork_server: ForkServer | None = None):
        if isolation not in ISOLATION:
            raise ToolError(f"tool error: tool isolation must be one of {', '.join(ISOLATION)} (got {isolation!r})")
        self.timeout, self.isolation, self.fork_server = timeout, isolation, fork_server
        self._loop: asyncio.AbstractEventLoop | None = None  # started on the first async tool run in the trainer

    def run(self, calls: list[list[ToolCall]], tools: list[dict[str, Tool]],
            limit: int = MIN_RESULT_CHARS) -> list[list[CallResult]]:
        """calls[i]: rollout i's calls this turn; tools[i]: the tools rollout i may use (by name);
        limit: characters a result may have (result_limit of the length cap)."""
        children = Children(self.timeout, limit, self.fork_server)
        planned = [[self._plan(call, available) for call in row] for row, available in zip(calls, tools)]
        # Children fork first, while no tool thread of this turn can be holding a lock they would inherit.
        started = [[children.start(item[1], item[2]) if item[0] == "child" else item for item in row]
                   for row in planned]
        pending = [[self._start(item, limit) if isinstance(item, tuple) else item for item in row]
                   for row in started]
        children.collect()
        return [[finish() for finish in row] for row in pending]

    def _plan(self, call: ToolCall, available: dict[str, Tool]):
        """("done", CallResult) | ("child" | "thread", Tool, ToolCall): where this call will run, if anywhere."""
        if call.error is not None:
            return "done", CallResult(call.name, f"error: {call.error}", True)
        tool = available.get(call.name)
        if tool is None:
            names = ", ".join(sorted(available)) or "none"
            return "done", CallResult(call.name, f"error: unknown tool '{call.name}' (tools: {names})", True)
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as error:
            return "done", CallResult(call.name, f"error: bad arguments for {call.name}: {error}", True)
        return ("child" if self.isolation == "process" and not tool.in_trainer else "thread"), tool, call

    def _start(self, item: tuple, limit: int) -> Callable[[], CallResult]:
        if item[0] == "done":
            return lambda: item[1]
        _, tool, call = item
        _guard_exit()
        deadline = time.monotonic() + self.timeout  # each call's own: its start + the timeout
        if tool.is_async:
            return self._start_async(tool, call, deadline, limit)
        return _start_thread(tool, call, deadline, self.timeout, limit)

    def _start_async(self, tool: Tool, call: ToolCall, deadline: float, limit: int) -> Callable[[], CallResult]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=_run_loop, args=(self._loop,), name="hasten-tools", daemon=True).start()

        async def run() -> tuple[str, float]:
            text = to_text(await asyncio.wait_for(tool.fn(**call.arguments), self.timeout), limit)
            return text, time.monotonic()
        future = asyncio.run_coroutine_threadsafe(run(), self._loop)

        def finish() -> CallResult:
            try:
                # wait_for cancels at the timeout; the extra second is for a loop that a tool blocks
                text, finished = future.result(max(0.0, deadline - time.monotonic()) + 1.0)
                if finished > deadline:  # started late on a busy loop: late is timed out all the same
                    raise TimeoutError
                return CallResult(call.name, text, False)
            except (asyncio.TimeoutError, TimeoutError, asyncio.CancelledError):
                if not future.done():  # a tool blocked the loop itself (time.sleep in async def): leave it behind
                    self._loop = None
                future.cancel()
                return CallResult(call.name, timed_out(call.name, self.timeout), True)
            except BaseException as error:  # the tool's own exception, ResultTooLarge, ToolExit: the model reads it
                return CallResult(call.name, failure_text(call.name, error), True)
        return finish

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        if self.fork_server is not None:
            self.fork_server.close()


def _start_thread(tool: Tool, call: ToolCall, deadline: float, timeout: float,
                  limit: int) -> Callable[[], CallResult]:
    box: dict[str, Any] = {}

    def target() -> None:
        _on_tool_thread.active = True
        set_call_deadline(deadline)  # the python tool's sandbox job ends with the call (builtin_tools.py)
        try:
            box["text"] = to_text(tool.fn(**call.arguments), limit)  # a raising or huge conversion is the call's
        except BaseException as error:  # SystemExit and ToolExit included: a tool cannot end the run
            box["error"] = error
        box["finished"] = time.monotonic()

    thread = threading.Thread(target=target, name=f"hasten-tool-{call.name}", daemon=True)
    thread.start()

    def finish() -> CallResult:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive() or box["finished"] > deadline:  # late is timed out, however late we look
            return CallResult(call.name, timed_out(call.name, timeout), True)
        if "error" in box:
            return CallResult(call.name, failure_text(call.name, box["error"]), True)
        return CallResult(call.name, box["text"], False)
    return finish


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    _on_tool_thread.active = True  # only async tools run on this loop
    asyncio.set_event_loop(loop)
    loop.run_forever()


# os._exit on a tool's thread would end the trainer at once, with exit code 0 and no summary: a silent
# wrong result. On threads this module started for tools (and only in the trainer's own process, so a
# child the tool forks still exits), it raises ToolExit instead, and the call fails with that text.
_on_tool_thread = threading.local()
_real_exit = os._exit
_trainer_pid = os.getpid()


def _guarded_exit(code: int) -> None:
    if getattr(_on_tool_thread, "active", False) and os.getpid() == _trainer_pid:
        raise ToolExit(f"the tool called os._exit({code}) (a tool must return its result, not end the process)")
    _real_exit(code)


def _guard_exit() -> None:
    global _trainer_pid
    if os._exit is not _guarded_exit:
        _trainer_pid = os.getpid()
        os._exit = _guarded_exit
