"""Reward loading and scoring (TRL calling convention) and the built-in rewards."""

from __future__ import annotations

import asyncio
import math

import numpy
import pytest
import torch

from hasten.rewards import (
    RewardError,
    RewardFunction,
    completion_text,
    correctness_reward,
    extract_answer,
    format_reward,
    load_reward,
    parse_number,
    score_rewards,
)


def batch(count: int = 4) -> dict:
    """Two prompts x two samples each, group-major, with per-sample columns."""
    return {
        "prompts": [f"prompt {i // 2}" for i in range(count)],
        "completions": [f"completion {i}" for i in range(count)],
        "columns": {
            "answer": [float(i // 2) for i in range(count)],
            "question": [f"q{i // 2}" for i in range(count)],
        },
        "completion_ids": [[i, i + 1] for i in range(count)],
    }


def constant(value):
    def reward(prompts, completions, **kwargs):
        return [value] * len(completions)

    return reward


# ------------------------------------------------------------------- scoring


def test_signature_and_columns_reach_the_function_per_sample():
    seen = {}

    def reward(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return [0.0] * len(completions)

    data = batch()
    score_rewards([RewardFunction("spy", reward)], **data)
    assert seen["prompts"] == data["prompts"]
    assert seen["completions"] == data["completions"]
    assert seen["answer"] == [0.0, 0.0, 1.0, 1.0]
    assert seen["question"] == ["q0", "q0", "q1", "q1"]
    assert seen["completion_ids"] == data["completion_ids"]


def test_none_is_nan_and_totals_use_nansum():
    def sparse(prompts, completions, **kwargs):
        return [1.0, None, None, 0.5]

    def never(prompts, completions, **kwargs):
        return [None] * len(completions)

    scores = score_rewards([RewardFunction("sparse", sparse), RewardFunction("never", never)], **batch())
    assert scores.per_function.shape == (4, 2)
    assert scores.per_function.dtype == torch.float32
    assert torch.isnan(scores.per_function[1, 0])
    # A sample no function scored gets 0, as in TRL.
    assert scores.total.tolist() == [1.0, 0.0, 0.0, 0.5]
    means = scores.means()
    assert means["sparse"] == pytest.approx(0.75)
    assert math.isnan(means["never"])
    assert scores.names == ["sparse", "never"]


def test_weights_scale_each_function():
    functions = [
        RewardFunction("a", constant(1.0), weight=0.25),
        RewardFunction("b", constant(2), weight=-1.0),
    ]
    scores = score_rewards(functions, **batch())
    assert scores.total.tolist() == [-1.75] * 4
    assert scores.means() == {"a": 1.0, "b": 2.0}


def test_async_function_and_mix_with_sync():
    async def slow(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [float(len(c)) for c in completions]

    class AsyncCallable:
        async def __call__(self, prompts, completions, **kwargs):
            return [1.0] * len(completions)

    functions = [
        RewardFunction("slow", slow),
        RewardFunction("sync", constant(True)),
        RewardFunction("callable", AsyncCallable()),
    ]
    assert [f.is_async for f in functions] == [True, False, True]
    scores = score_rewards(functions, **batch())
    assert scores.per_function[:, 0].tolist() == [12.0] * 4
    assert scores.per_function[:, 1].tolist() == [1.0] * 4
    assert scores.total.tolist() == [14.0] * 4


def test_async_rewards_work_inside_a_running_event_loop():
    async def reward(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    async def notebook_cell():
        return score_rewards([RewardFunction("async", reward)], **batch())

    assert asyncio.run(notebook_cell()).total.tolist() == [1.0] * 4


@pytest.mark.parametrize("is_async", [False, True])
def test_a_function_without_kwargs_is_reported_not_crashed(is_async):
    def sync_reward(prompts, completions):
        return [0.0] * len(completions)

    async def async_reward(prompts, completions):
        return [0.0] * len(completions)

    function = RewardFunction("strict", async_reward if is_async else sync_reward)
    message = r"'strict' failed on sample 0 \(prompt \"prompt 0\"\): TypeError: .*unexpected keyword argument"
    with pytest.raises(RewardError, match=message):
        score_rewards([function], **batch())


def test_numpy_and_tensor_scalars_are_accepted():
    def reward(prompts, completions, **kwargs):
        return [numpy.float32(0.5), numpy.bool_(True), torch.tensor(2.0), 3]

    assert score_rewards([RewardFunction("mixed", reward)], **batch()).total.tolist() == [0.5, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("is_async", [False, True])
def test_raising_function_names_the_failing_sample(is_async):
    def check(completions):
        for completion in completions:
            if completion == "completion 2":
                raise KeyError("boom")
        return [0.0] * len(completions)

    def sync_reward(prompts, completions, **kwargs):
        return check(completions)

    async def async_reward(prompts, completions, **kwargs):
        return check(completions)

    function = RewardFunction("picky", async_reward if is_async else sync_reward)
    with pytest.raises(RewardError) as error:
        score_rewards([RewardFunction("fine", constant(1.0)), function], **batch())
    assert str(error.value) == "reward error: function 'picky' failed on sample 2 (prompt \"prompt 1\"): KeyError: 'boom'"


def test_failure_only_on_the_whole_batch():
    def needs_pairs(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise ValueError("batch broke\nsecond line")
        return [0.0]

    # No sample fails alone: the shortest failing prefix is named, ending at the sample whose addition breaks it.
    message = (r"^reward error: function 'pairs' failed on samples 0 to 1 together, though each passes alone "
               r"\(sample 1: prompt \"prompt 0\"\): ValueError: batch broke$")
    with pytest.raises(RewardError, match=message):
        score_rewards([RewardFunction("pairs", needs_pairs)], **batch())


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0, 2.0], r"function 'short' returned 2 values \(expected a list of 4 floats or None\)"),
        (0.5, r"function 'short' returned float \(expected a list of 4 floats or None\)"),
        ([1.0, "2", 3.0, 4.0], r"function 'short' returned str at sample 1 \(expected"),
        ([1.0, 2.0, math.inf, 4.0], r"function 'short' returned inf at sample 2"),
        ([1.0, 2.0, 3.0, math.nan], r"function 'short' returned nan at sample 3"),
    ],
)
def test_bad_return_values(returned, message):
    with pytest.raises(RewardError, match=message):
        score_rewards([RewardFunction("short", lambda prompts, completions, **kwargs: returned)], **batch())


def test_column_lengths_and_reserved_names_are_checked():
    data = batch()
    data["columns"]["answer"] = [1.0]
    with pytest.raises(RewardError, match="column 'answer' has 1 values for 4 samples"):
        score_rewards([RewardFunction("a", constant(1.0))], **data)
    data = batch()
    data["columns"]["completions"] = ["x"] * 4
    with pytest.raises(RewardError, match="may not be named 'completions'"):
        score_rewards([RewardFunction("a", constant(1.0))], **data)


# ------------------------------------------------------------------- loading


def test_load_reward_from_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    function = load_reward(f"{path}:length")
    assert function.name == "length" and function.weight == 1.0
    assert score_rewards([function], **batch()).total.tolist() == [12.0] * 4


def test_load_reward_files_with_the_same_name_do_not_collide(tmp_path):
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        source = f"def r(prompts, completions, **kw):\n    return [{value}] * len(completions)\n"
        (tmp_path / folder / "reward.py").write_text(source)
    first = load_reward(f"{tmp_path / 'a' / 'reward.py'}:r")
    second = load_reward(f"{tmp_path / 'b' / 'reward.py'}:r")
    assert first.fn([], ["x"]) == [1.0] and second.fn([], ["x"]) == [2.0]


def test_load_reward_errors(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text("LIMIT = 3\n\ndef ok(prompts, completions, **kwargs):\n    return []\n")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")
    cases = {
        "just_a_name": "reward error: spec 'just_a_name' must look like path/to/file.py:function "
                       "or package.module:function",
        "no_such_module_xyz:fn": "reward error: cannot import module 'no_such_module_xyz': "
                                 "ModuleNotFoundError: No module named 'no_such_module_xyz'",
        "hasten.rewards.builtin:nope": "reward error: module 'hasten.rewards.builtin' has no function 'nope'",
        f"{tmp_path}/missing.py:ok": f"reward error: '{tmp_path}/missing.py' does not exist",
        f"{path}:nope": f"reward error: {path} has no function 'nope'",
        f"{path}:LIMIT": f"reward error: {path}:LIMIT is not callable",
        f"{broken}:ok": (
            f"reward error: importing {broken} failed: "
            "ModuleNotFoundError: No module named 'not_a_real_module_xyz'"
        ),
    }
    for spec, message in cases.items():
        with pytest.raises(RewardError) as error:
            load_reward(spec)
        assert str(error.value) == message


# ------------------------------------------------------------------- builtins


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>42</answer>", "42"),
        ("<answer> 1 </answer> then <answer>\n2 \n</answer>", "2"),
        ("no tags", None),
        ("<answer>unclosed", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("42", 42.0),
        ("-3.5", -3.5),
        ("1,000", 1000.0),
        ("1,234,567.5", 1234567.5),
        ("2000 g", 2000.0),
        ("2.5 km/h", 2.5),
        ("4 m^2", 4.0),
        ("= 12", 12.0),
        ("6 kg = 6000 g", 6000.0),
        ("$3.50", 3.5),
        ("1.5e3", 1500.0),
        ("2E-2 m", 0.02),
        (".5", 0.5),
        ("", None),
        (None, None),
        ("about", None),
        ("5 ft 3 in", None),
        ("1,5", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


def test_completion_text_handles_both_forms():
    assert completion_text("plain") == "plain"
    assert completion_text([{"role": "assistant", "content": "chat"}]) == "chat"


def test_format_reward_scale():
    completions = [
        "1 kg = 1000 g.\n<answer>2000</answer>",  # well formed
        "<answer>2,000 g</answer>.",  # units and trailing punctuation are fine
        "<answer>2000</answer> Hope that helps!",  # text after the answer
        "<answer>1</answer><answer>2</answer>",  # two answers
        "<answer>two thousand</answer>",  # not a number
        "2000",  # no tags
        "<answer>2000",  # unclosed
    ]
    assert format_reward([None] * 7, completions) == [1.0, 1.0, 0.5, 0.5, 0.5, 0.0, 0.0]
    conversational = [[{"role": "assistant", "content": "<answer>7</answer>"}]]
    assert format_reward([[{"role": "user", "content": "?"}]], conversational) == [1.0]


def test_correctness_reward():
    completions = [
        "<answer>6000</answer>",
        "<answer>6200 g</answer>",
        "<answer>6400</answer>",
        "none",
        "<answer>0</answer>",
    ]
    answers = [6000.0, 6000.0, 6000.0, 6000.0, 0.0]
    # 5% default: 6200 is within 300 of 6000, 6400 is not.
    assert correctness_reward([None] * 5, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]
    # A per-row tolerance column overrides it: 0 means exact.
    exact = correctness_reward([None] * 2, completions[:2], answer=answers[:2], tolerance=[0.0, 0.0])
    assert exact == [1.0, 0.0]
    # Rows without a usable answer are not applicable.
    assert correctness_reward([None] * 2, completions[:2], answer=[None, "n/a"]) == [None, None]


def test_builtins_run_through_score_rewards():
    data = batch()
    data["completions"] = ["<answer>0</answer>", "<answer>5</answer>", "<answer>1</answer>", "1"]
    functions = [RewardFunction("format", format_reward, 0.25), RewardFunction("correct", correctness_reward)]
    scores = score_rewards(functions, **data)
    # Format 0.25 x (1, 1, 1, 0) plus correct (1, 0, 1, 0): an untagged "1" earns nothing.
    assert scores.total.tolist() == [1.25, 0.25, 1.25, 0.0]


def test_a_failing_sample_is_named_with_its_prompts_start():
    """A chat prompt is named by its last message; a long one is cut at 40 characters."""
    question = "How many grams are there in 6 kilograms of flour, exactly?"
    data = batch(2)
    data["prompts"] = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]] * 2

    def fails_second(prompts, completions, **kwargs):
        if len(completions) == 1 and completions[0] == "completion 1":
            raise ValueError("no")
        if len(completions) > 1:
            raise ValueError("batch")
        return [0.0]

    with pytest.raises(RewardError) as error:
        score_rewards([RewardFunction("second", fails_second)], **data)
    assert str(error.value) == ("reward error: function 'second' failed on sample 1 "
                                f"(prompt \"{question[:40]}...\"): ValueError: no")
