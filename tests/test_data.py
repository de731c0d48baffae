"""Data files for task.path and train_dataset: JSONL, JSON, Parquet, CSV, datasets.Dataset and hub names,
each bad file or row one error naming the file and the row."""

from __future__ import annotations

import json

import pytest

from hasten.config import TaskConfig
from hasten.tasks.base import TaskError
from hasten.tasks.data import load_rows, rows_from
from hasten.tasks.jsonl import build_jsonl

ROWS = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "And 2+3?", "answer": "5"}]
CHAT = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "4"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}], "answer": "5"}]


def write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_every_format_gives_the_same_rows(tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    assert load_rows(str(write(tmp_path / f"data{suffix}", ROWS))) == ROWS
    assert load_rows(str(write(tmp_path / f"chat{suffix}", CHAT))) == CHAT


def test_csv_rows_are_strings(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text('prompt,answer\n"What is 2+2?",4\nhello,5\n')
    assert load_rows(str(path)) == [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "hello", "answer": "5"}]


def test_jsonl_task_reads_any_format(tmp_path):
    pytest.importorskip("pyarrow")
    path = write(tmp_path / "train.parquet", [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)])
    task = build_jsonl(TaskConfig(name="jsonl", path=str(path)))
    assert len(task.train_rows) == 9 and task.eval_rows == [{"prompt": "q9", "answer": "9"}]


@pytest.mark.parametrize("name, content, message", [
    ("data.parquet", b"prompt,answer\nx,1\n", r"data\.parquet is not a readable Parquet file \("),
    ("data.csv", b"question,answer\nx,1\n", r"data\.csv row 1: missing 'prompt' \(columns: question, answer\)"),
    ("data.csv", b"prompt,answer\nok,1\nx,1,2\n", r"data\.csv line 3: 3 values for 2 header columns"),
    ("data.json", b'{"prompt": "x"}\n{"prompt": "y"}\n', r"data\.json line 2: invalid JSON .*\.jsonl suffix"),
    ("data.json", b'[{"prompt": "x"}, {"prompt": ""}]', r"data\.json row 2: 'prompt' is empty"),
    ("data.jsonl", b'\xff\xfe{"prompt": 1}', r"data\.jsonl line 1: not UTF-8 text"),
    ("data.txt", b"hello", r"unsupported file type '\.txt'"),
])
def test_a_bad_file_is_one_error_naming_file_and_row(tmp_path, name, content, message):
    if name.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TaskError, match=message) as error:
        load_rows(str(path))
    assert "\n" not in str(error.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TaskError, match="is a directory"):
        load_rows(str(tmp_path))


def test_hub_dataset_unreachable_is_one_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the libraries read those variables once, at import (an earlier test imported them): offline now, at once,
    # instead of trying the network until it times out
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(TaskError, match=r"cannot load hub dataset 'someone/some-data' split 'test' \(") as error:
        load_rows("someone/some-data:test")
    assert "\n" not in str(error.value)


def test_hub_dataset_without_datasets_installed(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(TaskError, match=r"needs the datasets package \(pip install 'hasten\[data\]'\)"):
        load_rows("someone/some-data")


def test_in_memory_datasets():
    datasets = pytest.importorskip("datasets")
    assert rows_from(datasets.Dataset.from_list(ROWS)) == ROWS
    assert rows_from(list(ROWS)) == ROWS
    with pytest.raises(TaskError, match="train_dataset row 1: expected an object"):
        rows_from(["just text"])
    with pytest.raises(TaskError, match="must be a list of dicts, a datasets.Dataset"):
        rows_from(42)
