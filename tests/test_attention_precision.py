"""train.attention_fp32 and grouped attention's gathers: the faster forms compute the same thing.

- `attention()` is F.scaled_dot_product_attention outside a Precision.autocast()
  block, fp32 inside one with attention_fp32 on, autocast's bf16 with it off;
- `take_rows` (a gather whose backward is index_add_) gives source[index]'s
  values and gradients, repeated indices included;
- grouped attention (one output gather) equals the dense kernel under the
  block mask, values and gradients, also when every completion is one token;
- a bf16 learning pass with fp32 attention stays within bf16 rounding of fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rollout_of
from hasten.kernels.grouped_attention import build_layout, grouped_attention_forward, take_rows
from hasten.kernels.precision import Precision, attention, resolve_attention_fp32
from hasten.train.packing import block_mask, packed_logprobs


def qkv(rows=2, heads=4, kv_heads=2, length=6, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(rows, heads, length, dim), (rows, kv_heads, length, dim), (rows, kv_heads, length, dim)]
    return [torch.randn(shape, generator=generator, requires_grad=True) for shape in shapes]


def test_attention_is_fp32_only_inside_a_bf16_block_with_the_switch_on():
    query, key, value = (t.detach().to(torch.bfloat16) for t in qkv())
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    reference = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask,
                                               enable_gqa=True)
    with Precision("bf16", torch.device("cpu"), attention_fp32=True).autocast():
        fp32 = attention(query, key, value, attn_mask=mask, enable_gqa=True)
    with Precision("bf16", torch.device("cpu"), attention_fp32=False).autocast():
        autocast = attention(query, key, value, attn_mask=mask, enable_gqa=True)
    plain = attention(query, key, value, attn_mask=mask, enable_gqa=True)
    assert fp32.dtype == torch.float32 and torch.equal(fp32, reference)
    assert autocast.dtype == torch.bfloat16
    assert torch.equal(plain, F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True))
    # the switch does not leak out of its block
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention(query, key, value, attn_mask=mask, enable_gqa=True).dtype == torch.bfloat16


def test_auto_means_cpu_only():
    assert resolve_attention_fp32("auto", torch.device("cpu")) is True
    assert resolve_attention_fp32("auto", torch.device("cuda")) is False
    assert resolve_attention_fp32(False, torch.device("cpu")) is False
    assert resolve_attention_fp32(True, torch.device("cuda")) is True


def test_take_rows_equals_indexing_with_repeats():
    source = torch.randn(7, 3, 4, requires_grad=True)
    index = torch.tensor([[0, 2, 2, 6], [1, 0, 0, 0], [5, 5, 3, 2]])  # repeats: the backward must sum them
    weights = torch.randn(3, 4, 3, 4)
    expected_out = source[index]
    (expected_grad,) = torch.autograd.grad((expected_out * weights).sum(), source)
    out = take_rows(source, index)
    (grad,) = torch.autograd.grad((out * weights).sum(), source)
    assert torch.equal(out, expected_out)
    assert torch.allclose(grad, expected_grad, atol=1e-6)


@pytest.mark.parametrize("segments", [
    [[0, 0, 1, 1, 2], [0, 1, 1, -1, -1]],  # two groups, completions of 2, 1 and 2 inputs, padding
    [[0, 0, 0, -1, -1], [0, 0, -1, -1, -1]],  # only prompts: every completion was one token
])
def test_grouped_attention_equals_dense_under_the_block_mask(segments):
    segments = torch.tensor(segments)
    rows, length = segments.shape
    query, key, value = qkv(rows=rows, length=length)
    weights = torch.randn(rows, length, 4, 8)
    valid = (segments != -1)[:, :, None, None]  # padding positions are never read downstream

    def run(grouped):
        if grouped:
            out, _ = grouped_attention_forward(None, query, key, value, None, hasten_layout=build_layout(segments))
        else:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=block_mask(segments),
                                                 enable_gqa=True).transpose(1, 2)
        out = out * valid
        return out, torch.autograd.grad((out * weights).sum(), (query, key, value))

    dense, dense_grads = run(False)
    grouped, grouped_grads = run(True)
    assert torch.allclose(grouped, dense, atol=1e-6)
    for a, b in zip(grouped_grads, dense_grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_bf16_pass_with_fp32_attention_stays_near_fp32(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    rows = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask.bool()
    weights = torch.randn(rollout.completion_ids.shape) * rollout.completion_mask

    def run(precision, attention_fp32=True):
        short_model.zero_grad()
        with Precision(precision, torch.device("cpu"), attention_fp32=attention_fp32).autocast():
            logps = packed_logprobs(short_model, rollout, rows, 1.0, False, 0, grouped=True).logps
        (logps * weights).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in short_model.parameters() if p.grad is not None])
        return logps.detach(), grad

    fp32_logps, fp32_grad = run("fp32")
    for attention_fp32 in (True, False):
        logps, grad = run("bf16", attention_fp32)
        assert (logps - fp32_logps)[mask].abs().max() < 0.05  # bf16 matmuls: ~3 significant digits
        assert F.cosine_similarity(grad, fp32_grad, dim=0) > 0.99
