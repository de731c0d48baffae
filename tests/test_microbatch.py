"""speed.token_budget: micro-batches cover every sample once, in order, within the
budget, and the learner's gradient does not depend on how the batch is split."""

from __future__ import annotations


import pytest
import torch

from conftest import learner_step, rollout_of
from hasten.algo import group_advantages
from hasten.config import ConfigError, load_config
from hasten.train.microbatch import count_tokens, micro_batches


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("budget", [1, 20, 60, 10_000])
def test_micro_batches_cover_samples_in_order_within_budget(short_model, tokenizer, packed, budget):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    pieces = micro_batches(rollout, 2, budget, packed)
    assert torch.cat(pieces).tolist() == list(range(rollout.num_samples))
    half = rollout.num_samples // 2
    assert all(p.max() < half or p.min() >= half for p in pieces)  # never across accumulation chunks
    for piece in pieces:
        assert piece.numel() == 1 or count_tokens(rollout, piece, packed) <= budget
    if budget == 1:
        assert len(pieces) == rollout.num_samples  # every sample is over budget alone
    if budget == 10_000:
        assert len(pieces) == 2  # only the accumulation split


def test_packed_count_has_each_prompt_once(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    group = torch.arange(4)
    prompt = int(rollout.prompt_mask[0].sum())
    completions = rollout.completion_mask[:4].sum(1)
    assert count_tokens(rollout, group, packed=True) == prompt + int((completions - 1).clamp(min=0).sum())
    assert count_tokens(rollout, group, packed=False) == 4 * (prompt + int(completions.max()))


def test_budget_zero_is_the_accumulation_split(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    pieces = micro_batches(rollout, 3, 0, True)
    expected = torch.arange(rollout.num_samples).tensor_split(3)
    assert [p.tolist() for p in pieces] == [e.tolist() for e in expected]


def test_negative_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="speed.token_budget"):
        load_config(None, [("speed.token_budget", -5)])


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("packed", [True, False])
def test_learner_gradient_is_the_same_with_a_token_budget(short_model, tokenizer, loss, packed):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    advantages = group_advantages(torch.randn(rollout.num_samples), 4)
    def configure(budget):
        def apply(cfg):
            cfg.algo.loss = loss
            cfg.speed.packed_learning = packed
            cfg.speed.token_budget = budget
        return apply

    results = [learner_step(short_model, tokenizer, rollout, advantages, configure(b)) for b in (0, 25)]
    assert len(micro_batches(rollout, 1, 25, packed)) > 2  # the budget really split the batch
    (whole, whole_grads), (split, split_grads) = results
    assert whole["loss"] == pytest.approx(split["loss"], abs=1e-5)
    assert whole["entropy"] == pytest.approx(split["entropy"], rel=1e-5)
    for a, b in zip(whole_grads, split_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
