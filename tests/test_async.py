"""algo.async_steps=1 (train/async_pipeline.py): batch t+1 is sampled while step t learns, from the
weights before step t's update; the learner ratios against the batch's sampling log-probs."""

from __future__ import annotations


import pytest
import torch

from conftest import letters_config, run_metrics
from hasten.config import load_config
from hasten.train.trainer import GRPOJob, train

@pytest.fixture
def data(letters_task):
    return letters_task


config = letters_config
metrics = run_metrics


def frozen(self, loss: float) -> float:
    """An optimizer step that updates nothing (drops the gradients)."""
    self.optimizer.zero_grad(set_to_none=True)
    return 0.0


def test_with_frozen_weights_async_samples_exactly_what_sync_samples(data, monkeypatch):
    """Weights that never change make one update stale no change at all: every step's batch
    (rewards) is the synchronous run's, and the losses agree up to the engine/learner log-prob rounding."""
    from hasten.train.optimization import Optimization

    monkeypatch.setattr(Optimization, "step", frozen)
    sync = metrics(train(config(data, "sync"), log=lambda _: None))
    asynchronous = metrics(train(config(data, "async", **{"algo.async_steps": 1}), log=lambda _: None))
    assert [r["reward_mean"] for r in asynchronous] == [r["reward_mean"] for r in sync]
    assert [r["completion_length"] for r in asynchronous] == [r["completion_length"] for r in sync]
    for a, s in zip(asynchronous, sync):
        assert a["loss"] == pytest.approx(s["loss"], abs=1e-5)
        assert a["async/logp_abs_diff"] < 1e-4 and a["async/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert [r["async/staleness"] for r in asynchronous] == [0.0, 1.0, 1.0, 1.0]


def test_async_batches_are_one_update_stale(data, monkeypatch):
    """Step t's batch is sampled from the weights after step t-2: the sampling copy lags the policy by one update."""
    seen = []
    original = GRPOJob.step

    def step(self, number):
        record = original(self, number)
        shadow = list(self.pipeline.shadow.parameters())  # now holds the weights batch number+1 samples from
        seen.append([p.detach().clone() for p in shadow])
        return record

    snapshots = []
    monkeypatch.setattr(GRPOJob, "step", step)
    import hasten.train.optimization as optimization

    update = optimization.Optimization.step

    def recording_update(self, loss):
        snapshots.append([p.detach().clone() for p in self.parameters])  # before this update
        return update(self, loss)

    monkeypatch.setattr(optimization.Optimization, "step", recording_update)
    records = metrics(train(config(data, "async", **{"algo.async_steps": 1}), log=lambda _: None))
    assert len(records) == 4 and all(r["async/logp_abs_diff"] >= 0 for r in records)
    # After step t, the sampling copy holds the weights before step t's update (= after step t-1).
    for t in (1, 2, 3):
        assert all(torch.equal(a, b) for a, b in zip(seen[t - 1], snapshots[t - 1]))
    assert records[2]["async/logp_abs_diff"] > 1e-6  # steps 2+ really learn off-policy


def test_async_run_learns(data):
    summary = train(config(data, "learns", **{"algo.async_steps": 1, "train.steps": 40,
                                              "train.prompts_per_step": 4, "generation.max_new_tokens": 12}),
                    log=lambda _: None)
    rewards = [r["reward_mean"] for r in metrics(summary)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.2, (first, last)


def test_async_resume_is_exact(data, monkeypatch):
    reference = train(config(data, "reference", **{"algo.async_steps": 1, "output.save_every": 1}),
                      log=lambda _: None)

    original = GRPOJob.step

    def crashing(self, number):
        if number == 3:
            raise RuntimeError("crash at step 3")
        return original(self, number)

    with monkeypatch.context() as patch:
        patch.setattr(GRPOJob, "step", crashing)
        with pytest.raises(RuntimeError):
            train(config(data, "crashed", **{"algo.async_steps": 1, "output.save_every": 1}), log=lambda _: None)
    run = data / "runs" / "crashed"
    resumed = train(load_config(run / "config.yaml"), log=lambda _: None, resume=run)
    volatile = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/")) and k != "tokens_per_second"}  # noqa: E731
    assert [volatile(r) for r in metrics(resumed)] == [volatile(r) for r in metrics(reference)]
