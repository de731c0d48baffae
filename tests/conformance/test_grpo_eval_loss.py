"""GRPOTrainer.evaluate() as TRL's: sampled groups, rewards and eval_loss, with no update (api/eval_loss.py).

TRL main's test_evaluate_with_eval_dataset[*] (dev/trl_conformance) asserts eval_loss for one eval set
and eval_<name>_loss per named set; the contract test below checks those keys and the reward metrics
against both libraries (the `lib` switch). The hasten-only tests check what TRL's tests do not: the
eval takes no optimizer step and leaves no gradient, and a run that evaluates every step takes exactly
the steps of one that never does (the eval draws from its own seeds, not training's streams).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from .conftest import prompt_dataset
from .test_trl_conformance import grpo_args, snapshot, varied_reward


@pytest.mark.parametrize("shape", ["dataset", "dict"])
def test_evaluate_reports_eval_loss(lib, models, tmp_path, shape):
    split = prompt_dataset(split="test")
    eval_dataset = split if shape == "dataset" else {"data1": split, "data2": split}
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward,
                              args=grpo_args(lib, tmp_path, per_device_eval_batch_size=3),
                              train_dataset=prompt_dataset())
    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    labels = ["eval"] if shape == "dataset" else ["eval_data1", "eval_data2"]
    for label in labels:
        assert math.isfinite(metrics[f"{label}_loss"]), sorted(metrics)
    if shape == "dataset":  # TRL logs the reward metrics of the last eval under eval_, not per name
        assert 0 <= metrics["eval_reward"] < 13 and "eval_rewards/varied_reward/mean" in metrics


def test_evaluate_takes_no_step(models, tmp_path):
    from hasten import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3, num_generations=3,
                      per_device_eval_batch_size=6, max_completion_length=8, max_steps=1, report_to="none",
                      beta=0.1)  # beta: the KL reference joins the eval loss too
    trainer = GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, args=args,
                          train_dataset=prompt_dataset(), eval_dataset=prompt_dataset(split="test"))
    before = snapshot(trainer)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["eval_completions/mean_length"] > 0 and "eval_entropy" in metrics
    assert trainer.state.log_history[-1]["eval_loss"] == metrics["eval_loss"]
    for name, parameter in trainer.model.named_parameters():
        assert torch.equal(parameter, before[name]) and parameter.grad is None, name


def _run(models, tmp_path: Path, **fields) -> tuple[list[dict], list[dict]]:
    from hasten import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), learning_rate=0.1, per_device_train_batch_size=3,
                      num_generations=3, per_device_eval_batch_size=3, max_completion_length=8, max_steps=3,
                      report_to="none", seed=7, **fields)
    trainer = GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, args=args,
                          train_dataset=prompt_dataset(), eval_dataset=prompt_dataset(split="test"))
    trainer.train()
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    return [record for record in records if "loss" in record], evals


@pytest.fixture
def one_thread():
    """One intra-op thread for both runs: speed.adaptive_threads follows the box's load (at most the threads the
    process has), and another thread count only reorders float sums, which this bitwise comparison would see."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_eval_during_training_leaves_training_unchanged(models, tmp_path, one_thread):
    plain, no_evals = _run(models, tmp_path / "plain")
    evaluated, evals = _run(models, tmp_path / "evaluated", eval_strategy="steps", eval_steps=1, eval_on_start=True)
    assert no_evals == [] and [entry["step"] for entry in evals] == [0, 1, 2, 3]
    keys = ("loss", "reward_mean", "reward_std", "grad_norm", "completion_length")
    assert [{key: record[key] for key in keys} for record in evaluated] == \
        [{key: record[key] for key in keys} for record in plain]
