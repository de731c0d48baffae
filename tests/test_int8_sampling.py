"""generation.precision=int8 (kernels/int8.py, rollout/lean.py): sampled rollouts on smoothed int8
matmuls, greedy calls on the fp32 weights, and the learner's truncated importance-sampling correction
(train/learner.py's Correction), equal to TRL 1.16's token_truncate correction on crafted tensors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import encode, fp32_and_low_precision, letters_config, run_metrics

from hasten.algo import LOSSES, LossInputs, LossSettings
from hasten.errors import UserError
from hasten.kernels import int8
from hasten.rollout import SamplingParams
from hasten.rollout.lean import Matmul
from hasten.train.learner import Correction, OffPolicyStats
from hasten.train.logprobs import completion_logprobs

pytestmark = pytest.mark.skipif(int8.unavailable_reason() is not None, reason="no int8 kernels in this torch build")

# The bound a sampled token's int8 log-prob keeps from the fp32 learner's on the tiny test model (its
# activations have no outliers). On SmolLM2-135M the mean gap is ~0.1 nats (docs/speedups.md): what the
# importance weights then correct.
TINY_MEAN_GAP = 0.01
TINY_MAX_GAP = 0.05


def engines(model, tokenizer):
    return fp32_and_low_precision(model, tokenizer, "int8")


def test_int8_linear_is_the_dequantized_weight_within_activation_rounding():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(6, 64), torch.randn(32, 64) * 0.1, torch.randn(32)
    prepared = int8.prepare(weight)
    assert prepared.inverse_smoothing is None  # nothing seen yet: plain per-channel int8
    out = int8.linear(x, prepared, bias)
    reference = F.linear(x, int8.dequantized(weight), bias)
    # activations are rounded to 1/255 of their range, per call: that alone separates the two
    step = float(x.abs().max()) / 127
    assert (out - reference).abs().max() < step * weight.abs().sum(dim=1).max()
    assert (out - F.linear(x, weight, bias)).abs().max() < 0.05 * F.linear(x, weight).abs().max()
    assert torch.equal(prepared.activation_absmax, x.abs().amax(dim=0))  # what the next sync smooths by


def test_smoothing_moves_an_outlier_channel_into_the_weight():
    torch.manual_seed(1)
    weight = torch.randn(48, 64) * 0.1
    x = torch.randn(16, 64)
    x[:, 3] *= 200.0  # one channel carries an outlier, as LLM activations do
    plain = int8.prepare(weight)
    int8.linear(x, plain)  # records max |x| per channel
    smoothed = int8.prepare(weight, plain.activation_absmax)
    factors = int8.smoothing(plain.activation_absmax, weight)
    assert torch.allclose(smoothed.inverse_smoothing, 1 / factors)
    exact = F.linear(x, weight)
    plain_error = (int8.linear(x, plain) - exact).abs().mean()
    smoothed_error = (int8.linear(x, smoothed) - exact).abs().mean()
    assert smoothed_error < plain_error / 3


def test_int8_matmul_keeps_an_exact_weight_fp32():
    torch.manual_seed(2)
    matmul = Matmul(torch.float32, torch.device("cpu"), "int8")
    x, weight = torch.randn(5, 32), torch.randn(16, 32)
    exact = matmul.prepare(weight, exact=True)
    assert isinstance(exact, torch.Tensor)  # bf16 where the CPU has bf16 matmuls, else fp32 (oneDNN-packed)
    expected = (F.linear(x.bfloat16(), weight.bfloat16()).float() if matmul.exact.precision == "bf16"
                else F.linear(x, weight))
    assert torch.allclose(matmul(x, exact), expected, atol=1e-5)
    assert isinstance(matmul.prepare(weight, name="w"), int8.Int8Weight)
    with pytest.raises(ValueError, match="precision"):
        Matmul(torch.float32, torch.device("cpu"), "int4")


def test_greedy_calls_stay_fp32_and_the_int8_copy_follows_updates(model, tokenizer):
    model = copy.deepcopy(model)
    plain, quantized = engines(model, tokenizer)
    prompts = encode(tokenizer)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0)
    quantized.generate(prompts, 2, sampled, seed=0)
    assert isinstance(quantized.layers[0].qkv, int8.Int8Weight)
    assert isinstance(quantized.layers[0].down, torch.Tensor)  # down_proj stays bf16/fp32 (massive activations)
    assert quantized.layers[0].qkv.inverse_smoothing is None  # the first sync saw no activations
    expected, actual = plain.generate(prompts, 2, greedy, seed=0), quantized.generate(prompts, 2, greedy, seed=0)
    assert torch.equal(expected.completion_ids, actual.completion_ids)
    assert torch.equal(expected.sampling_logprobs, actual.sampling_logprobs)
    assert isinstance(quantized.layers[0].qkv, torch.Tensor)  # one sampling copy at a time: int8 freed
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.5)
    quantized.weights_changed()
    quantized.generate(prompts, 2, sampled, seed=1)
    layer = model.model.layers[0].self_attn
    fused = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight])
    qkv = quantized.layers[0].qkv
    assert qkv.inverse_smoothing is not None  # smoothed by the statistics of the sampled call before the eval
    x = torch.randn(3, fused.shape[1])
    unsmoothed = torch.ops.quantized.linear_dynamic(x * qkv.inverse_smoothing, qkv.packed, int8.reduce_range())
    unsmoothed = unsmoothed * qkv.output_scales  # the packed levels are per-tensor; the row scales come after
    exact = F.linear(x, fused).detach()
    assert torch.allclose(unsmoothed, exact, atol=0.05 * float(exact.abs().max()))


def test_sampled_rollouts_come_from_the_int8_policy_close_to_fp32(model, tokenizer):
    plain, quantized = engines(model, tokenizer)
    prompts = encode(tokenizer)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    quantized.generate(prompts, 4, sampling, seed=2)  # statistics for the smoothing, as a run's first step
    quantized.weights_changed()
    rollout = quantized.generate(prompts, 4, sampling, seed=3)
    group = torch.arange(rollout.num_samples) // 4
    stats = completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                rollout.completion_ids, rollout.completion_mask, temperature=1.0)
    mask = rollout.completion_mask.bool()
    gap = (stats.logps - rollout.sampling_logprobs)[mask].abs()
    assert 0 < gap.mean() < TINY_MEAN_GAP and gap.max() < TINY_MAX_GAP
    same = plain.generate(prompts, 4, sampling, seed=3)
    assert (same.completion_ids == rollout.completion_ids).float().mean() > 0.7  # same seeded draws


def test_off_policy_stats_report_kl_and_the_truncated_fraction():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, 0.0]])
    sampled = torch.tensor([[-1.5, -1.0, -0.5], [-1.4, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    stats = OffPolicyStats("int8_sampler", cap=2.0)
    stats.add(logps, sampled, mask)
    diff = torch.tensor([0.5, -1.0, 0.0, 1.2, 0.0])  # log r over the five masked-in tokens
    ratio = diff.exp()
    metrics = stats.metrics()
    assert metrics["int8_sampler/logp_abs_diff"] == pytest.approx(float(diff.abs().mean()))
    assert metrics["int8_sampler/kl"] == pytest.approx(float((ratio - 1 - diff).mean()))
    assert metrics["int8_sampler/truncated_fraction"] == pytest.approx(1 / 5)  # only e^1.2 > 2
    assert metrics["int8_sampler/ratio_max"] == pytest.approx(float(ratio.max()))
    assert "async/truncated_fraction" not in OffPolicyStats("async").metrics()


def trl_truncated_ratio(old, sampling, mask, clip_max):
    """TRL 1.16's vllm importance-sampling ratio, vllm_importance_sampling_mode="token_truncate"
    (GRPOTrainer._generate_and_score_completions): exp((old - sampling) * mask), nan -> 0, clamped."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    return torch.clamp(torch.exp(diff), min=None, max=clip_max)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_the_corrected_loss_equals_trls_token_truncate_correction(loss_type):
    from test_entropy_and_kl import MAX_LENGTH, crafted, trl_trainer

    cap = 2.0
    logps, old, _, entropies, advantages, mask = crafted(seed=3)
    sampling = old + 0.6 * torch.randn(old.shape, generator=torch.Generator().manual_seed(4))  # some ratios > cap
    correction = Correction(cap=cap, sampler="int8_sampler")
    trackers = correction.trackers()
    anchored, weights = correction.anchor(old, sampling, mask, trackers)
    assert torch.equal(anchored, old)  # on-policy weights otherwise: the ratio is against the learner's own
    assert trackers[1].metrics()["int8_sampler/truncated_fraction"] > 0
    ours_logps = logps.clone().requires_grad_(True)
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=0.0)
    inputs = LossInputs(ours_logps, old, None, advantages, mask, float(mask.sum()), mask.shape[0], MAX_LENGTH,
                        importance_weights=weights)
    ours, _ = LOSSES[loss_type](inputs, settings)
    trainer = trl_trainer(loss_type)
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    theirs_logps = logps.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (theirs_logps, entropies, None)
    ratio = trl_truncated_ratio(old, sampling, mask, cap)
    assert torch.allclose(weights, ratio * mask)  # equal where the loss reads them
    trl_module = pytest.importorskip("trl.trainer.grpo_trainer")
    count = mask.shape[0]
    theirs = trl_module.GRPOTrainer._compute_loss(trainer, None, {
        "prompt_ids": torch.zeros(count, 1, dtype=torch.long), "prompt_mask": torch.ones(count, 1),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask,
        "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum(),
        "importance_sampling_ratio": ratio})
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_logps.grad, theirs_logps.grad, atol=1e-7)


@pytest.fixture
def data(letters_task):
    return letters_task


def test_training_corrects_and_logs_the_int8_sampler(data):
    from hasten.train.trainer import train

    summary = train(letters_config(data, "int8", **{"train.steps": 3, "generation.precision": "int8"}),
                    log=lambda _: None)
    records = run_metrics(summary)
    assert len(records) == 3
    for record in records:
        assert 0 < record["int8_sampler/logp_abs_diff"] < TINY_MEAN_GAP
        assert record["int8_sampler/kl"] >= 0
        assert 0 <= record["int8_sampler/truncated_fraction"] <= 1
        assert torch.isfinite(torch.tensor(record["loss"]))


def test_int8_sampling_refuses_what_it_cannot_honour(data, monkeypatch):
    from hasten.train.trainer import train

    with pytest.raises(UserError, match="speed.engine=hf"):
        train(letters_config(data, "hf", **{"generation.precision": "int8", "speed.engine": "hf"}),
              log=lambda _: None)
    with pytest.raises(UserError, match="async_steps"):
        train(letters_config(data, "async", **{"generation.precision": "int8", "algo.async_steps": 1}),
              log=lambda _: None)
    monkeypatch.setattr(int8, "unavailable_reason", lambda: "no fbgemm here")
    with pytest.raises(UserError, match="no fbgemm here"):
        train(letters_config(data, "refused", **{"generation.precision": "int8"}), log=lambda _: None)
    assert not (data / "runs" / "refused").exists()
