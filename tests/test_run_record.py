"""What a run records and says matches what it did: config.yaml names the Python API's tools= and
environment_factory= (`generation.api_tools`, `task.api_environment`), not the empty defaults a config
file would show; the log says "1 step", not "1 steps"."""

from __future__ import annotations

import yaml

from hasten import GRPOConfig, GRPOTrainer
from hasten.tasks.guess import GuessingGame
from hasten.train.trainer import callable_name


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def length(completions, **kwargs):
    return [float(len(completion[-1]["content"])) for completion in completions]


def tiny_args(tmp_path, **more):
    return GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=12, logging_steps=1, disable_tqdm=True, **more)


def saved_config(trainer) -> dict:
    return yaml.safe_load((trainer.run_dir / "config.yaml").read_text())


def test_config_yaml_names_the_api_tools(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {n} x 7?"}]} for n in range(4)]
    trainer = GRPOTrainer(model="tiny", reward_funcs=length, args=tiny_args(tmp_path), train_dataset=rows,
                          tools=[multiply])
    trainer.train()
    saved = saved_config(trainer)
    assert saved["generation"]["api_tools"] == [f"{__name__}:multiply"]
    assert saved["task"]["api_environment"] is None


def test_config_yaml_names_the_api_environment(tmp_path):
    trainer = GRPOTrainer(model="tiny", args=tiny_args(tmp_path), environment_factory=GuessingGame)
    trainer.train()
    saved = saved_config(trainer)
    assert saved["task"]["api_environment"] == "hasten.tasks.guess:GuessingGame"
    assert saved["generation"]["api_tools"] == []


def test_callable_names():
    import functools

    class Scorer:
        def __call__(self, a: int) -> int:
            return a

    assert callable_name(functools.partial(multiply, 2)) == f"{__name__}:multiply"
    assert callable_name(Scorer()).endswith(":test_callable_names.<locals>.Scorer")
    assert callable_name({"game": GuessingGame}) == "{game: hasten.tasks.guess:GuessingGame}"


def test_one_step_and_one_question_are_singular(tmp_path, capsys):
    from hasten.cli import main

    code = main(["train", "--model.name=tiny", "--task.name=arithmetic", "--train.steps=1", "--eval.num_examples=1",
                 "--train.prompts_per_step=2", "--generation.num_generations=2", "--generation.max_new_tokens=4",
                 "--eval.max_new_tokens=4", f"--output.dir={tmp_path}", "--output.progress=off"])
    assert code == 0
    err = capsys.readouterr().err
    assert "training 1 step;" in err and "evaluating 1 held-out question (" in err
    assert "1 steps" not in err and "1 held-out questions" not in err
