"""The first minute of a run says what it is doing: loading the model, the plan, the held-out eval
before training with a counter (ticker.py, on stderr), then the first step; and a caller's no-op log
keeps it silent."""

from __future__ import annotations

from hasten.config import load_config
from hasten.train.trainer import train


def tiny_run(tmp_path, **overrides):
    pairs = {"model.name": "tiny", "task.name": "arithmetic", "train.steps": 2, "train.prompts_per_step": 2,
             "generation.num_generations": 2, "generation.max_new_tokens": 4, "eval.num_examples": 4,
             "eval.batch_size": 2, "eval.max_new_tokens": 4, "eval.every": 0, "output.dir": str(tmp_path / "runs"),
             "output.progress": "off", "output.plot": False, "train.num_threads": 1, **overrides}
    return load_config(overrides=list(pairs.items()))


def first_index(lines: list[str], start: str) -> int:
    return next(i for i, line in enumerate(lines) if line.lstrip().startswith(start))


def test_the_phases_are_announced_in_order(tmp_path, capsys):
    lines: list[str] = []
    train(tiny_run(tmp_path, **{"output.progress": "plain"}), log=lines.append)
    order = [first_index(lines, phase) for phase in (
        "loading model tiny ...", "plan: ", "evaluating 4 held-out questions",
        "training 2 steps; step 1: sampling 2 prompts x 2 completions")]
    assert order == sorted(order), lines
    assert sum(line.startswith("training ") for line in lines) == 1
    shown = capsys.readouterr().err.splitlines()  # the eval's count (ticker.py)
    assert any(line.startswith("evaluating at step 0:") and "4/4" in line for line in shown), shown
    assert any(line.startswith("evaluating at step 2:") and "4/4" in line for line in shown), shown


def test_a_no_op_log_keeps_the_run_quiet(tmp_path, capsys):
    train(tiny_run(tmp_path), log=lambda line: None)
    printed = capsys.readouterr()
    assert "loading model" not in printed.out + printed.err
    assert "evaluat" not in printed.out + printed.err
