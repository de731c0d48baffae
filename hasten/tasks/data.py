"""Training rows from wherever a user keeps them: JSONL, JSON, Parquet, CSV, a hub dataset, or memory.

`load_rows(source)` reads task.path / task.eval_path (and a string
`train_dataset` in the Python API):
  *.jsonl     one JSON object per line
  *.json      an array of objects
  *.parquet   through pyarrow (the `data` extra)
  *.csv       a header row, then one row per line (every value is a string)
  name[:split]  anything else: a hub dataset through `datasets.load_dataset(name, split=split or "train")`
`rows_from(dataset)` takes what the Python API is handed: a list of dicts,
a `datasets.Dataset`, a pandas DataFrame, or one of the sources above.

Every row must have a "prompt" (a non-empty string, or a list of
{"role", "content"} messages); the other columns reach reward functions
as keyword arguments, as in TRL. A bad file or row is one TaskError naming
the file and the line or row (JSONL: its line; JSON, Parquet, CSV: the row,
1-based, a CSV's header not counted; parse errors: the line), never a
decoding error from inside a parser.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hasten.rewards.runner import RESERVED_COLUMNS
from hasten.tasks import DATA_FORMATS, check_data_path
from hasten.tasks.base import TaskError, json_objects, json_type

FORMATS = DATA_FORMATS


def load_rows(source: str) -> list[dict[str, Any]]:
    """Validated rows of a file (by its suffix) or a hub dataset; TaskError otherwise."""
    if check_data_path(source):  # a file (checked without reading it, as the CLI does first), else a hub name
        path = Path(source).expanduser()
        rows, unit, numbers = READERS[path.suffix.lower()](path)
        return validate_rows(rows, str(source), unit, numbers)
    return validate_rows(_hub_rows(source), f"hub dataset {source}", "row")


def rows_from(dataset: Any, label: str = "train_dataset") -> list[dict[str, Any]]:
    """Rows from a list of dicts, a datasets.Dataset, a pandas DataFrame, or a path / hub name."""
    if isinstance(dataset, (str, Path)):
        return load_rows(str(dataset))
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):  # datasets.Dataset
        rows = dataset.to_list()
    elif hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # pandas.DataFrame
        rows = dataset.to_dict("records")
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
    else:
        raise TaskError(f"data error: {label} must be a list of dicts, a datasets.Dataset, a pandas DataFrame or "
                        f"a file path (got {type(dataset).__name__}; an IterableDataset must be materialized)")
    return validate_rows(rows, label, "row")


def validate_rows(rows: list, label: str, unit: str, numbers: list[int] | None = None) -> list[dict[str, Any]]:
    """Each row checked: an object with a usable "prompt" and no reserved column.

    numbers: each row's line in its file (JSONL skips blank lines); default 1, 2, ...
    """
    if not rows:
        raise TaskError(f"data error: {label} has no rows")
    for number, row in zip(numbers or range(1, len(rows) + 1), rows):
        where = f"data error: {label} {unit} {number}"
        if not isinstance(row, dict):
            raise TaskError(f"{where}: expected an object with a 'prompt', got {json_type(row)}")
        problem = prompt_problem(row)
        if problem:
            raise TaskError(f"{where}: {problem}")
        for name in RESERVED_COLUMNS:
            if name in row:
                raise TaskError(f"{where}: column '{name}' is reserved (reward functions receive it)")
    return [dict(row) for row in rows]


def prompt_problem(row: dict[str, Any]) -> str | None:
    """Why the row's prompt is unusable, or None."""
    if "prompt" not in row:
        return f"missing 'prompt' (columns: {', '.join(map(str, row)) or 'none'})"
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return None if prompt.strip() else "'prompt' is empty"
    if not isinstance(prompt, list):
        return f"'prompt' must be a string or a list of messages (got {json_type(prompt)})"
    if not prompt:
        return "'prompt' is an empty list of messages"
    for index, message in enumerate(prompt):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return f"'prompt' message {index} must be an object with string 'role' and 'content'"
    return None


# ------------------------------------------------------- readers: (rows, "line" | "row", numbers or None)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        line = path.read_bytes()[:error.start].count(b"\n") + 1
        raise TaskError(f"data error: {path} line {line}: not UTF-8 text (is it a {path.suffix} file?)") from None
    except OSError as error:
        raise TaskError(f"data error: cannot read {path}: {error.strerror or error}") from None


def _jsonl(path: Path) -> tuple[list, str, list[int]]:
    numbered = json_objects(_text(path), str(path))
    return [row for _, row in numbered], "line", [number for number, _ in numbered]


def _json(path: Path) -> tuple[list, str, None]:
    try:
        data = json.loads(_text(path))
    except json.JSONDecodeError as error:
        raise TaskError(f"data error: {path} line {error.lineno}: invalid JSON ({error.msg} at column "
                        f"{error.colno}; a JSON Lines file wants the .jsonl suffix)") from None
    if not isinstance(data, list):
        raise TaskError(f"data error: {path} must hold an array of objects (got {json_type(data)})")
    return data, "row", None


def _parquet(path: Path) -> tuple[list, str, None]:
    try:
        import pyarrow.parquet
    except ImportError:
        raise TaskError(f"data error: reading {path} needs pyarrow (pip install 'hasten[data]')") from None
    try:
        return pyarrow.parquet.read_table(path).to_pylist(), "row", None
    except Exception as error:  # pyarrow's ArrowInvalid and friends: the file is not Parquet
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise TaskError(f"data error: {path} is not a readable Parquet file ({type(error).__name__}: "
                        f"{first[:160]})") from None


def _csv(path: Path) -> tuple[list, str, None]:
    import csv
    import io

    reader = csv.DictReader(io.StringIO(_text(path), newline=""))
    rows = []
    try:
        for row in reader:
            if None in row:  # more values than header columns
                raise TaskError(f"data error: {path} line {reader.line_num}: {len(row) - 1 + len(row[None])} "
                                f"values for {len(reader.fieldnames)} header columns")
            rows.append(row)
    except csv.Error as error:
        raise TaskError(f"data error: {path} line {reader.line_num}: {error}") from None
    return rows, "row", None  # row 1 is the first one after the header


READERS = {".jsonl": _jsonl, ".json": _json, ".parquet": _parquet, ".csv": _csv}


def _hub_rows(source: str) -> list:
    name, _, split = source.partition(":")
    try:
        import datasets
    except ImportError:
        raise TaskError(f"data error: '{source}' is not a file, and loading a hub dataset needs the datasets "
                        "package (pip install 'hasten[data]')") from None
    try:
        return datasets.load_dataset(name, split=split or "train").to_list()
    except Exception as error:  # offline, unknown name, bad split: datasets raises many kinds
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise TaskError(f"data error: cannot load hub dataset '{name}' split '{split or 'train'}' "
                        f"({type(error).__name__}: {first[:160]})") from None
