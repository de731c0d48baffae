"""speed.skip_zero_advantage: samples whose loss has no gradient are left out of the learning pass,
and the loss, the gradients, the metrics and AdamW's state are the plain pass's (algo/zero_advantage.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import learner_step, rollout_of

from hasten.algo import LOSSES
from hasten.config import Config
from hasten.models import Policy, Reference
from hasten.algo.zero_advantage import learning_rows
from hasten.train.learner import Learner


def advantages_with_zeros(num_samples: int) -> torch.Tensor:
    """Group 0 all zero (an all-equal group), one zero in group 1, the rest nonzero."""
    advantages = torch.randn(num_samples, generator=torch.Generator().manual_seed(3))
    advantages[:4] = 0.0
    advantages[5] = 0.0
    return advantages


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_learning_rows_leaves_out_zero_advantages_and_empty_masks():
    advantages = torch.tensor([0.0, 1.0, -2.0, 0.0, 1e-12, 3.0])
    mask = torch.ones(6, 4, dtype=torch.long)
    mask[2] = 0  # an empty loss mask (a truncated completion under mask_truncated_completions)
    rows = torch.arange(6)
    assert learning_rows(rows, advantages, mask, beta=0.0).tolist() == [1, 4, 5]  # 1e-12 is not 0
    assert learning_rows(rows, advantages, mask, beta=0.1).tolist() == [0, 1, 3, 4, 5]  # KL: A = 0 still learns
    assert learning_rows(torch.tensor([3, 5]), advantages, mask, beta=0.0).tolist() == [5]
    whole = torch.tensor([1, 4, 5])
    assert learning_rows(whole, advantages, mask, beta=0.0) is whole  # nothing left out: the chunk as it was


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("packed", [True, False])
def test_skipping_gives_the_plain_loss_gradients_and_metrics(short_model, tokenizer, loss, packed):
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=8)
    advantages = advantages_with_zeros(rollout.num_samples)

    def configure(skip):
        def apply(cfg):
            cfg.algo.loss = loss
            cfg.train.gradient_accumulation_steps = 2  # bnpo normalises per chunk: the chunk keeps its count
            cfg.speed.packed_learning = packed
            cfg.speed.skip_zero_advantage = skip
        return apply

    plain, plain_grads = learner_step(short_model, tokenizer, rollout, advantages, configure(False))
    fast, fast_grads = learner_step(short_model, tokenizer, rollout, advantages, configure(True))
    close(fast_grads, plain_grads)
    assert fast["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-8)
    for key in ("clip_ratio/low", "clip_ratio/high", "grad_norm"):
        assert fast[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-8), key
    assert fast["learn/skipped_samples"] == pytest.approx(5 / rollout.num_samples)
    assert "learn/skipped_samples" not in plain


def test_clipped_metrics_keep_the_chunks_token_count(short_model, tokenizer):
    """With ratios far from 1 (an older sampler), clip_ratio counts over the whole chunk's tokens."""
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=8)
    rollout.sampling_logprobs = rollout.sampling_logprobs + 0.5 * torch.randn(
        rollout.sampling_logprobs.shape, generator=torch.Generator().manual_seed(1))
    advantages = advantages_with_zeros(rollout.num_samples)
    results = [learner_step(short_model, tokenizer, rollout, advantages,
                            lambda cfg, skip=skip: setattr(cfg.speed, "skip_zero_advantage", skip),
                            off_policy=True)
               for skip in (False, True)]
    (plain, plain_grads), (fast, fast_grads) = results
    assert plain["clip_ratio/low"] + plain["clip_ratio/high"] > 0  # the check below can fail
    for key in ("clip_ratio/low", "clip_ratio/high", "loss"):
        assert fast[key] == pytest.approx(plain[key], rel=1e-5), key
    close(fast_grads, plain_grads)


def test_a_kl_term_keeps_zero_advantage_samples(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=8)
    advantages = advantages_with_zeros(rollout.num_samples)
    runs = []
    for skip in (False, True):
        cfg = Config()
        cfg.algo.beta = 0.1
        cfg.speed.skip_zero_advantage = skip
        policy = Policy(copy.deepcopy(short_model), tokenizer, "tiny")
        learner = Learner.from_config(policy, cfg, Reference(policy))
        with torch.no_grad():  # the policy moves off its reference, so KL has a gradient
            for parameter in learner.parameters:
                parameter.add_(0.01 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
        grads = []
        learner.optimization.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs, learner=learner, grads=grads: grads.extend(
                p.grad.clone() for p in learner.parameters))
        runs.append((learner.step(rollout, advantages), grads))
    (plain, plain_grads), (fast, fast_grads) = runs
    close(fast_grads, plain_grads)
    assert fast["kl"] == pytest.approx(plain["kl"], rel=1e-5) and plain["kl"] > 0
    assert fast["learn/skipped_samples"] == 0.0  # every completion here has tokens


def test_a_step_with_nothing_to_learn_still_decays_adamw_like_the_plain_path(short_model, tokenizer):
    """All advantages 0: no pass runs, but the gradient is zero (not None), so the second update still
    moves the weights by AdamW's decayed first moment, exactly as the plain path's."""
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=8)
    signal = advantages_with_zeros(rollout.num_samples)
    nothing = torch.zeros(rollout.num_samples)
    results = []
    for skip in (False, True):
        cfg = Config()
        cfg.train.lr = 1e-2
        cfg.train.lr_schedule = "constant"
        cfg.train.warmup_steps = 0
        cfg.speed.skip_zero_advantage = skip
        learner = Learner.from_config(Policy(copy.deepcopy(short_model), tokenizer, "tiny"), cfg)
        learner.step(rollout, signal)
        before = [p.detach().clone() for p in learner.parameters]
        metrics = learner.step(rollout, nothing)
        after = [p.detach().clone() for p in learner.parameters]
        moments = [learner.optimization.optimizer.state[p]["exp_avg"].clone() for p in learner.parameters]
        results.append((metrics, before, after, moments))
    (plain, before_plain, after_plain, moments_plain), (fast, before_fast, after_fast, moments_fast) = results
    assert any(not torch.equal(a, b) for a, b in zip(after_plain, before_plain))  # the plain path moved
    close(after_fast, after_plain)
    close(moments_fast, moments_plain)
    assert fast["loss"] == plain["loss"] == 0.0 and fast["grad_norm"] == plain["grad_norm"] == 0.0
    assert fast["learn/skipped_samples"] == 1.0
    assert "entropy" in plain and "entropy" not in fast  # no token went through the pass


def test_empty_loss_masks_are_skipped_and_importance_weights_kept(short_model, tokenizer):
    """Truncated completions under mask_truncated_completions (an empty loss mask) learn nothing either;
    with a bf16-like sampler's importance weights the gradient is still the plain pass's."""
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=8)
    rollout.sampling_logprobs = rollout.sampling_logprobs + 0.05 * torch.randn(
        rollout.sampling_logprobs.shape, generator=torch.Generator().manual_seed(4))
    advantages = torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(5))  # none zero
    loss_mask = rollout.completion_mask.clone()
    loss_mask[[1, 6, 7]] = 0
    results = [learner_step(short_model, tokenizer, rollout, advantages,
                            lambda cfg, skip=skip: setattr(cfg.speed, "skip_zero_advantage", skip),
                            loss_mask=loss_mask, importance_cap=2.0)
               for skip in (False, True)]
    (plain, plain_grads), (fast, fast_grads) = results
    close(fast_grads, plain_grads)
    assert fast["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert fast["learn/skipped_samples"] == pytest.approx(3 / rollout.num_samples)
    # the sampler-mismatch metrics cover the learned tokens: the same ones here (skipped rows have no loss tokens)
    assert fast["bf16_sampler/ratio_mean"] == pytest.approx(plain["bf16_sampler/ratio_mean"], rel=1e-5)

    nothing, _ = learner_step(short_model, tokenizer, rollout, torch.zeros(rollout.num_samples),
                              lambda cfg: None, importance_cap=2.0)
    assert not any(key.startswith("bf16_sampler/") for key in nothing)  # no ratio of 0 for tokens never seen
