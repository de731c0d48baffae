"""Tools, environments and rollout_func through GRPOTrainer and `hasten train` on the tiny model:
a short run end to end, TRL's metrics, and bad input as one line with exit 2 and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from hasten import GRPOConfig, GRPOTrainer
from hasten.agent.builtin_tools import calculator
from hasten.agent.tools import ToolError
from hasten.errors import UserError
from hasten.tasks.guess import GuessingGame


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def last_length(completions, **kwargs):
    return [float(len(completion[-1]["content"])) for completion in completions]


def chat_rows(count=4):
    return [{"prompt": [{"role": "user", "content": f"What is {n} x 7?"}], "answer": n * 7} for n in range(count)]


def args_for(tmp_path, **more):
    settings = dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=24, logging_steps=1, disable_tqdm=True)
    settings.update(more)
    return GRPOConfig(**settings)


def records(trainer):
    return [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tools_run_logs_trl_tool_metrics(tmp_path):
    trainer = GRPOTrainer(model="tiny", reward_funcs=last_length, args=args_for(tmp_path), train_dataset=chat_rows(),
                          tools=[multiply])
    trainer.train()
    record = records(trainer)[-1]
    assert {"tools/call_frequency", "tools/failure_frequency"} <= set(record)
    assert trainer.config.generation.max_tool_turns == 24  # max_tool_calling_iterations=None: the length cap


def test_environment_without_dataset_owns_the_reward(tmp_path):
    trainer = GRPOTrainer(model="tiny", args=args_for(tmp_path, max_completion_length=16),
                          environment_factory=GuessingGame)
    assert [f.name for f in trainer.session.rewards] == ["GuessingGame"]
    trainer.train()
    assert "rewards/GuessingGame" in records(trainer)[-1]


def test_rollout_func_result_is_learned_with_env_mask(tmp_path):
    seen = {}

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        seen["prompts"] = len(prompts)
        ids = tokenizer("abc", add_special_tokens=False)["input_ids"]
        return {"prompt_ids": [[5, 6, 7]] * len(prompts), "completion_ids": [ids + [2]] * len(prompts),
                "logprobs": [[-1.0] * (len(ids) + 1)] * len(prompts),
                "env_mask": [[1, 0, 1, 1]] * len(prompts), "judge": ["x"] * len(prompts)}

    def reward(completions, judge, **kwargs):
        return [1.0 if j == "x" else 0.0 for j in judge]

    trainer = GRPOTrainer(model="tiny", reward_funcs=reward, args=args_for(tmp_path), train_dataset=chat_rows(),
                          rollout_func=rollout_func)
    trainer.train()
    assert seen["prompts"] == 4  # 2 prompts x 2 generations, TRL's repeated layout
    record = records(trainer)[-1]
    assert record["reward_mean"] == 1.0 and record["completion_length"] == 3.0  # env_mask: model tokens only


def test_rollout_func_missing_keys_is_one_line(tmp_path):
    trainer = GRPOTrainer(model="tiny", reward_funcs=last_length, args=args_for(tmp_path), train_dataset=chat_rows(),
                          rollout_func=lambda prompts, trainer: {"completion_ids": []})
    with pytest.raises(UserError, match="rollout_func error: the result has no prompt_ids, logprobs"):
        trainer.train()


def test_tool_without_docstring_is_an_error_before_any_write(tmp_path):
    def bare(a: int) -> int:
        return a

    with pytest.raises(ToolError, match="tool error: bare") as error:
        GRPOTrainer(model="tiny", reward_funcs=last_length, args=args_for(tmp_path), train_dataset=chat_rows(),
                    tools=[bare])
    assert "\n" not in str(error.value)
    assert not (tmp_path / "run").exists()


def test_environment_without_reset_is_an_error(tmp_path):
    class NoReset:
        pass

    with pytest.raises(ToolError, match="NoReset has no reset"):
        GRPOTrainer(model="tiny", args=args_for(tmp_path), train_dataset=chat_rows(), environment_factory=NoReset)


def test_dict_of_environments_checks_the_environment_column(tmp_path):
    """As TRL: the trainer constructs, and the batch that holds the unknown name raises TRL's ValueError."""
    rows = [{**row, "environment": "chess"} for row in chat_rows()]
    trainer = GRPOTrainer(model="tiny", args=args_for(tmp_path), train_dataset=rows,
                          environment_factory={"game": GuessingGame})
    with pytest.raises(ToolError, match="environment='chess'`, which is not among the environments") as error:
        trainer.train()
    assert isinstance(error.value, ValueError) and "\n" not in str(error.value)


def test_calculator_tool_answers_and_refuses_code():
    assert calculator("347 * 5821") == str(347 * 5821)
    assert calculator("__import__('os').system('true')").startswith("error:")
    assert calculator("9 ** 9 ** 9").startswith("error:")


def test_guessing_game_replies_and_reward():
    game = GuessingGame()
    assert game.reset(secret=40, prompt=[]) is None
    assert [game.guess(50), game.guess(25), game.guess(40)] == ["lower", "higher", "correct: the number is 40"]
    assert game.get_reward() == pytest.approx(0.8)


def run_cli(tmp_path, *overrides):
    return subprocess.run([sys.executable, "-m", "hasten.cli", "train", "--model.name=tiny",
                           f"--output.dir={tmp_path / 'out'}", *overrides], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)


def test_cli_tools_from_a_file_run(tmp_path):
    (tmp_path / "tools.py").write_text(textwrap.dedent('''
        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first term.
                b: The second term.
            """
            return a + b
        '''))
    done = run_cli(tmp_path, "--task.name=calculator", "--generation.tools=[tools.py:add, python]",
                   "--train.steps=1", "--train.prompts_per_step=1", "--generation.num_generations=2",
                   "--eval.num_examples=0", "--generation.max_new_tokens=16")
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("override, message", [
    ("--generation.tools=[nofile.py:add]", "tool error: 'nofile.py' does not exist"),
    ("--generation.tools=[bad.py:bare]", "tool error: bad.py:bare"),
    ("--task.environment=bad.py:NoReset", "NoReset has no reset"),
    ("--generation.tool_template=missing.jinja", "generation.tool_template: 'missing.jinja' is not auto"),
])
def test_cli_bad_tool_input_is_one_line_exit_2(tmp_path, monkeypatch, capsys, override, message):
    """The command line in this process (a fresh one adds only its start-up: test_cli_tools_from_a_file_run)."""
    from hasten.cli import main

    (tmp_path / "bad.py").write_text("def bare(a):\n    return a\n\nclass NoReset:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--model.name=tiny", f"--output.dir={tmp_path / 'out'}", "--task.name=calculator", override,
                 "--train.steps=1"])
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert code == 2, lines
    assert message in lines[-1] and len(lines) == 1
    assert not (tmp_path / "out").exists()


STOPPING_REWARD = '''
import os, signal
from pathlib import Path

def letters(completions, **kwargs):
    if len(completions) == 4 and os.environ.get("HASTEN_TEST_AT"):  # a training batch (evals score 2)
        counter = Path(os.environ["HASTEN_TEST_COUNTER"])
        calls = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(calls))
        if calls == int(os.environ["HASTEN_TEST_AT"]):
            os.kill(os.getpid(), signal.SIGTERM)
    texts = [completion[-1]["content"] for completion in completions]
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in texts]
'''


def test_environment_run_resumes_bit_identically(tmp_path):
    """The guess task's environments are made afresh on resume and reset from the row: the same run."""
    import os

    from test_resume import assert_same_run

    (tmp_path / "rewards.py").write_text(STOPPING_REWARD)
    common = ["--task.name=guess", f"--rewards.extra=['{tmp_path / 'rewards.py'}:letters']", "--train.steps=4",
              "--train.prompts_per_step=2", "--generation.num_generations=2", "--generation.max_new_tokens=24",
              "--train.lr=3e-3", "--train.num_threads=1", "--eval.num_examples=2", "--eval.every=2",
              "--eval.max_new_tokens=12", "--output.save_every=1", "--output.plot=false", "--output.progress=plain"]
    reference = run_cli(tmp_path, *common, "--output.name=reference")
    assert reference.returncode == 0, reference.stderr[-2000:]
    environment = {**os.environ, "HASTEN_TEST_AT": "3", "HASTEN_TEST_COUNTER": str(tmp_path / "calls")}
    command = [sys.executable, "-m", "hasten.cli", "train", "--model.name=tiny", f"--output.dir={tmp_path / 'out'}"]
    stopped = subprocess.run([*command, *common, "--output.name=stopped"], capture_output=True, text=True,
                             timeout=600, cwd=tmp_path, env=environment)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    resumed = subprocess.run([sys.executable, "-m", "hasten.cli", "train", "--resume",
                              str(tmp_path / "out" / "stopped")], capture_output=True, text=True, timeout=600,
                             cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(tmp_path / "out" / "stopped", tmp_path / "out" / "reference")
