"""generation.precision=bf16 (rollout/lean.py): sampled rollouts on bf16 matmuls, greedy calls on
the fp32 weights, and the learner's truncated importance-sampling correction against the bf16 sampler."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import encode, fp32_and_low_precision, letters_config, run_metrics
from hasten.errors import UserError
from hasten.rollout import SamplingParams
from hasten.rollout.lean import Matmul
from hasten.train.logprobs import completion_logprobs

def engines(model, tokenizer):
    return fp32_and_low_precision(model, tokenizer, "bf16")


def test_bf16_matmul_is_f_linear_in_bf16_with_fp32_output():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(5, 64), torch.randn(32, 64), torch.randn(32)
    matmul = Matmul(torch.float32, torch.device("cpu"), "bf16")
    prepared = matmul.prepare(weight)
    assert prepared.dtype == torch.bfloat16  # oneDNN-packed where torch can (matmul.packed), else plain
    out = matmul(x, prepared, bias)
    assert out.dtype == torch.float32
    expected = F.linear(x.bfloat16(), weight.bfloat16()).float() + bias
    assert torch.equal(out, expected)
    assert (out - F.linear(x, weight, bias)).abs().max() < 0.2  # bf16 rounding, not another function


def test_bf16_weights_follow_updates_in_place_and_never_alias_the_model(model, tokenizer):
    # The bf16 copies are rewritten in place at each sync (a stable heap), so they must
    # still follow every update, and a bf16 model's own weights must never be overwritten.
    model = copy.deepcopy(model)
    engine = engines(model, tokenizer)[1]
    sampled = SamplingParams(max_new_tokens=4, temperature=1.0)
    engine.ready_for(sampled)
    before = engine.layers[0].qkv
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01)
    engine.weights_changed()
    engine.ready_for(sampled)
    layer = model.model.layers[0].self_attn
    expected = torch.cat([layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight]).bfloat16()
    assert engine.layers[0].qkv is before  # rewritten in place
    x = torch.randn(3, expected.shape[1])
    assert torch.equal(engine.linear(x, engine.layers[0].qkv), F.linear(x.bfloat16(), expected).float())
    head = model.lm_head.weight.bfloat16()
    assert torch.equal(engine.linear(x, engine.head), F.linear(x.bfloat16(), head).float())
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    matmul = Matmul(torch.float32, torch.device("cpu"), "bf16")
    weight = bf16_model.model.layers[0].mlp.down_proj.weight
    original = weight.detach().clone()
    prepared = matmul.prepare(weight)
    matmul.prepare(weight + 1, prepared)  # an overwrite lands in the engine's copy only, never the model
    assert torch.equal(weight, original)
    x = torch.randn(3, weight.shape[1])
    assert torch.equal(matmul(x, prepared), F.linear(x.bfloat16(), weight + 1).float())


def test_greedy_calls_stay_fp32_and_identical(model, tokenizer):
    plain, bf16 = engines(model, tokenizer)
    prompts = encode(tokenizer)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    expected, actual = plain.generate(prompts, 2, greedy, seed=0), bf16.generate(prompts, 2, greedy, seed=0)
    assert torch.equal(expected.completion_ids, actual.completion_ids)
    assert torch.equal(expected.sampling_logprobs, actual.sampling_logprobs)
    # and back and forth: each switch rebuilds the weights in the precision of the call
    sampled = SamplingParams(max_new_tokens=16, temperature=1.0)
    bf16.generate(prompts, 2, sampled, seed=0)
    assert bf16.layers[0].qkv.dtype == torch.bfloat16
    again = bf16.generate(prompts, 2, greedy, seed=0)
    assert torch.equal(again.completion_ids, expected.completion_ids)


def test_sampled_rollouts_come_from_the_bf16_policy_close_to_fp32(model, tokenizer):
    plain, bf16 = engines(model, tokenizer)
    prompts = encode(tokenizer)
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    rollout = bf16.generate(prompts, 4, sampling, seed=3)
    assert bf16.layers[0].qkv.dtype == torch.bfloat16
    group = torch.arange(rollout.num_samples) // 4
    stats = completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                rollout.completion_ids, rollout.completion_mask, temperature=1.0)
    gap = ((stats.logps - rollout.sampling_logprobs) * rollout.completion_mask).abs()
    assert 0 < gap.max() < 0.1  # another sampler (bf16 rounding), but the same policy
    same = plain.generate(prompts, 4, sampling, seed=3)
    agree = (same.completion_ids == rollout.completion_ids).float().mean()
    assert agree > 0.8  # same seeded draws: most tokens agree, as rounding only moves CDF steps a little


@pytest.fixture
def data(letters_task):
    return letters_task


def config(data: Path, name: str, **extra):
    return letters_config(data, name, **{"train.steps": 3, **extra})


def test_training_corrects_and_logs_the_bf16_sampler(data, monkeypatch):
    from hasten import device
    from hasten.train.trainer import train

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)  # the CI machine may lack it
    summary = train(config(data, "bf16", **{"generation.precision": "bf16"}), log=lambda _: None)
    records = run_metrics(summary)
    assert len(records) == 3
    for record in records:
        assert 0 < record["bf16_sampler/logp_abs_diff"] < 0.1
        assert record["bf16_sampler/ratio_max"] <= 2.0 + 1e-6  # the TIS cap (algo.vllm_importance_sampling_cap)
        assert torch.isfinite(torch.tensor(record["loss"]))
    plain = train(config(data, "fp32"), log=lambda _: None)
    fp32_records = run_metrics(plain)
    assert not any(key.startswith("bf16_sampler/") for key in fp32_records[0])


@pytest.mark.parametrize("extra, culprit", [
    ({"speed.engine": "hf"}, "speed.engine=hf"),
    ({}, "no native bf16"),
])
def test_bf16_sampling_refuses_what_it_cannot_honour(data, monkeypatch, extra, culprit):
    from hasten import device
    from hasten.train.trainer import train

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(UserError, match=culprit):
        train(config(data, "refused", **{"generation.precision": "bf16", **extra}), log=lambda _: None)
    assert not (data / "runs" / "refused").exists()
