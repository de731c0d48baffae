"""Hand-computed checks of the GRPO-family losses and group advantages.

Every expected value below is written out as arithmetic on small explicit
tensors (3 sequences x 3 tokens, with padding), following the semantics in the
docstrings of hasten/algo/losses.py and hasten/algo/advantages.py, which in
turn follow TRL's GRPOTrainer.
"""

from __future__ import annotations

import math

import pytest
import torch

from hasten.algo.advantages import EPS, group_advantages, zero_variance_fraction
from hasten.algo.losses import LOSSES, LossInputs, LossSettings

ATOL = 1e-5

# --------------------------------------------------------------------------- #
# Shared fixture for the token-level losses.
#
#   epsilon = 0.2 (low bound 0.8), epsilon_high = 0.28 (high bound 1.28)
#
#   seq  A     ratio r = exp(logp - old)   mask       per-token loss -min(rA, clip(r)A)
#   0   +2.0   [1.5,  1.25, 0.5]           [1, 1, 1]  [-1.28*2, -1.25*2, -0.8*2 vs -0.5*2 -> -1.0]
#   1   -1.0   [0.75, 0.9,  3.0]           [1, 1, 0]  [+0.8 (clip low), +0.9, pad]
#   2   +0.5   [1.4,  2.0,  1.0]           [1, 0, 0]  [-1.28*0.5 (clip high), pad, pad]
#
# Clipped tokens: high (r > 1.28, A > 0): seq0 t0, seq2 t0  -> 2 of 6 tokens.
#                 low  (r < 0.8,  A < 0): seq1 t0          -> 1 of 6 tokens.
# seq0 t1 (r = 1.25) lies above 1 + epsilon but below 1 + epsilon_high, so it is
# only unclipped if epsilon_high is used; seq1 t0 (r = 0.75) lies below
# 1 - epsilon but above 1 - epsilon_high, so it is only clipped if epsilon is
# used for the low side. seq2 t1 (r = 2.0, A > 0) is padding: it must not count.
# --------------------------------------------------------------------------- #

LOGPS = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.8], [-0.6, -1.5, -0.1]]
RATIOS = [[1.5, 1.25, 0.5], [0.75, 0.9, 3.0], [1.4, 2.0, 1.0]]
ADVANTAGES = [2.0, -1.0, 0.5]
MASK = [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
TOTAL_TOKENS = 6.0
TOTAL_SEQUENCES = 3
MAX_COMPLETION_LENGTH = 4  # != T on purpose, so dr_grpo's constant is visible

# ref_logps - logps (the KL's d); padding entries are large so leaking them shows
KL_DELTA = [[0.5, -0.5, 0.0], [1.0, 0.2, 7.0], [-1.0, 3.0, 3.0]]
K3 = {  # exp(d) - d - 1 on the unmasked tokens, by hand
    (0, 0): math.exp(0.5) - 0.5 - 1,
    (0, 1): math.exp(-0.5) + 0.5 - 1,
    (0, 2): math.exp(0.0) - 0.0 - 1,  # = 0
    (1, 0): math.exp(1.0) - 1.0 - 1,
    (1, 1): math.exp(0.2) - 0.2 - 1,
    (2, 0): math.exp(-1.0) + 1.0 - 1,
}
K3_SUM = sum(K3.values())

SETTINGS = LossSettings(epsilon=0.2, epsilon_high=0.28)

# Per-token surrogate losses of the fixture (unmasked tokens only), by hand.
SEQ0 = [-(1.28 * 2.0), -(1.25 * 2.0), -(0.5 * 2.0)]  # -2.56, -2.5, -1.0
SEQ1 = [-(0.8 * -1.0), -(0.9 * -1.0)]  # 0.8, 0.9
SEQ2 = [-(1.28 * 0.5)]  # -0.64
TOKEN_SUM = sum(SEQ0) + sum(SEQ1) + sum(SEQ2)  # -5.0


def make_inputs(
    rows=slice(None),
    *,
    ratios=RATIOS,
    log_ratios=None,
    ref=False,
    ref_delta=KL_DELTA,
    num_chunks=1,
    requires_grad=False,
    num_iterations_one=False,
):
    logps = torch.tensor(LOGPS, dtype=torch.float32)[rows].clone().requires_grad_(requires_grad)
    if num_iterations_one:
        old = logps.detach()
    elif log_ratios is not None:
        old = logps.detach() - torch.tensor(log_ratios, dtype=torch.float32)[rows]
    else:
        old = logps.detach() - torch.log(torch.tensor(ratios, dtype=torch.float32)[rows])
    ref_logps = logps.detach() + torch.tensor(ref_delta, dtype=torch.float32)[rows] if ref else None
    return LossInputs(
        logps=logps,
        old_logps=old,
        ref_logps=ref_logps,
        advantages=torch.tensor(ADVANTAGES, dtype=torch.float32)[rows],
        completion_mask=torch.tensor(MASK, dtype=torch.long)[rows],
        total_tokens=TOTAL_TOKENS,
        total_sequences=TOTAL_SEQUENCES,
        max_completion_length=MAX_COMPLETION_LENGTH,
        num_chunks=num_chunks,
    )


# =========================================================================== #
# Advantages
# =========================================================================== #

# Two groups of G = 3: [0, 2, 4] (mean 2, unbiased std sqrt((4+0+4)/2) = 2;
# the biased std would be sqrt(8/3)) and [1, 1, 1] (all equal).
REWARDS = torch.tensor([0.0, 2.0, 4.0, 1.0, 1.0, 1.0])


def test_advantages_group_scaling():
    adv = group_advantages(REWARDS, 3, "group")
    expected = [-2 / (2 + 1e-4), 0 / (2 + 1e-4), 2 / (2 + 1e-4), 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert EPS == 1e-4


def test_advantages_group_default_is_group():
    assert torch.equal(group_advantages(REWARDS, 3), group_advantages(REWARDS, 3, "group"))


def test_all_equal_group_is_exactly_zero():
    for scale in ("group", "batch", "none"):
        adv = group_advantages(REWARDS, 3, scale)
        assert adv[3:].tolist() == [0.0, 0.0, 0.0], scale
    # a value that is not exact in binary must still give an exact 0, not 0/0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 2.0])
    adv = group_advantages(rewards, 3, "group")
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(adv).all()
    assert adv[3:].tolist() == pytest.approx([-1 / (1 + 1e-4), 0.0, 1 / (1 + 1e-4)], abs=1e-6)


def test_advantages_batch_scaling():
    # centred by the GROUP mean, divided by the std of the whole batch:
    # batch mean = 9/6 = 1.5; squared deviations 2.25 + 0.25 + 6.25 + 3 * 0.25 = 9.5;
    # unbiased variance 9.5 / 5 = 1.9.
    adv = group_advantages(REWARDS, 3, "batch")
    std = math.sqrt(9.5 / 5)
    expected = [-2 / (std + 1e-4), 0.0, 2 / (std + 1e-4), 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_advantages_no_scaling():
    adv = group_advantages(REWARDS, 3, "none")
    assert adv.tolist() == pytest.approx([-2.0, 0.0, 2.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_advantages_are_group_major():
    # G = 2: groups [0, 2], [4, 1], [1, 1]
    adv = group_advantages(REWARDS, 2, "none")
    assert adv.tolist() == pytest.approx([-1.0, 1.0, 1.5, -1.5, 0.0, 0.0], abs=1e-6)
    # std of [0, 2] = sqrt(2), of [4, 1] = sqrt(4.5)
    adv = group_advantages(REWARDS, 2, "group")
    expected = [
        -1 / (math.sqrt(2) + 1e-4),
        1 / (math.sqrt(2) + 1e-4),
        1.5 / (math.sqrt(4.5) + 1e-4),
        -1.5 / (math.sqrt(4.5) + 1e-4),
        0.0,
        0.0,
    ]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_advantages_unknown_mode_raises():
    with pytest.raises(ValueError):
        group_advantages(REWARDS, 3, "bogus")


def test_zero_variance_fraction():
    assert zero_variance_fraction(REWARDS, 3) == pytest.approx(1 / 2)
    # groups [1, 1], [0, 1], [2, 2], [3, 3]
    assert zero_variance_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 3.0]), 2) == pytest.approx(3 / 4)
    assert zero_variance_fraction(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2) == 0.0
    assert zero_variance_fraction(torch.tensor([5.0, 5.0, 5.0, 5.0]), 4) == 1.0


# =========================================================================== #
# Token-level losses with clipping active in both directions
# =========================================================================== #


def test_fixture_token_sum():
    # guard for the hand arithmetic used by every test below
    assert TOKEN_SUM == pytest.approx(-5.0)


def _check_clip_metrics(metrics):
    assert metrics["clip_ratio/high"] == pytest.approx(2 / 6, abs=1e-6)
    assert metrics["clip_ratio/low"] == pytest.approx(1 / 6, abs=1e-6)
    assert "kl" not in metrics


def test_grpo_value_and_clip_metrics():
    loss, metrics = LOSSES["grpo"](make_inputs(), SETTINGS)
    # mean over each sequence's own tokens, then over the 3 sequences
    expected = ((-2.56 - 2.5 - 1.0) / 3 + (0.8 + 0.9) / 2 + (-0.64) / 1) / 3
    assert loss.item() == pytest.approx(expected, abs=ATOL)
    assert loss.item() == pytest.approx((sum(SEQ0) / 3 + sum(SEQ1) / 2 + sum(SEQ2) / 1) / 3, abs=ATOL)
    _check_clip_metrics(metrics)


def test_bnpo_value_and_clip_metrics():
    loss, metrics = LOSSES["bnpo"](make_inputs(), SETTINGS)
    expected = (-2.56 - 2.5 - 1.0 + 0.8 + 0.9 - 0.64) / 6
    assert loss.item() == pytest.approx(expected, abs=ATOL)
    _check_clip_metrics(metrics)


def test_dr_grpo_value_and_clip_metrics():
    loss, metrics = LOSSES["dr_grpo"](make_inputs(), SETTINGS)
    # sum over tokens / (sequences x max_completion_length) = -5 / (3 * 4)
    expected = (-2.56 - 2.5 - 1.0 + 0.8 + 0.9 - 0.64) / (3 * 4)
    assert loss.item() == pytest.approx(expected, abs=ATOL)
    _check_clip_metrics(metrics)


def test_dapo_value_and_clip_metrics():
    loss, metrics = LOSSES["dapo"](make_inputs(), SETTINGS)
    expected = (-2.56 - 2.5 - 1.0 + 0.8 + 0.9 - 0.64) / 6
    assert loss.item() == pytest.approx(expected, abs=ATOL)
    _check_clip_metrics(metrics)


def test_dapo_uses_total_tokens_not_chunk_tokens():
    inputs = make_inputs()
    inputs.total_tokens = 10.0
    loss, _ = LOSSES["dapo"](inputs, SETTINGS)
    assert loss.item() == pytest.approx(-5.0 / 10, abs=ATOL)


def test_epsilon_high_defaults_to_epsilon():
    settings = LossSettings(epsilon=0.2)  # epsilon_high None -> 0.2, high bound 1.2
    assert settings.upper == 0.2
    loss, metrics = LOSSES["dapo"](make_inputs(), settings)
    # seq0: r 1.5 -> 1.2, r 1.25 -> 1.2 (now clipped), r 0.5 -> min(1.0, 1.6);
    # seq1 unchanged; seq2: r 1.4 -> 1.2
    expected = (-(1.2 * 2) - (1.2 * 2) - (0.5 * 2) + 0.8 + 0.9 - (1.2 * 0.5)) / 6
    assert loss.item() == pytest.approx(expected, abs=ATOL)
    assert metrics["clip_ratio/high"] == pytest.approx(3 / 6, abs=1e-6)
    assert metrics["clip_ratio/low"] == pytest.approx(1 / 6, abs=1e-6)


def test_clipped_tokens_have_no_gradient():
    inputs = make_inputs(requires_grad=True)
    loss, _ = LOSSES["dapo"](inputs, SETTINGS)
    loss.backward()
    # d/dlogp of -r*A/6 is -r*A/6 where unclipped; 0 where clipped or masked
    # seq0: t0 clipped high; t1 r=1.25 inside [0.8, 1.28]; t2 r=0.5 < 0.8 but A > 0, so
    #       min(r*A, 0.8*A) = r*A is the unclipped branch
    # seq1: t0 clipped low; t1 r=0.9 inside; t2 padding.  seq2: t0 clipped high; rest padding
    expected = [
        [0.0, -1.25 * 2.0 / 6, -0.5 * 2.0 / 6],
        [0.0, -0.9 * -1.0 / 6, 0.0],
        [0.0, 0.0, 0.0],
    ]
    assert inputs.logps.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


# =========================================================================== #
# Chunk invariance (gradient accumulation)
# =========================================================================== #


def _chunked(loss_type, settings, ref):
    first, _ = LOSSES[loss_type](make_inputs(slice(0, 2), ref=ref, num_chunks=2), settings)
    second, _ = LOSSES[loss_type](make_inputs(slice(2, 3), ref=ref, num_chunks=2), settings)
    return first, second


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_chunk_sum_equals_full_batch(loss_type, beta):
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=beta)
    full, _ = LOSSES[loss_type](make_inputs(ref=beta > 0), settings)
    first, second = _chunked(loss_type, settings, beta > 0)
    assert (first + second).item() == pytest.approx(full.item(), abs=ATOL)


def test_chunk_sum_hand_values():
    # chunk [seq0, seq1] and chunk [seq2], normalised by the full batch
    first, second = _chunked("dapo", SETTINGS, False)
    assert first.item() == pytest.approx((-2.56 - 2.5 - 1.0 + 0.8 + 0.9) / 6, abs=ATOL)
    assert second.item() == pytest.approx(-0.64 / 6, abs=ATOL)
    first, second = _chunked("grpo", SETTINGS, False)
    assert first.item() == pytest.approx(((-2.56 - 2.5 - 1.0) / 3 + (0.8 + 0.9) / 2) / 3, abs=ATOL)
    assert second.item() == pytest.approx(-0.64 / 3, abs=ATOL)
    first, second = _chunked("dr_grpo", SETTINGS, False)
    assert first.item() == pytest.approx((-2.56 - 2.5 - 1.0 + 0.8 + 0.9) / 12, abs=ATOL)
    assert second.item() == pytest.approx(-0.64 / 12, abs=ATOL)


def test_bnpo_is_mean_of_chunk_token_means():
    # TRL: each micro-batch's loss is its own token mean / gradient_accumulation_steps,
    # so bnpo over chunks is the mean of per-chunk token means, NOT the full-batch mean.
    first, second = _chunked("bnpo", SETTINGS, False)
    assert first.item() == pytest.approx((-2.56 - 2.5 - 1.0 + 0.8 + 0.9) / 5 / 2, abs=ATOL)
    assert second.item() == pytest.approx(-0.64 / 1 / 2, abs=ATOL)
    chunked = ((-2.56 - 2.5 - 1.0 + 0.8 + 0.9) / 5 + (-0.64) / 1) / 2  # -0.756
    full, _ = LOSSES["bnpo"](make_inputs(), SETTINGS)  # -5/6
    assert (first + second).item() == pytest.approx(chunked, abs=ATOL)
    assert full.item() == pytest.approx(-5.0 / 6, abs=ATOL)
    assert abs(chunked - (-5.0 / 6)) > 0.05


# =========================================================================== #
# GSPO: sequence-level ratio
# =========================================================================== #

# logp - old_logp per token; padding entries are large so leaking them shows.
#   seq0 (A = +2):  mean(0.5, 0.2, 0.2) = 0.3  -> s = e^0.3  = 1.3499 > 1.28 -> clipped high
#   seq1 (A = -1):  mean(-0.5, -0.3)    = -0.4 -> s = e^-0.4 = 0.6703 < 0.8  -> clipped low
#   seq2 (A = 0.5): mean(0.1)           = 0.1  -> s = e^0.1  = 1.1052        -> unclipped
GSPO_LOG_RATIOS = [[0.5, 0.2, 0.2], [-0.5, -0.3, 5.0], [0.1, 9.0, 9.0]]


def test_gspo_sequence_ratio_and_clipping():
    loss, metrics = LOSSES["gspo"](make_inputs(log_ratios=GSPO_LOG_RATIOS), SETTINGS)
    expected = (
        -min(math.exp(0.3) * 2.0, 1.28 * 2.0)  # -2.56
        - min(math.exp(-0.4) * -1.0, 0.8 * -1.0)  # +0.8
        - min(math.exp(0.1) * 0.5, math.exp(0.1) * 0.5)  # unclipped
    ) / 3
    assert expected == pytest.approx((-2.56 + 0.8 - 0.5 * math.exp(0.1)) / 3)
    assert loss.item() == pytest.approx(expected, abs=ATOL)
    # metrics are per sequence: 1 of 3 clipped high, 1 of 3 clipped low
    assert metrics["clip_ratio/high"] == pytest.approx(1 / 3, abs=1e-6)
    assert metrics["clip_ratio/low"] == pytest.approx(1 / 3, abs=1e-6)
    assert "kl" not in metrics


def test_gspo_gradient_flows_only_through_unclipped_sequences():
    inputs = make_inputs(log_ratios=GSPO_LOG_RATIOS, requires_grad=True)
    loss, _ = LOSSES["gspo"](inputs, SETTINGS)
    loss.backward()
    # seq2: d/dlogp[2,0] of -A * exp(mean) / N = -0.5 * e^0.1 * (1/1) / 3
    expected = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.5 * math.exp(0.1) / 3, 0.0, 0.0]]
    assert inputs.logps.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


def test_gspo_gradient_num_iterations_one():
    inputs = make_inputs(requires_grad=True, num_iterations_one=True)
    loss, _ = LOSSES["gspo"](inputs, SETTINGS)
    assert loss.item() == pytest.approx(-(2.0 - 1.0 + 0.5) / 3, abs=ATOL)
    loss.backward()
    # s = 1: d/dlogp_t = -A_i * (1 / len_i) / N on unmasked tokens
    expected = [
        [-2.0 / 3 / 3] * 3,
        [1.0 / 2 / 3, 1.0 / 2 / 3, 0.0],
        [-0.5 / 1 / 3, 0.0, 0.0],
    ]
    assert inputs.logps.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


def test_gspo_kl_is_sequence_mean_of_k3():
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=0.1)
    loss, metrics = LOSSES["gspo"](make_inputs(log_ratios=GSPO_LOG_RATIOS, ref=True), settings)
    expected = (
        (-2.56 + 0.1 * (K3[0, 0] + K3[0, 1] + K3[0, 2]) / 3)
        + (0.8 + 0.1 * (K3[1, 0] + K3[1, 1]) / 2)
        + (-0.5 * math.exp(0.1) + 0.1 * K3[2, 0] / 1)
    ) / 3
    assert loss.item() == pytest.approx(expected, abs=ATOL)


def test_gspo_kl_metric_matches_trl_token_mean():
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=0.1)
    _, metrics = LOSSES["gspo"](make_inputs(log_ratios=GSPO_LOG_RATIOS, ref=True), settings)
    assert metrics["kl"] == pytest.approx(K3_SUM / 6, abs=1e-6)


# =========================================================================== #
# Edge cases
# =========================================================================== #


def _with_empty_third_sequence(requires_grad=False):
    inputs = make_inputs(requires_grad=requires_grad)
    inputs.completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    inputs.total_tokens = 5.0
    return inputs


def _without_third_sequence():
    inputs = make_inputs(slice(0, 2))
    inputs.total_tokens = 5.0  # totals of the 3-sequence batch are kept
    return inputs


@pytest.mark.parametrize("loss_type", sorted(LOSSES))
def test_all_padding_sequence_has_no_gradient(loss_type):
    inputs = _with_empty_third_sequence(requires_grad=True)
    loss, metrics = LOSSES[loss_type](inputs, SETTINGS)
    assert torch.isfinite(loss)
    loss.backward()
    assert inputs.logps.grad[2].tolist() == [0.0, 0.0, 0.0]
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize(
    "loss_type",
    [
        "grpo",
        "bnpo",
        "dr_grpo",
        "dapo",
        "gspo",
    ],
)
def test_all_padding_sequence_adds_nothing_to_the_loss(loss_type):
    with_empty, _ = LOSSES[loss_type](_with_empty_third_sequence(), SETTINGS)
    without, _ = LOSSES[loss_type](_without_third_sequence(), SETTINGS)
    assert with_empty.item() == pytest.approx(without.item(), abs=ATOL)


# =========================================================================== #
# vLLM's truncated importance sampling (importance_weights)
# =========================================================================== #


def test_importance_weights_scale_each_token_before_the_kl_term():
    """dapo with per-token weights w: sum(w * surrogate) / tokens, by hand; the KL term is not weighted."""
    mask = torch.tensor(MASK, dtype=torch.float32)
    weights = torch.full_like(mask, 0.5) * mask
    weights[0, 0] = 2.0  # one token at the cap
    plain = make_inputs(ref=True)
    weighted = make_inputs(ref=True)
    weighted.importance_weights = weights
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=0.1)
    loss_plain, metrics = LOSSES["dapo"](plain, settings)
    loss_weighted, _ = LOSSES["dapo"](weighted, settings)
    tokens = SEQ0 + SEQ1 + SEQ2
    kl_sum = metrics["kl"] * TOTAL_TOKENS  # the unweighted KL total
    surrogate = 2.0 * SEQ0[0] + 0.5 * (sum(tokens) - SEQ0[0])
    assert float(loss_weighted) == pytest.approx((surrogate + 0.1 * kl_sum) / TOTAL_TOKENS, rel=1e-5)
    assert float(loss_plain) == pytest.approx((TOKEN_SUM + 0.1 * kl_sum) / TOTAL_TOKENS, rel=1e-5)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_unit_importance_weights_change_nothing(name):
    plain = make_inputs(requires_grad=True)
    weighted = make_inputs(requires_grad=True)
    weighted.importance_weights = torch.tensor(MASK, dtype=torch.float32)
    loss_plain, _ = LOSSES[name](plain, LossSettings())
    loss_weighted, _ = LOSSES[name](weighted, LossSettings())
    loss_plain.backward()
    loss_weighted.backward()
    assert torch.equal(loss_plain.detach(), loss_weighted.detach())
    assert torch.allclose(plain.logps.grad, weighted.logps.grad, atol=0, rtol=0)


# =========================================================================== #
# Sequence-level importance sampling with every loss (TRL's importance_sampling_level="sequence")
# =========================================================================== #

SEQUENCE = LossSettings(epsilon=0.2, epsilon_high=0.28, sequence_level=True)


def test_sequence_level_grpo_is_gspo_in_value_and_gradient():
    ours = make_inputs(log_ratios=GSPO_LOG_RATIOS, requires_grad=True, ref=True)
    theirs = make_inputs(log_ratios=GSPO_LOG_RATIOS, requires_grad=True, ref=True)
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=0.1, sequence_level=True)
    loss, metrics = LOSSES["grpo"](ours, settings)
    expected, _ = LOSSES["gspo"](theirs, LossSettings(epsilon=0.2, epsilon_high=0.28, beta=0.1))
    loss.backward()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), abs=ATOL)
    torch.testing.assert_close(ours.logps.grad, theirs.logps.grad)


def test_sequence_level_dapo_hand_value():
    # every token of a sequence takes the sequence's ratio (seq0 clipped at 1.28, seq1 at 0.8, seq2 e^0.1);
    # dapo sums the 6 completion tokens' losses over the batch's 6 tokens
    loss, metrics = LOSSES["dapo"](make_inputs(log_ratios=GSPO_LOG_RATIOS), SEQUENCE)
    expected = (3 * -2.56 + 2 * 0.8 + 1 * -0.5 * math.exp(0.1)) / 6
    assert loss.item() == pytest.approx(expected, abs=ATOL)
    assert metrics["clip_ratio/high"] == pytest.approx(3 / 6) and metrics["clip_ratio/low"] == pytest.approx(2 / 6)
    token_level, _ = LOSSES["dapo"](make_inputs(log_ratios=GSPO_LOG_RATIOS), SETTINGS)
    assert abs(token_level.item() - expected) > 0.02  # the switch changes the loss


# =========================================================================== #
# CISPO, SAPO, two-sided clipping, off-policy masking (TRL 1.16's formulas)
# =========================================================================== #


def test_cispo_weights_the_log_prob_with_the_clipped_detached_ratio():
    settings = LossSettings(epsilon=0.2, epsilon_high=1.3)
    inputs = make_inputs(requires_grad=True)
    loss, _ = LOSSES["cispo"](inputs, settings)
    ratios, logps = torch.tensor(RATIOS), torch.tensor(LOGPS)
    weights = ratios.clamp(max=1.3)
    per_token = -weights * torch.tensor(ADVANTAGES)[:, None] * logps * torch.tensor(MASK, dtype=torch.float32)
    assert loss.item() == pytest.approx(float(per_token.sum()) / TOTAL_TOKENS, abs=ATOL)
    loss.backward()  # the gradient goes through logp only: -w x A / tokens
    expected = -weights * torch.tensor(ADVANTAGES)[:, None] * torch.tensor(MASK, dtype=torch.float32) / TOTAL_TOKENS
    torch.testing.assert_close(inputs.logps.grad, expected)


def test_sapo_soft_gate_per_sequence_mean():
    settings = LossSettings(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)
    loss, _ = LOSSES["sapo"](make_inputs(), settings)
    total = 0.0
    for ratios, advantage, mask in zip(RATIOS, ADVANTAGES, MASK):
        tau = 1.0 if advantage > 0 else 1.05
        terms = [-(1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau * advantage for r, m in zip(ratios, mask) if m]
        total += sum(terms) / len(terms)
    assert loss.item() == pytest.approx(total / 3, abs=ATOL)
    ones, _ = LOSSES["sapo"](make_inputs(num_iterations_one=True), settings)  # r = 1: the gate is 2 / tau
    assert ones.item() == pytest.approx(-(2.0 * 2 + 2 / 1.05 * -1.0 + 2.0 * 0.5) / 3, abs=ATOL)


def test_delta_caps_the_unclipped_ratio():
    plain, _ = LOSSES["dapo"](make_inputs(), SETTINGS)
    capped, _ = LOSSES["dapo"](make_inputs(), LossSettings(epsilon=0.2, epsilon_high=0.28, delta=1.3))
    # delta = 1.3 caps seq2 t0 (r = 1.4 > 1.28: clipped already) and nothing else with A > 0 below the clip,
    # but seq1 t0 (A < 0, r = 0.75 -> clipped to 0.8) takes min(min(r, 1.3) A, clip A): unchanged
    assert capped.item() == pytest.approx(plain.item(), abs=ATOL)
    tight, _ = LOSSES["dapo"](make_inputs(), LossSettings(epsilon=0.2, epsilon_high=0.28, delta=0.7))
    # delta 0.7: for A < 0 tokens the capped term 0.7 A is the larger loss candidate:
    # seq1 t0 -min(0.7 x -1, 0.8 x -1) = 0.8 (unchanged), seq1 t1 -min(0.7 x -1, 0.9 x -1) = 0.9 (unchanged);
    # for A > 0 tokens the cap lowers r A: seq0 t0 -min(0.7x2, 1.28x2) = -1.4, t1 -1.4, t2 -min(0.5x2, 0.8x2) = -1.0,
    # seq2 t0 -min(0.7 x 0.5, 1.28 x 0.5) = -0.35
    assert tight.item() == pytest.approx((-1.4 - 1.4 - 1.0 + 0.8 + 0.9 - 0.35) / TOTAL_TOKENS, abs=ATOL)


def test_off_policy_mask_equals_trl():
    trl = pytest.importorskip("trl")
    from hasten.algo.losses import off_policy_mask

    generator = torch.Generator().manual_seed(1)
    logps = -torch.rand(6, 5, generator=generator) * 3
    sampling = -torch.rand(6, 5, generator=generator) * 3
    mask = (torch.rand(6, 5, generator=generator) > 0.2).float()
    advantages = torch.tensor([1.0, -1.0, -0.5, 0.0, -2.0, 0.3])[:, None]
    kept = []
    for threshold in (-0.5, 0.0, 0.5, 1.0):
        ours = off_policy_mask(advantages, logps, sampling, mask, threshold)
        theirs = trl.GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask, threshold)
        torch.testing.assert_close(ours, theirs)
        kept.append(int(ours.sum()))
    assert min(kept) < 6 and max(kept) == 6  # some thresholds drop sequences, some keep all
    dropped, _ = LOSSES["dapo"](make_inputs(log_ratios=GSPO_LOG_RATIOS), LossSettings(off_policy_threshold=0.1))
    kept, _ = LOSSES["dapo"](make_inputs(log_ratios=GSPO_LOG_RATIOS), LossSettings())
    assert dropped.item() != pytest.approx(kept.item())  # seq1 (A < 0, mean KL 0.4 > 0.1) is dropped
