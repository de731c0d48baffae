"""speed.decode_attention's fused decode step (LeanEngine._fused_step): the work between a decode step's matmuls
in kernels/decode_attention.c, against torch's ops and the engine's own unfused step.

- RoPE writes torch's bits: the queries, and the keys and values in the cache (torch.equal with rotate()).
- The residual add is torch's bits; the norm equals F.rms_norm's composite to float rounding (its sum runs in
  another order), and where it casts to bf16, at most one bf16 step from torch's cast of torch's norm.
- SiLU(gate) * up: the same, to float rounding and one bf16 step.
- The engine samples the same tokens with the fused step as without, for a seed, at fp32 and bf16 sampling,
  Llama and Qwen2 (q/k/v bias), every norm weight its own, rows leaving mid-decode, with log-probs within float
  rounding; and the fused step did run.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import encode, head_dim_64_model

from hasten.kernels import decode_attention as kernels
from hasten.models.llama import rotate
from hasten.rollout import SamplingParams
from hasten.rollout.lean import GroupCache, LeanEngine

pytestmark = pytest.mark.skipif(kernels.unavailable_reason() is not None,
                                reason=f"fused decode kernels: {kernels.unavailable_reason()}")
BF16_STEP = 2.0**-7  # one bf16 step, relative (8 bits of mantissa)


def _within_one_bf16_step(fused: torch.Tensor, reference: torch.Tensor) -> None:
    difference = (fused.float() - reference.float()).abs()
    assert (difference <= BF16_STEP * reference.float().abs() + 1e-30).all()
    assert (fused == reference).float().mean().item() > 0.99  # a rounding that differs is rare


@pytest.mark.parametrize("delta_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_norm_is_the_residual_add_and_rms_norm(delta_dtype, out_dtype):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 576, generator=generator) * 3
    weight = torch.rand(576, generator=generator) + 0.5
    delta = None if delta_dtype is None else torch.randn(7, 576, generator=generator).to(delta_dtype)
    expected_hidden = hidden if delta is None else hidden + delta.float()
    expected = F.rms_norm(expected_hidden, (576,), weight, 1e-5)
    out = torch.empty(7, 576, dtype=out_dtype)
    kernels.add_norm(hidden, delta, weight, 1e-5, out)
    assert torch.equal(hidden, expected_hidden)  # updated in place, torch's add
    if out_dtype == torch.float32:
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    else:
        _within_one_bf16_step(out, expected.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_gate_times_up(dtype):
    generator = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(5, 2 * 256, generator=generator) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    out = kernels.silu_mul(gate_up, torch.empty(5, 256, dtype=dtype))
    if dtype == torch.float32:
        assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    else:
        _within_one_bf16_step(out, expected.to(torch.bfloat16))


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rope_writes_the_queries_and_the_cache_as_torch_does(dim, dtype, with_bias):
    generator = torch.Generator().manual_seed(2)
    rows, heads, kv_heads, slot = 6, 6, 2, 3
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    bias = torch.randn(qkv.shape[1], generator=generator) if with_bias else None
    cos, signed_sin = torch.randn(rows, dim, generator=generator), torch.randn(rows, dim, generator=generator)
    keys, values = torch.zeros(rows, kv_heads, 9, dim), torch.zeros(rows, kv_heads, 9, dim)
    query = torch.empty(rows, heads, 1, dim)
    kernels.rope(qkv, bias, heads, cos, signed_sin, query, keys, values, slot)
    full = qkv.float() if bias is None else qkv.float() + bias
    full = full.view(rows, 1, heads + 2 * kv_heads, dim)  # as LeanEngine._layers views it
    rotated = rotate(full[:, :, : heads + kv_heads].transpose(1, 2), cos[:, None, None], signed_sin[:, None, None])
    assert torch.equal(query, rotated[:, :heads])
    assert torch.equal(keys[:, :, slot], rotated[:, heads:, 0])
    assert torch.equal(values[:, :, slot], full[:, 0, heads + kv_heads:])
    untouched = [position for position in range(9) if position != slot]
    assert not keys[:, :, untouched].any() and not values[:, :, untouched].any()


def _with_norms_apart(model):
    """Every RMSNorm weight its own (transformers starts them all at 1): a swapped norm would show."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)
    return model


def _with_q_k_v_biases(model):
    """Qwen2's q/k/v biases, non-zero (transformers starts them at 0): a bias added in the wrong place would show."""
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.copy_(torch.randn(projection.bias.shape, generator=generator) * 0.5)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_engine_samples_the_same_with_the_fused_step(tokenizer, monkeypatch, family, precision):
    from hasten.device import cpu_has_native_bf16

    if precision == "bf16" and not cpu_has_native_bf16():
        pytest.skip("bf16 sampling needs a CPU with native bf16")
    model = _with_norms_apart(head_dim_64_model(len(tokenizer), family))
    if family == "qwen2":
        _with_q_k_v_biases(model)
    steps, kept = [], []
    fused_step, keep = LeanEngine._fused_step, GroupCache.keep
    monkeypatch.setattr(LeanEngine, "_fused_step", lambda self, *a: steps.append(1) or fused_step(self, *a))
    monkeypatch.setattr(GroupCache, "keep", lambda self, rows: kept[-1].append(len(rows)) or keep(self, rows))
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    stops = [tokenizer.eos_token_id, *range(3, 40)]  # a seventh of the vocabulary ends a row: rows leave mid-decode
    rollouts = []
    for fused in (False, True):
        kept.append([])
        engine = LeanEngine(model, tokenizer.pad_token_id, stops, precision, decode_attention=True)
        if not fused:
            monkeypatch.setattr(engine, "_fused_step_supported", lambda: False)
        rollouts.append(engine.generate(encode(tokenizer), 4, sampling, seed=7))
    assert len(steps) == rollouts[1].completion_mask.sum(-1).max().item() - 1  # every decode step fused
    assert kept[0] and kept[0] == kept[1]  # rows left mid-decode, the same on both paths; the cache followed
    assert torch.equal(rollouts[0].completion_ids, rollouts[1].completion_ids)
    assert torch.equal(rollouts[0].completion_mask, rollouts[1].completion_mask)
    tolerance = 1e-5 if precision == "fp32" else 2e-2  # bf16: a norm rounded one bf16 step the other way
    assert torch.allclose(rollouts[0].sampling_logprobs, rollouts[1].sampling_logprobs, atol=tolerance)


def test_the_fused_step_is_left_out_where_its_kernels_do_not_take_the_model(tokenizer, model):
    """int8 sampling, shared weights, the tiny model's head_dim 16 and a hooked head keep the unfused step."""
    llama = head_dim_64_model(len(tokenizer))
    on = LeanEngine(llama, tokenizer.pad_token_id, [2], decode_attention=True)
    on.sync_weights()
    assert on._fused_step_supported()
    assert not LeanEngine(llama, tokenizer.pad_token_id, [2])._fused_step_supported()  # the switch off
    shared = LeanEngine(llama, tokenizer.pad_token_id, [2], weights="shared", decode_attention=True)
    assert not shared._fused_step_supported()
    assert not LeanEngine(model, tokenizer.pad_token_id, [2], decode_attention=True)._fused_step_supported()
    from hasten.kernels import int8

    if int8.unavailable_reason() is None:
        quantized = LeanEngine(llama, tokenizer.pad_token_id, [2], "int8", decode_attention=True)
        quantized.use_precision("int8")
        assert not quantized._fused_step_supported()
    handle = llama.lm_head.register_forward_hook(lambda module, args, out: out)
    try:
        assert not on._fused_step_supported()
    finally:
        handle.remove()
