"""examples/grpo_reference.py, the plain GRPO loop, learns exactly what `hasten train --profile baseline` learns.

Both run a few steps on the tiny model with the same settings in this process, on one thread (so the order
of reductions is fixed); the per-step rewards, losses and gradient norms and the final weights must be
equal, bit for bit: both call the same kernels in the same order, so any difference is a difference in what
is computed, never rounding. Which number differs first says which part the example does differently:
rewards -> sampling or prompts; losses -> the log-prob pass or the loss; gradient norms or weights alone ->
the optimizer, clipping or lr schedule.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo_reference.py"
REWARD = '''
def letters(prompts, completions, **kwargs):
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
'''


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_reference", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings(directory: Path, **extra) -> list[tuple[str, object]]:
    rows = [{"prompt": f"write letters {i}:"} for i in range(24)]
    (directory / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "rewards.py").write_text(REWARD)
    pairs = {
        "model.name": "tiny", "model.device": "cpu", "task.name": "jsonl", "task.path": str(directory / "data.jsonl"),
        "rewards.extra": [f"{directory / 'rewards.py'}:letters"], "train.steps": 3, "train.prompts_per_step": 2,
        "train.lr": 3e-3, "train.num_threads": 1, "generation.num_generations": 4, "generation.max_new_tokens": 10,
        "algo.loss": "grpo", "eval.num_examples": 0, "output.dir": str(directory / "runs"),
        "output.progress": "off", "output.plot": False, **extra,
    }
    return list(pairs.items())


def run_trainer(pairs) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from hasten.config import load_config
    from hasten.train.trainer import train

    summary = train(load_config(overrides=pairs, profile="baseline"), log=lambda text: None)
    run_dir = Path(summary["run_dir"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, load_file(next(run_dir.glob("checkpoint/model.safetensors")))


def run_example(pairs) -> tuple[list[dict], dict[str, torch.Tensor]]:
    from hasten.config import load_config

    policy, records = load_example().train(load_config(overrides=pairs, profile="baseline"), log=lambda text: None)
    return records, {name: tensor.detach() for name, tensor in policy.model.state_dict().items()}


def assert_same_run(example, trainer) -> None:
    (example_records, example_weights), (trainer_records, trainer_weights) = example, trainer
    assert [r["step"] for r in example_records] == [r["step"] for r in trainer_records]
    for mine, theirs in zip(example_records, trainer_records):
        for key in ("reward_mean", "loss", "grad_norm"):
            assert mine[key] == theirs[key], (mine["step"], key, mine[key], theirs[key])
    assert trainer_weights and set(trainer_weights) <= set(example_weights)
    for name, saved in trainer_weights.items():
        assert torch.equal(example_weights[name], saved), (name, float((example_weights[name] - saved).abs().max()))


# mu = 2 and a small clip range, so the second update's ratios leave [1 - eps, 1 + eps] and clipping acts.
CASES = {
    "kl_two_iterations": {"algo.beta": 0.04, "algo.num_iterations": 2, "algo.epsilon": 0.02},
    "plain": {"algo.beta": 0.0},
}


@pytest.mark.parametrize("case", CASES)
def test_reference_loop_learns_what_the_baseline_trainer_learns(tmp_path, case):
    from hasten.config import load_config
    from hasten.models import load_policy

    previous_threads = torch.get_num_threads()
    try:
        trainer = run_trainer(settings(tmp_path, **CASES[case]))
        example = run_example(settings(tmp_path, **CASES[case]))
    finally:
        torch.set_num_threads(previous_threads)
    assert_same_run(example, trainer)
    start = load_policy(load_config(overrides=settings(tmp_path)).model, log=lambda text: None).model.state_dict()
    assert any(not torch.equal(start[name], saved) for name, saved in trainer[1].items())  # something was learned
    if case == "kl_two_iterations":
        assert any(record["clip_ratio/low"] + record["clip_ratio/high"] > 0 for record in trainer[0])


def test_reference_loop_refuses_what_it_leaves_out(tmp_path):
    from hasten.config import ConfigError, load_config

    cfg = load_config(overrides=settings(tmp_path, **{"train.gradient_accumulation_steps": 2}), profile="baseline")
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        load_example().train(cfg, log=lambda text: None)


def test_reference_script_reports_a_left_out_setting_in_one_line():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(EXAMPLE), "--model.name=tiny", "--generation.stop_strings=[done]"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "config error: generation.stop_strings is not in the reference loop (use hasten train)"
