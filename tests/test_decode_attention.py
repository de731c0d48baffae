"""The lean engine's decode attention (GroupCache.attend_step) against a dense reference.

attend_step reads each prompt's K/V once per group through the (prompt, generation) grid and each
row's own K/V from a preallocated cache. The reference gives every row its own copy of its prompt's
real K/V followed by its own tokens' K/V, and runs plain softmax attention per query head in float64.
They must agree within 1e-5 at short and long own lengths, after finished rows are dropped (`keep()`,
the `rows` grid mapping), and when the prompts' K/V come from speed.shared_prefix's prefill.
The prefill and decode steps run in inference mode; the Rollout they fill must still be ordinary tensors.
"""

from __future__ import annotations

import types

import pytest
import torch
from conftest import encode

from hasten.rollout import SamplingParams
from hasten.rollout.lean import GroupCache, LeanEngine

PROMPTS, GENERATIONS, KV_HEADS, HEADS, HEAD_DIM, WIDTH, STEPS = 3, 4, 2, 6, 16, 9, 40


def _engine():
    """What GroupCache reads of a LeanEngine: head counts, the scale, the layers, the embedding's dtype."""
    embedding = types.SimpleNamespace(weight=torch.zeros(1))
    return types.SimpleNamespace(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5, layers=[0, 1],
                                 base=types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=embedding)))


def _mask():
    mask = torch.ones(PROMPTS, WIDTH, dtype=torch.long)  # left padding, as left_pad makes it
    mask[1, :4] = 0
    mask[2, :WIDTH - 1] = 0  # a one-token prompt
    return mask


def _cache(generator, shared=0):
    """A GroupCache whose prompts' K/V come from a prefill (plain, or a shared prefix then each rest)."""
    mask = _mask()
    if shared:
        mask[:, :shared] = 1
    cache = GroupCache(_engine(), mask, GENERATIONS, STEPS)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    for layer in range(2):
        if shared:
            if layer == 0:
                cache.share_prefix(shared)
            cache.attend_prefix(layer, randn(1, HEADS, shared, HEAD_DIM), randn(1, KV_HEADS, shared, HEAD_DIM),
                                randn(1, KV_HEADS, shared, HEAD_DIM))
            rest = WIDTH - shared
            cache.attend_rest(layer, randn(PROMPTS, HEADS, rest, HEAD_DIM), randn(PROMPTS, KV_HEADS, rest, HEAD_DIM),
                              randn(PROMPTS, KV_HEADS, rest, HEAD_DIM))
        else:
            cache.attend_prompt(layer, randn(PROMPTS, HEADS, WIDTH, HEAD_DIM),
                                randn(PROMPTS, KV_HEADS, WIDTH, HEAD_DIM), randn(PROMPTS, KV_HEADS, WIDTH, HEAD_DIM))
    return cache, mask


def _reference(cache, mask, layer, query, own_keys, own_values, grid_rows):
    """Dense attention per row: [its prompt's real K/V, its own K/V], float64, head h on KV head h // group."""
    prompt_keys, prompt_values = cache.prompt[layer]
    group = HEADS // KV_HEADS
    out = []
    for row, grid_row in enumerate(grid_rows.tolist()):
        prompt = grid_row // GENERATIONS
        real = mask[prompt].bool()
        keys = torch.cat([prompt_keys[prompt][:, real], own_keys[row]], dim=1).double()  # (kv, P_real + L, D)
        values = torch.cat([prompt_values[prompt][:, real], own_values[row]], dim=1).double()
        heads = []
        for head in range(HEADS):
            scores = keys[head // group] @ query[row, head, 0].double() * HEAD_DIM**-0.5  # (P_real + L,)
            heads.append(torch.softmax(scores, dim=0) @ values[head // group])  # (D,)
        out.append(torch.cat(heads))
    return torch.stack(out)[:, None]  # (N, 1, heads * D)


def _steps(cache, mask, generator, count, drop_at=()):
    """Run `count` decode steps on both layers, dropping rows at the steps in drop_at; compare every step."""
    rows = PROMPTS * GENERATIONS
    grid_rows = torch.arange(rows)
    own = [([], []) for _ in range(2)]  # per layer, each row's own keys and values so far
    worst = 0.0
    for step in range(count):
        if step in drop_at:
            keep = torch.arange(0, rows, 2) if rows > 1 else torch.arange(rows)
            cache.keep(keep)
            grid_rows, rows = grid_rows[keep], len(keep)
            own = [([k[keep] for k in keys], [v[keep] for v in values]) for keys, values in own]
        for layer in range(2):
            query = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=generator) * 3  # peaked softmaxes too
            key = torch.randn(rows, KV_HEADS, 1, HEAD_DIM, generator=generator)
            value = torch.randn(rows, KV_HEADS, 1, HEAD_DIM, generator=generator)
            own[layer][0].append(key[:, :, 0])
            own[layer][1].append(value[:, :, 0])
            got = cache.attend_step(layer, query, key, value)
            expected = _reference(cache, mask, layer, query, torch.stack(own[layer][0], dim=2),
                                  torch.stack(own[layer][1], dim=2), grid_rows)
            assert got.shape == (rows, 1, HEADS * HEAD_DIM)
            worst = max(worst, (got.double() - expected).abs().max().item())
        cache.length += 1
    assert worst < 1e-5, worst


@pytest.mark.parametrize("shared", [0, 5], ids=["prefill", "shared prefix"])
def test_attend_step_equals_dense_attention_as_the_own_part_grows(shared):
    generator = torch.Generator().manual_seed(0)
    cache, mask = _cache(generator, shared)
    _steps(cache, mask, generator, STEPS - 1)  # own lengths 1 .. STEPS - 1: the whole preallocated cache


@pytest.mark.parametrize("shared", [0, 5], ids=["prefill", "shared prefix"])
def test_attend_step_equals_dense_attention_after_rows_are_dropped(shared):
    generator = torch.Generator().manual_seed(1)
    cache, mask = _cache(generator, shared)
    _steps(cache, mask, generator, 30, drop_at=(3, 17, 25))  # 12 -> 6 -> 3 -> 2 rows through the grid


def test_generate_hands_back_normal_tensors_the_learner_can_use(short_model, tokenizer):
    """The prefill and decode steps run in inference mode; the Rollout must not carry inference tensors,
    which autograd cannot save for backward and which cannot be updated in place outside that mode."""
    engine = LeanEngine(short_model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    rollout = engine.generate(encode(tokenizer), 3, SamplingParams(max_new_tokens=10, temperature=1.0), seed=0)
    fields = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_logprobs", "ended_with_eos")
    assert not any(getattr(rollout, name).is_inference() for name in fields)
    weight = torch.ones_like(rollout.sampling_logprobs, requires_grad=True)
    (weight * rollout.sampling_logprobs).sum().backward()  # saves the log-probs for backward
    assert torch.equal(weight.grad, rollout.sampling_logprobs)
    rollout.completion_mask[:, 0] = 1  # in place, as a learner may mask
