"""Built-in tasks, the JSON Lines loader and the task registry (no model needed)."""

from __future__ import annotations

import json
import random
import re

import pytest

from hasten.tasks import arithmetic

from hasten.config import TaskConfig
from hasten.tasks import TaskError, Verdict, list_tasks, make_task
from hasten.tasks.base import Task
from hasten.tasks.unit_conversion import WORKED_EXAMPLE, sample_question

SMALL = dict(num_train=200, num_eval=32)


def questions(rows):
    return [row["question"] for row in rows]


# ------------------------------------------------------------------- generated


@pytest.mark.parametrize("name", ["arithmetic", "unit-conversion"])
def test_generated_tasks_are_deterministic_by_seed(name):
    first = make_task(TaskConfig(name=name, seed=7, **SMALL))
    again = make_task(TaskConfig(name=name, seed=7, **SMALL))
    other = make_task(TaskConfig(name=name, seed=8, **SMALL))
    assert first.train_rows == again.train_rows and first.eval_rows == again.eval_rows
    assert questions(first.train_rows) != questions(other.train_rows)
    assert len(first.train_rows) == 200 and len(first.eval_rows) == 32


@pytest.mark.parametrize("name", ["arithmetic", "unit-conversion"])
def test_train_and_eval_are_disjoint(name):
    task = make_task(TaskConfig(name=name, **SMALL))
    assert not set(questions(task.train_rows)) & set(questions(task.eval_rows))
    assert len(set(questions(task.eval_rows))) == len(task.eval_rows)


def test_eval_set_does_not_depend_on_num_train():
    small = make_task(TaskConfig(name="unit-conversion", num_train=10, num_eval=16))
    large = make_task(TaskConfig(name="unit-conversion", num_train=300, num_eval=16))
    assert small.eval_rows == large.eval_rows


def test_arithmetic_rows():
    task = make_task(TaskConfig(name="arithmetic", **SMALL))
    for row in task.train_rows + task.eval_rows:
        pattern = r"What is (\d+) \+ (\d+)\? Put the final number inside <answer></answer>\."
        match = re.fullmatch(pattern, row["question"])
        assert match, row["question"]
        a, b = int(match.group(1)), int(match.group(2))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert row["answer"] == float(a + b)
        # No system prompt by default: one worked example, then the question.
        example_question, example_answer = arithmetic.WORKED_EXAMPLE
        assert row["prompt"] == [
            {"role": "user", "content": example_question},
            {"role": "assistant", "content": example_answer},
            {"role": "user", "content": row["question"]},
        ]
        assert row["question"] != example_question
    bare = make_task(TaskConfig(name="arithmetic", worked_example=False, num_train=2, num_eval=1))
    assert bare.train_rows[0]["prompt"] == [{"role": "user", "content": bare.train_rows[0]["question"]}]
    assert [(f.name, f.weight) for f in task.reward_functions] == [("format", 0.25), ("correct", 1.0)]
    with_system = make_task(TaskConfig(name="arithmetic", system_prompt="Be brief.", num_train=2, num_eval=1))
    assert with_system.train_rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}


def test_arithmetic_check_is_exact():
    row = {"answer": 150.0, "tolerance": 0.0}
    task = make_task(TaskConfig(name="arithmetic", num_train=2, num_eval=1))
    assert task.check("<answer>150</answer>", row) == Verdict(parsed=True, correct=True)
    assert task.check("<answer>149</answer>", row) == Verdict(parsed=True, correct=False)
    assert task.check("150", row) == Verdict(parsed=False, correct=False)


@pytest.mark.parametrize(
    "question, answer",
    [
        ("How many grams are there in 6 kg?", 6000.0),
        ("Convert 3 miles to kilometers.", 4.828032),
        ("What is 2 hours in minutes?", 120.0),
        ("Can you change 5 ft to its equivalent in inches?", 60.0),
        ("What is 3000 g in kilograms?", 3.0),
        ("Convert 2.5 gallons to quarts.", 10.0),
        ("What is 10 m/s in kilometers per hour?", 36.0),
        ("How many bits are there in 4 bytes?", 32.0),
    ],
)
def test_unit_conversion_answers(question, answer):
    # Draw until the generator produces this question, then compare its answer.
    rng = random.Random(0)
    for _ in range(200_000):
        generated, value = sample_question(rng)
        if generated == question:
            assert value == pytest.approx(answer, rel=1e-12)
            return
    pytest.fail(f"generator never produced {question!r}")


def test_unit_conversion_prompt_structure():
    task = make_task(TaskConfig(name="unit-conversion", **SMALL))
    for row in task.train_rows[:20] + task.eval_rows:
        prompt = row["prompt"]
        assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user"]
        assert "<answer></answer>" in prompt[0]["content"]
        assert (prompt[1]["content"], prompt[2]["content"]) == WORKED_EXAMPLE
        assert prompt[-1]["content"] == row["question"]
        assert isinstance(row["answer"], float)
    # The worked example is never asked as a held-out question.
    assert WORKED_EXAMPLE[0] not in questions(task.eval_rows)
    custom = make_task(TaskConfig(name="unit-conversion", system_prompt="Custom.", num_train=2, num_eval=1))
    assert custom.train_rows[0]["prompt"][0]["content"] == "Custom."


def test_unit_conversion_check_tolerance():
    task = make_task(TaskConfig(name="unit-conversion", num_train=2, num_eval=1))
    row = {"answer": 6000.0, "tolerance": 0.05}
    assert task.check("<answer>6,200 g</answer>", row) == Verdict(parsed=True, correct=True)
    assert task.check("<answer>600</answer>", row) == Verdict(parsed=True, correct=False)
    assert task.check("<answer>lots</answer>", row) == Verdict(parsed=False, correct=False)


def test_columns_fill_missing_with_none():
    rows = [{"prompt": "a", "answer": 1.0}, {"prompt": "b", "extra": "x"}]
    assert Task.columns(rows) == {"answer": [1.0, None], "extra": [None, "x"]}


# ------------------------------------------------------------------- jsonl


def write_jsonl(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_jsonl_loads_and_holds_out_the_last_tenth(tmp_path):
    rows = [{"prompt": f"question {i}", "answer": str(i)} for i in range(20)]
    path = write_jsonl(tmp_path / "data.jsonl", rows[:10] + [""] + rows[10:])  # blank lines are skipped
    task = make_task(TaskConfig(name="jsonl", path=path))
    assert task.train_rows == rows[:18] and task.eval_rows == rows[18:]
    assert task.reward_functions == []
    assert Task.columns(task.eval_rows) == {"answer": ["18", "19"]}


def test_jsonl_small_file_holds_out_one_and_eval_path_is_used(tmp_path):
    chat = [{"role": "system", "content": "Be nice."}, {"role": "user", "content": "Hi"}]
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a"}, {"prompt": chat, "topic": "greeting"}])
    task = make_task(TaskConfig(name="jsonl", path=path))
    assert len(task.train_rows) == 1 and task.eval_rows[0]["prompt"] == chat
    eval_path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "held out"}])
    task = make_task(TaskConfig(name="jsonl", path=path, eval_path=eval_path))
    assert len(task.train_rows) == 2 and task.eval_rows == [{"prompt": "held out"}]


def test_jsonl_check_uses_the_answer_column(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    check = make_task(TaskConfig(name="jsonl", path=path)).check
    assert check("<answer>42</answer>", {"prompt": "p"}) is None
    assert check("<answer>41</answer>", {"answer": 42}) == Verdict(parsed=True, correct=True)
    assert check("<answer>30</answer>", {"answer": "42"}) == Verdict(parsed=True, correct=False)
    assert check("<answer> Paris </answer>", {"answer": "Paris"}) == Verdict(parsed=True, correct=True)
    assert check("<answer>paris</answer>", {"answer": "Paris"}) == Verdict(parsed=True, correct=False)
    assert check("Paris", {"answer": "Paris"}) == Verdict(parsed=False, correct=False)


@pytest.mark.parametrize(
    "lines, message",
    [
        ([{"prompt": "ok"}, "{not json"], r"data\.jsonl line 2: invalid JSON \(Expecting property name"),
        ([{"prompt": "ok"}, {"prompt": "ok"}, [1, 2]], r"line 3: expected a JSON object, got array$"),
        ([{"prompt": "ok"}, {"question": "x"}], r"data\.jsonl line 2: missing 'prompt' \(columns: question\)$"),
        ([{"prompt": "  "}], r"data\.jsonl line 1: 'prompt' is empty$"),
        ([{"prompt": 5}], r"line 1: 'prompt' must be a string or a list of messages \(got number\)"),
        ([{"prompt": []}], r"line 1: 'prompt' is an empty list of messages"),
        ([{"prompt": [{"role": "user"}]}], r"line 1: 'prompt' message 0 must be an object with string"),
        ([{"prompt": "ok", "completions": "x"}], r"line 1: column 'completions' is reserved"),
        (["", "  "], r"data\.jsonl has no rows$"),
        ([{"prompt": "only one"}], r"data\.jsonl has 1 row; holding one out"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    with pytest.raises(TaskError, match=message) as error:
        make_task(TaskConfig(name="jsonl", path=path))
    assert str(error.value).startswith(f"data error: {path}")


def test_jsonl_missing_file(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(TaskError, match=f"^data error: '{re.escape(missing)}' does not exist$"):
        make_task(TaskConfig(name="jsonl", path=missing))
    with pytest.raises(TaskError, match="task.path is required"):
        make_task(TaskConfig(name="jsonl"))


# ------------------------------------------------------------------- registry


def test_registry():
    assert [name for name, _ in list_tasks()] == ["arithmetic", "unit-conversion", "jsonl", "chess-a", "chess-p",
                                                  "code", "calculator", "guess"]
    assert all(description for _, description in list_tasks())
    with pytest.raises(TaskError) as error:
        make_task(TaskConfig(name="x"))
    expected = ("config error: task.name must be one of arithmetic, unit-conversion, jsonl, chess-a, chess-p, "
                "code, calculator, guess, fruit-catcher (got 'x')")
    assert str(error.value) == expected
