"""What a tool call gives the model: CallResult, its text bounded by the turn's limit, errors as one line.

Shared by both isolations (agent/tools.py runs threads, agent/isolation.py
children): a result becomes text where the tool ran, and text longer than
result_limit is refused there, before a copy of it reaches the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..userfiles import one_line

CHARS_PER_TOKEN = 16  # a result longer than this many characters per token of the length cap cannot fit in it
MIN_RESULT_CHARS = 16384


@dataclass
class CallResult:
    name: str
    content: str  # what the tool turn shows the model
    failed: bool


def result_limit(max_new_tokens: int) -> int:
    """Characters a tool result may have: more could never fit in a completion of max_new_tokens tokens."""
    return max(MIN_RESULT_CHARS, CHARS_PER_TOKEN * max_new_tokens)


class ResultTooLarge(Exception):
    """A tool's result text passed result_limit; raised before the whole text is built."""


def to_text(value: Any, limit: int) -> str:
    """What the tool turn shows: a str as is, anything else as JSON (str() for the rest), at most `limit` chars.

    JSON is built piece by piece and abandoned once past the limit, so a huge list is never one huge string."""
    if isinstance(value, str):
        if len(value) > limit:
            raise ResultTooLarge(f"returned {len(value)} characters, more than the {limit} a tool turn may hold")
        return value
    pieces, size = [], 0
    for piece in json.JSONEncoder(default=str).iterencode(value):
        size += len(piece)
        if size > limit:
            raise ResultTooLarge(f"returned more than the {limit} characters a tool turn may hold")
        pieces.append(piece)
    return "".join(pieces)


def failure_text(name: str, error: BaseException) -> str:
    """What the model reads for a call that raised: 'error: ExcType: first line', even when the
    exception's own __str__ raises; a result over the limit says so in words."""
    if isinstance(error, ResultTooLarge):
        return f"error: {name} {error}"
    try:
        return f"error: {one_line(error)}"
    except Exception:
        return f"error: {type(error).__name__}"


def timed_out(name: str, timeout: float) -> str:
    return f"error: {name} timed out after {timeout:g} s"
