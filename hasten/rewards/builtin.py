"""Reward functions for the built-in tasks, plus the answer parsing they share.

Both rewards use TRL's signature (`fn(prompts, completions, **kwargs)`) and
are deterministic. The answer convention is the last `<answer>...</answer>`
in the completion, holding a number that may carry thousands commas, a
leading "=" or "$", scientific notation and a trailing unit ("2,000 g").

Choices:
- `format_reward` gives partial credit (0.5 for any tag pair) so that a small
  model that has not yet learned the exact format still sees a difference
  between samples; GRPO learns nothing from a group that all scores 0.
- `correctness_reward` returns None, not 0, for a row without a usable
  "answer": such a sample is outside this reward's scope, and TRL's nansum
  then leaves its total to the other functions.
- Parsing is deliberately strict about extra numbers: "5 ft 3 in" or
  "3 or 4" is not a number, so hedging never earns credit.
"""

from __future__ import annotations

import math
import re
from typing import Any

DEFAULT_TOLERANCE = 0.05  # relative; a row's "tolerance" column overrides it
ZERO_TOLERANCE = 1e-6  # absolute, used when the true answer is 0

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number at the start of the text: thousands commas only in groups of three,
# so "1,5" (a decimal comma, or a list) is not silently read as 15.
_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?"  # 2,000  3.5  1.5e3
    r"|[-+]?\.\d+(?:[eE][-+]?\d+)?"  # .5
)
# A digit that starts a new number (not the "2" of "m2" or "m^2").
_STRAY_DIGIT = re.compile(r"(?<![A-Za-z^])\d")
_LEADING_SYMBOLS = "$≈~ \t\n"


def extract_answer(text: str) -> str | None:
    """Content of the last <answer>...</answer>, stripped; None if there is none."""
    matches = _ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def parse_number(text: str | None) -> float | None:
    """The number in an answer like "2,000 g", "= 42", "$3.50" or "1.5e3"; None if none.

    Only the part after the last "=" counts, so "6 kg = 6000 g" reads as 6000.
    What follows the number may be a unit, never another number.
    """
    if text is None:
        return None
    text = text.rpartition("=")[2].replace("\u2212", "-").lstrip(_LEADING_SYMBOLS)
    match = _NUMBER.match(text)
    if match is None:
        return None
    if _STRAY_DIGIT.search(text[match.end() :]):
        return None
    value = float(match.group().replace(",", ""))
    return value if math.isfinite(value) else None


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or TRL's [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return "".join(str(message.get("content", "")) for message in completion)


def within_tolerance(predicted: float, target: float, tolerance: float = DEFAULT_TOLERANCE) -> bool:
    """|predicted - target| <= tolerance * |target| (absolute 1e-6 when target is 0)."""
    if target == 0:
        return abs(predicted) <= ZERO_TOLERANCE
    return abs(predicted - target) <= tolerance * abs(target)


def answer_value(answer: Any) -> float | None:
    """A dataset "answer" cell as a float: numbers as they are, strings parsed."""
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return float(answer) if math.isfinite(answer) else None
    return parse_number(str(answer))


def format_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """Score the answer format, with partial credit.

    1.0  exactly one <answer>X</answer>, X parses as a number, and nothing but
         whitespace or punctuation follows the closing tag;
    0.5  at least one <answer>...</answer> pair, but not all of the above;
    0.0  no complete tag pair.
    """
    return [_format_score(completion_text(completion)) for completion in completions]


def _format_score(text: str) -> float:
    matches = list(_ANSWER.finditer(text))
    if not matches:
        return 0.0
    trailing = text[matches[-1].end() :]
    well_formed = (
        len(matches) == 1
        and parse_number(matches[0].group(1).strip()) is not None
        and not any(character.isalnum() for character in trailing)
    )
    return 1.0 if well_formed else 0.5


def correctness_reward(prompts: list, completions: list, answer: list, **kwargs: Any) -> list[float | None]:
    """1.0 if the last <answer> is within tolerance of the row's "answer", else 0.0.

    Tolerance is relative: the row's "tolerance" column when present, else 5%.
    Rows whose answer is missing or not a number get None (not applicable).
    """
    tolerances = kwargs.get("tolerance") or [None] * len(completions)
    scores: list[float | None] = []
    for completion, target_cell, tolerance in zip(completions, answer, tolerances):
        target = answer_value(target_cell)
        if target is None:
            scores.append(None)
            continue
        predicted = parse_number(extract_answer(completion_text(completion)))
        limit = DEFAULT_TOLERANCE if tolerance is None else float(tolerance)
        scores.append(1.0 if predicted is not None and within_tolerance(predicted, target, limit) else 0.0)
    return scores
