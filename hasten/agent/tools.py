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

User tools run in the trainer's process, as in TRL: sync ones each on a
daemon thread, async ones on one background event loop, all of a turn's
calls across rollouts at once, each with its own timeout. A timed-out sync
call cannot be killed inside Python; its thread is abandoned (daemon, so it
never holds the process open at exit) and the model gets "timed out".
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UserError
from ..userfiles import load_attribute as load_user_attribute, one_line

CALL_PATTERN = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolError(UserError):
    """A tool the run cannot use (no type hints, no docstring, not callable); one line."""


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
    is_async: bool


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # the call could not be read; the model gets this back instead of a result


@dataclass
class CallResult:
    name: str
    content: str  # what the tool turn shows the model
    failed: bool


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
    return Tool(name, fn, schema, inspect.iscoroutinefunction(fn))


def load_tool(spec: str) -> Tool:
    """'path/to/file.py:function', or a built-in tool's name (calculator, python) -> Tool (generation.tools)."""
    from .builtin_tools import BUILTIN_TOOLS

    if spec in BUILTIN_TOOLS:
        return make_tool(BUILTIN_TOOLS[spec])
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


class ToolRunner:
    """Runs one turn's calls of every rollout at once, each with a timeout; errors come back as text."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None  # started on the first async tool

    def run(self, calls: list[list[ToolCall]], tools: list[dict[str, Tool]]) -> list[list[CallResult]]:
        """calls[i]: rollout i's calls this turn; tools[i]: the tools rollout i may use (by name)."""
        pending = [[self._start(call, available) for call in row] for row, available in zip(calls, tools)]
        return [[finish(self.timeout) for finish in row] for row in pending]

    def _start(self, call: ToolCall, available: dict[str, Tool]) -> Callable[[float], CallResult]:
        if call.error is not None:
            return _done(CallResult(call.name, f"error: {call.error}", True))
        tool = available.get(call.name)
        if tool is None:
            names = ", ".join(sorted(available)) or "none"
            return _done(CallResult(call.name, f"error: unknown tool '{call.name}' (tools: {names})", True))
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as error:
            return _done(CallResult(call.name, f"error: bad arguments for {call.name}: {error}", True))
        if tool.is_async:
            return self._start_async(tool, call)
        return _start_thread(tool, call)

    def _start_async(self, tool: Tool, call: ToolCall) -> Callable[[float], CallResult]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="hasten-tools", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(tool.fn(**call.arguments), self.timeout), self._loop)

        def finish(timeout: float) -> CallResult:
            try:
                return _result(call.name, future.result(timeout + 1.0))  # wait_for itself cancels at `timeout`
            except (asyncio.TimeoutError, TimeoutError):
                future.cancel()
                return CallResult(call.name, f"error: {call.name} timed out after {timeout:g} s", True)
            except Exception as error:  # the tool's own exception: the model reads it
                return CallResult(call.name, f"error: {one_line(error)}", True)
        return finish

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None


def _start_thread(tool: Tool, call: ToolCall) -> Callable[[float], CallResult]:
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = tool.fn(**call.arguments)
        except BaseException as error:  # SystemExit included: a tool cannot end the run
            box["error"] = error

    thread = threading.Thread(target=target, name=f"hasten-tool-{call.name}", daemon=True)
    thread.start()

    def finish(timeout: float) -> CallResult:
        thread.join(timeout)  # the calls started together, so waiting in turn bounds the whole turn by ~timeout
        if thread.is_alive():
            return CallResult(call.name, f"error: {call.name} timed out after {timeout:g} s", True)
        if "error" in box:
            return CallResult(call.name, f"error: {one_line(box['error'])}", True)
        return _result(call.name, box.get("value"))
    return finish


def _result(name: str, value: Any) -> CallResult:
    return CallResult(name, value if isinstance(value, str) else json.dumps(value, default=str), False)


def _done(result: CallResult) -> Callable[[float], CallResult]:
    return lambda timeout: result
