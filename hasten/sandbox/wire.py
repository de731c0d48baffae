"""Plain data on the wire between the judge and the process that runs the candidate.

The judge (trusted: it runs the tests and decides every verdict) never holds
an object the candidate made. Values cross a pipe as JSON with tagged
containers, and the judge rebuilds them from builtin types only, so an
`__eq__`, `__hash__` or `__bool__` the candidate wrote never runs on the
judge's side. What the encoder does is the candidate's business (it runs
in the candidate's process and may be patched); only `decode` is trusted,
and it accepts nothing but the shapes below:

    None, true/false, "str", 12, 1.5          themselves
    ["i", "-1f"]                               an int too big for a JSON double (hex, linear to parse)
    ["F", "nan" | "inf" | "-inf"]              non-finite floats
    ["c", [real, imag]]                        complex
    ["l" | "t" | "s" | "z", [items]]           list, tuple, set, frozenset
    ["d", [[key, value], ...]]                 dict (keys of any plain type)
    ["b", "hex"]                               bytes (bytearray arrives as bytes)
    ["h", id, "type name"]                     a handle: an object that stays in the candidate's process

Imported by the sandbox worker as a top-level module (python -I -S), so it
uses the standard library only.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable

MAX_DEPTH = 100  # nesting beyond this is refused (and would exhaust the C stack of json first)
MAX_LINE = 8 << 20  # one message on a pipe; longer is a broken channel
MAX_ITEMS = 1 << 20  # values one decode rebuilds (the judge's memory for one answer stays bounded)
MAX_INT_DIGITS = 1 << 20  # hex digits of one big int (linear to parse)
_SAFE_INT = 1 << 53
_CONTAINERS = {"l": list, "t": tuple, "s": set, "z": frozenset}


class WireError(ValueError):
    """A message that is not valid plain data (the call it answers fails)."""


def encode(value: Any, handle: Callable[[Any], list], depth: int = 0) -> Any:
    """Python value -> JSON-able tagged form; anything that is not plain data becomes handle(value)."""
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    if value is None or isinstance(value, bool):
        return bool(value) if value is not None else None
    if isinstance(value, int):
        number = int.__index__(value)  # an IntEnum or other int subclass travels as its int
        return number if -_SAFE_INT < number < _SAFE_INT else ["i", format(number, "x")]
    if isinstance(value, float):
        number = float.__float__(value)
        return number if math.isfinite(number) else ["F", repr(number)]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        return ["c", [encode(value.real, handle, depth + 1), encode(value.imag, handle, depth + 1)]]
    if isinstance(value, (bytes, bytearray)):
        return ["b", bytes(value).hex()]
    for tag, kind in (("t", tuple), ("l", list), ("z", frozenset), ("s", set)):
        if isinstance(value, kind):
            return [tag, [encode(item, handle, depth + 1) for item in value]]
    if isinstance(value, dict):
        return ["d", [[encode(key, handle, depth + 1), encode(item, handle, depth + 1)]
                      for key, item in dict.items(value)]]
    return handle(value)


def decode(data: Any, handle: Callable[[int, str], Any], depth: int = 0, budget: list[int] | None = None) -> Any:
    """Tagged form (already parsed from JSON) -> builtin values and handles; WireError on anything else.

    At most MAX_ITEMS values and MAX_DEPTH levels per call: a reply that would rebuild more fails.
    """
    if depth > MAX_DEPTH:
        raise WireError("value nested too deeply")
    budget = budget if budget is not None else [MAX_ITEMS]
    budget[0] -= 1
    if budget[0] < 0:
        raise WireError(f"more than {MAX_ITEMS} values in one message")
    kind = type(data)
    if data is None or kind in (bool, int, str):
        return data
    if kind is float:
        return data
    if kind is not list or len(data) < 2 or type(data[0]) is not str:
        raise WireError(f"not plain data: {kind.__name__}")
    tag, payload = data[0], data[1]
    try:
        if tag in _CONTAINERS and type(payload) is list:
            return _CONTAINERS[tag](decode(item, handle, depth + 1, budget) for item in payload)
        if tag == "d" and type(payload) is list:
            pairs = []
            for pair in payload:
                if type(pair) is not list or len(pair) != 2:
                    raise WireError("malformed dict entry")
                pairs.append((decode(pair[0], handle, depth + 1, budget), decode(pair[1], handle, depth + 1, budget)))
            return dict(pairs)
        if tag == "i" and type(payload) is str and len(payload) <= MAX_INT_DIGITS:
            return int(payload, 16)
        if tag == "F" and payload in ("nan", "inf", "-inf"):
            return float(payload)
        if tag == "c" and type(payload) is list and len(payload) == 2:
            real, imag = (decode(part, handle, depth + 1, budget) for part in payload)
            if type(real) not in (int, float) or type(imag) not in (int, float):
                raise WireError("malformed complex")
            return complex(real, imag)
        if tag == "b" and type(payload) is str:
            return bytes.fromhex(payload)
        if tag == "h" and type(payload) is int and len(data) == 3 and type(data[2]) is str:
            return handle(payload, data[2][:100])
    except (TypeError, ValueError) as error:  # an unhashable set member or dict key, bad hex
        raise WireError(str(error)) from None
    raise WireError(f"unknown tag {tag[:20]!r}")


def dumps(message: dict) -> bytes:
    return (json.dumps(message, separators=(",", ":")) + "\n").encode()


def loads(line: bytes) -> dict:
    """One message; WireError unless it is a JSON object."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise WireError(f"not JSON: {str(error)[:100]}") from None
    if type(message) is not dict:
        raise WireError(f"not a JSON object: {type(message).__name__}")
    return message


class LineReader:
    """Newline-framed messages from a pipe, each at most MAX_LINE bytes (longer: the channel is broken)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = bytearray()
        self.closed = False  # EOF seen, or the peer broke the framing

    def pop(self) -> bytes | None:
        """A complete line already read, if any."""
        end = self.buffer.find(b"\n")
        if end < 0:
            if len(self.buffer) > MAX_LINE:
                self.closed = True
                self.buffer.clear()
            return None
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        return line

    def fill(self) -> None:
        """One read (the fd is readable); sets closed at EOF."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            self.closed = True
        self.buffer += chunk
