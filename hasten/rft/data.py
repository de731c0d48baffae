"""RFT records on disk: `[question, answer, reasoning]` triples in one JSON list.

This is the homework's format, so a file written elsewhere (say by a larger
teacher model) trains here unchanged:

    [
      ["How many grams are there in 6 kg?", 6000.0,
       "1 kg = 1000 g, so 6 kg = 6 * 1000 = 6000 g.\n<answer>6000</answer>"],
      ...
    ]

`reasoning` is the assistant's whole reply and ends with `<answer>...</answer>`;
`answer` is the reference answer (a number or a string) kept for reading and
for re-checking. Loading checks every record and stops at the first bad one
with a one-line `rft data error` that names the file and the record number
(1-based), so a hand-edited file fails before any model is loaded.
Writing goes to a temporary sibling and is renamed into place: an interrupted
datagen leaves the previous file or none, never half a file.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

# The reasoning must finish with a closed answer tag (whitespace after it is allowed).
_ENDS_WITH_ANSWER = re.compile(r"<answer>.*?</answer>\s*\Z", re.DOTALL)


class RFTDataError(UserError):
    """A missing or malformed RFT data file; str() is one line naming the record."""


@dataclass(frozen=True)
class RFTRecord:
    question: str
    answer: float | str
    reasoning: str  # the assistant's reply, ending with <answer>...</answer>

    def to_json(self) -> list:
        return [self.question, self.answer, self.reasoning]


def trim_to_answer(text: str) -> str | None:
    """The completion up to and including its last </answer>; None if it has no closed answer tag."""
    end = text.rfind("</answer>")
    if end < 0 or text.rfind("<answer>", 0, end) < 0:
        return None
    return text[: end + len("</answer>")].strip()


def _record(path: Path, number: int, item) -> RFTRecord:
    where = f"rft data error: {path} record {number}"
    if not isinstance(item, (list, tuple)) or len(item) != 3:
        raise RFTDataError(f"{where}: expected [question, answer, reasoning] (got {json.dumps(item)[:80]})")
    question, answer, reasoning = item
    if not isinstance(question, str) or not question.strip():
        raise RFTDataError(f"{where}: question must be a non-empty string (got {question!r:.80})")
    if isinstance(answer, bool) or not isinstance(answer, (int, float, str)):
        raise RFTDataError(f"{where}: answer must be a number or a string (got {answer!r:.80})")
    if not isinstance(reasoning, str) or not _ENDS_WITH_ANSWER.search(reasoning):
        raise RFTDataError(f"{where}: reasoning must be a string ending with <answer>...</answer>")
    return RFTRecord(question, float(answer) if isinstance(answer, int) else answer, reasoning)


def load_records(path: str | Path) -> list[RFTRecord]:
    """Every record of an RFT JSON file, checked; RFTDataError on the first problem."""
    path = Path(path)
    if path.is_dir():
        raise RFTDataError(f"rft data error: {path} is a directory, not an RFT JSON file")
    if not path.is_file():
        raise RFTDataError(f"rft data error: {path} does not exist (write it with `hasten rft datagen`)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise RFTDataError(f"rft data error: {path} is not valid JSON (line {exc.lineno} column {exc.colno}: "
                           f"{exc.msg})") from None
    except UnicodeDecodeError:
        raise RFTDataError(f"rft data error: {path} is not UTF-8 text") from None
    if not isinstance(data, list):
        raise RFTDataError(f"rft data error: {path} must hold a JSON list of [question, answer, reasoning]")
    if not data:
        raise RFTDataError(f"rft data error: {path} holds no records")
    return [_record(path, number, item) for number, item in enumerate(data, start=1)]


def write_records(path: str | Path, records: list[RFTRecord]) -> Path:
    """Write the records as one JSON list (one record per line), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join("  " + json.dumps(record.to_json(), ensure_ascii=False) for record in records)
    text = f"[\n{lines}\n]\n" if records else "[]\n"
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
