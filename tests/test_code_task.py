"""Task `code`: data sources, every reward on known-good and known-bad code, pass@k, and a tiny GRPO run."""

from __future__ import annotations

import json
import math

import pytest

from hasten.cli import main
from hasten.config import ConfigError, TaskConfig, load_config
from hasten.rewards import score_rewards
from hasten.rewards.code import (
    GATE_REWARD,
    complexity_reward,
    extract_code,
    lint_reward,
    mypy_available,
    syntax_reward,
    typecheck_reward,
)
from hasten.tasks import TaskError, make_task
from hasten.tasks.code import builtin_path, humaneval_rows, preamble_of
from hasten.tasks.code_eval import pass_at_k

GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
HALF = "```python\ndef add(a, b):\n    return 3 if a == 1 else a * b\n```"  # passes 2 of 4 tests below
RAISES = "```python\ndef add(a, b):\n    return a + b\nraise ValueError('at import')\n```"
BROKEN = "```python\ndef add(a, b)\n    return a + b\n```"
BLANK = "I cannot help with that."
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5", "assert add(-1, 1) == 0"]


@pytest.fixture(scope="module")
def task():
    return make_task(TaskConfig(name="code"), load_config(None, [("task.name", "code"), ("code.workers", 2)]))


def _score(task, texts: list[str], tests=TESTS, preamble=""):
    from hasten.sandbox import assert_program

    program = assert_program(tests).as_dict()
    count = len(texts)
    return score_rewards(task.reward_functions, [[{"role": "user", "content": "q"}]] * count,
                         [[{"role": "assistant", "content": text}] for text in texts],
                         {"tests": [program] * count, "preamble": [preamble] * count}, [[1]] * count)


def test_extract_code_prefers_python_fences_and_tolerates_truncation():
    assert extract_code("text\n```python\nx = 1\n```\nmore\n```\ny = 2\n```") == "x = 1"
    assert extract_code("```\ny = 2\n```") == "y = 2"
    assert extract_code("```js\nlet a\n```\n```py\nz = 3\n```") == "z = 3"
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off mid-block
    assert extract_code("x = 5") == "x = 5"  # bare code


def test_every_reward_on_known_good_and_known_bad_code(task):
    scores = _score(task, [GOOD, WRONG, HALF, RAISES, BROKEN, BLANK])
    by_name = {name: scores.per_function[:, index].tolist() for index, name in enumerate(scores.names)}
    assert by_name["tests"] == pytest.approx([1.0, 0.0, 0.5, 0.0, GATE_REWARD, GATE_REWARD])
    assert by_name["execution"] == pytest.approx([1.0, 1.0, 1.0, 0.0, GATE_REWARD, GATE_REWARD])
    assert by_name["syntax"] == pytest.approx([1.0, 1.0, 1.0, 1.0, GATE_REWARD, GATE_REWARD])
    assert by_name["lint"][0] == 1.0 and by_name["lint"][4:] == [GATE_REWARD, GATE_REWARD]
    assert by_name["complexity"][0] == 1.0 and by_name["complexity"][4] == GATE_REWARD
    total = scores.total.tolist()
    assert total[0] == pytest.approx(1.0)  # weights 0.5 + 0.2 + 0.15 + 0.1 + 0.05
    assert total[0] > total[2] > total[1] > total[3] > total[4] == total[5] == GATE_REWARD


def test_syntax_gate_never_reaches_the_sandbox(task):
    from hasten.tasks.code import sandbox_settings

    sandbox = sandbox_settings(load_config(None, [("code.workers", 2)]).code).sandbox()
    before = sandbox.stats.executions
    _score(task, [BROKEN, BLANK, "```python\n\n```"])
    assert sandbox.stats.executions == before


def test_execution_and_tests_share_one_run_per_completion(task):
    from hasten.tasks.code import sandbox_settings

    sandbox = sandbox_settings(load_config(None, [("code.workers", 2)]).code).sandbox()
    before_runs, before_hits = sandbox.stats.executions, sandbox.stats.cache_hits
    unique = "```python\ndef add(a, b):\n    return b + a  # shared run\n```"
    _score(task, [unique] * 4)  # tests and execution both ask; 4 identical samples
    assert sandbox.stats.executions - before_runs == 1
    assert sandbox.stats.cache_hits - before_hits == 7


def test_lint_falls_with_issue_count_and_ignores_the_preamble():
    clean = "```python\ndef f(x):\n    return x\n```"
    one = "```python\ndef f(x):\n    unused = 1\n    return x\n```"
    two = "```python\ndef f(x):\n    unused = 1\n    return undefined_name\n```"
    scores = lint_reward([], [clean, one, two], preamble=["import os\nimport sys\nx=1;y=2"] * 3)
    assert scores == pytest.approx([1.0, 0.5, 1 / 3])


def test_complexity_prefers_flat_code():
    flat = "```python\ndef f(x):\n    return x + 1\n```"
    nested = "```python\ndef f(x):\n" + "".join("    " * (i + 1) + f"if x > {i}:\n" for i in range(6)) + \
        "    " * 7 + "return x\n    return 0\n```"
    scores = complexity_reward([], [flat, nested])
    assert scores[0] == 1.0 and scores[1] < 0.5


def test_syntax_reward_needs_code_that_parses_with_the_preamble():
    assert syntax_reward([], ["x = List[int]", "def f(:", ""], preamble=["from typing import List"] * 3) == \
        [1.0, GATE_REWARD, GATE_REWARD]


@pytest.mark.skipif(not mypy_available(), reason="mypy not installed")
def test_typecheck_reward_counts_type_errors():
    good = "```python\ndef f(x: int) -> int:\n    return x + 1\n```"
    bad = "```python\ndef f(x: int) -> str:\n    return x + 1\n```"
    assert typecheck_reward([], [good, bad, "def f(:"]) == pytest.approx([1.0, 0.5, GATE_REWARD])


def test_builtin_problems_split_and_their_solutions_pass(task):
    raw = [json.loads(line) for line in builtin_path().read_text().splitlines()]
    assert len(raw) >= 40 and len(task.train_rows) + len(task.eval_rows) == len(raw)
    assert len(task.eval_rows) >= 10
    assert not {r["question"] for r in task.train_rows} & {r["question"] for r in task.eval_rows}
    solutions = {r["task_id"]: f"```python\n{r['prompt']}{r['solution']}```" for r in raw}
    rows = task.train_rows + task.eval_rows
    stub = "```python\ndef nothing():\n    pass\n```"
    scores = _score_rows(task, [solutions[row["question"]] for row in rows] + [stub] * len(rows), rows * 2)
    tests = scores.per_function[:, scores.names.index("tests")].tolist()
    assert tests == [1.0] * len(rows) + [0.0] * len(rows)
    assert task.check(solutions[rows[0]["question"]], rows[0]).correct  # the checker agrees (cached run)
    assert not task.check(stub, rows[0]).correct


def _score_rows(task, texts: list[str], rows: list[dict]):
    columns = task.columns(rows)
    return score_rewards(task.reward_functions, [row["prompt"] for row in rows],
                         [[{"role": "assistant", "content": text}] for text in texts], columns, [[1]] * len(rows))


def test_humaneval_rows_keep_prompt_helpers_in_the_preamble():
    rows = {row["question"]: row for row in humaneval_rows(None)}
    assert len(rows) == 164
    assert rows["HumanEval/0"]["preamble"] == "from typing import List"
    assert "def is_palindrome" in rows["HumanEval/10"]["preamble"]  # helper the answer may call
    assert rows["HumanEval/0"]["tests"]["mode"] == "check"
    assert "```python\nfrom typing import List" in rows["HumanEval/0"]["prompt"][-1]["content"]


def test_preamble_drops_only_the_entry_point():
    prompt = "import math\n\ndef helper():\n    return 1\n\ndef target(x):\n    \"\"\"Doc.\"\"\"\n"
    assert preamble_of(prompt, "target") == "import math\ndef helper():\n    return 1"


def test_mbpp_and_hasten_jsonl_sources(tmp_path):
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text("\n".join(json.dumps({
        "task_id": i, "text": f"Write a function that adds {i}.", "code": f"def add_{i}(x):\n    return x + {i}",
        "test_list": [f"assert add_{i}(1) == {1 + i}", f"assert add_{i}(0) == {i}"]}) for i in range(10)))
    task = make_task(TaskConfig(name="code", path=str(mbpp)), load_config(None, [("code.source", "mbpp")]))
    assert len(task.train_rows) == 9 and len(task.eval_rows) == 1
    row = task.eval_rows[0]
    assert row["entry_point"] == "add_9" and "def add_9(x):" in row["prompt"][-1]["content"]
    assert task.check("```python\ndef add_9(x):\n    return x + 9\n```", row).correct

    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"prompt": "def double(x):\n    \"\"\"Twice x.\"\"\"\n", "entry_point": "double",
                               "tests": ["assert double(2) == 4"]}) + "\n" +
                   json.dumps({"prompt": "def neg(x):\n    \"\"\"Minus x.\"\"\"\n", "entry_point": "neg",
                               "test": "def check(candidate):\n    assert candidate(1) == -1\n"}) + "\n")
    task = make_task(TaskConfig(name="code", path=str(own)), load_config(None, [("code.source", "jsonl")]))
    assert task.check("```python\ndef neg(x):\n    return -x\n```", task.eval_rows[0]).correct


def test_bad_code_data_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "def f():\n    pass\n", "entry_point": "f", "tests": ["assert f( == 1"]}) +
                   "\n")
    with pytest.raises(TaskError, match="line 1 'tests'\\[0\\] is not valid Python"):
        make_task(TaskConfig(name="code", path=str(bad)), load_config(None, [("code.source", "jsonl")]))
    with pytest.raises(ConfigError, match="code.eval_source"):
        load_config(None, [("code.eval_source", "mbpp")])


def test_pass_at_k_estimator_matches_hand_computation():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong samples: some draw must be right
    assert pass_at_k(10, 1, 5) == pytest.approx(1 - math.comb(9, 5) / math.comb(10, 5))


def test_eval_reports_greedy_and_sampled_pass_at_k(capsys):
    code = main(["eval", "--model", "tiny", "--task", "code", "--num-examples", "2", "--json",
                 "--eval.max_new_tokens=8", "--code.pass_n=2", "--code.pass_k=[1,2]", "--code.workers=2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("pass@1_greedy", "pass@1", "pass@2", "accuracy"):
        assert 0.0 <= result[key] <= 1.0, key
    assert result["pass_n"] == 2 and result["num_examples"] == 2


def test_tiny_grpo_run_on_the_code_task_end_to_end(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--task", "code", "--steps", "2", "--train.prompts_per_step=2",
                 "--generation.num_generations=2", "--generation.max_new_tokens=16", "--eval.num_examples=1",
                 "--eval.at_start=false", "--eval.max_new_tokens=8", "--code.workers=2",
                 f"--output.dir={tmp_path}", "--output.progress=off", "--output.plot=false", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    metrics_file = next(tmp_path.glob("*/metrics.jsonl"))
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert summary["steps"] == 2 and len(records) == 2
    names = {"rewards/tests", "rewards/execution", "rewards/syntax", "rewards/lint", "rewards/complexity"}
    assert names <= set(records[0])
    assert "pass@1_greedy" in summary["eval_after"]
    for record in records:  # a step's sandbox work, when it did any, is in its record (tiny's code rarely parses)
        assert record.get("sandbox/malformed", 0) == 0
    from hasten.sandbox.pool import _SHARED

    assert not _SHARED  # the run closed its sandbox workers on the way out


def test_code_reward_bench_runs_and_every_mode_scores_the_same(capsys):
    from hasten.bench.code_rewards import main as bench_main

    assert bench_main(["--prompts", "1", "--generations", "8", "--repeats", "1", "--workers", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert "completions/s" in lines[1]  # a table first, the JSON line last
    assert set(result["modes"]) == {"serial", "pooled", "cached", "warm"}
    assert result["same_reward_in_every_mode"] and result["completions"] == 8


def test_the_code_preset_loads():
    from pathlib import Path

    cfg = load_config(Path(__file__).parent.parent / "configs" / "code.yaml")
    assert cfg.task.name == "code" and cfg.generation.max_new_tokens == 192
