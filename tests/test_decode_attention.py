"""The lean engine's decode attention (GroupCache.attend_step) against a dense reference.

attend_step reads each prompt's K/V once per group through the (prompt, generation) grid and each
row's own K/V from a preallocated cache. The reference gives every row its own copy of its prompt's
real K/V followed by its own tokens' K/V, and runs plain softmax attention per query head in float64.
They must agree within 1e-5 at short and long own lengths, after finished rows are dropped (`keep()`,
the `rows` grid mapping), and when the prompts' K/V come from speed.shared_prefix's prefill; with
speed.decode_attention's fused kernel (kernels/decode_attention.py) too, at the head shapes it takes
(head_dim 64 and 128; 1, 3, 6 and 7 query heads per KV head), and the engine samples the same tokens with
it as without.
The prefill and decode steps run in inference mode; the Rollout they fill must still be ordinary tensors.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import pytest
import torch
from conftest import encode, head_dim_64_model

from hasten.kernels import decode_attention
from hasten.rollout import SamplingParams
from hasten.rollout.lean import GroupCache, LeanEngine

PROMPTS, GENERATIONS, WIDTH, STEPS = 3, 4, 9, 40


class Heads(NamedTuple):
    kv: int
    heads: int
    dim: int


SMALL = Heads(2, 6, 16)
FUSED = [Heads(3, 9, 64), Heads(2, 14, 64), Heads(2, 12, 128), Heads(2, 2, 64)]  # SmolLM2, Qwen2.5 0.5B/1.5B, MHA
FUSED_IDS = ["3x3 d64", "2x7 d64", "2x6 d128", "2x1 d64"]
needs_kernel = pytest.mark.skipif(decode_attention.unavailable_reason() is not None,
                                  reason=f"fused decode attention: {decode_attention.unavailable_reason()}")


def _engine(shape=SMALL, fused=False):
    """What GroupCache reads of a LeanEngine: head counts, the scale, the layers, the embedding's dtype."""
    embedding = types.SimpleNamespace(weight=torch.zeros(1))
    return types.SimpleNamespace(num_kv_heads=shape.kv, head_dim=shape.dim, scale=shape.dim**-0.5, layers=[0, 1],
                                 decode_attention=fused,
                                 base=types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=embedding)))


def _mask():
    mask = torch.ones(PROMPTS, WIDTH, dtype=torch.long)  # left padding, as left_pad makes it
    mask[1, :4] = 0
    mask[2, :WIDTH - 1] = 0  # a one-token prompt
    return mask


def _cache(generator, shared=0, shape=SMALL, fused=False):
    """A GroupCache whose prompts' K/V come from a prefill (plain, or a shared prefix then each rest)."""
    mask = _mask()
    if shared:
        mask[:, :shared] = 1
    KV_HEADS, HEADS, HEAD_DIM = shape
    cache = GroupCache(_engine(shape, fused), mask, GENERATIONS, STEPS)
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
    HEADS, HEAD_DIM = query.shape[1], query.shape[3]
    KV_HEADS = own_keys.shape[1]
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


def _steps(cache, mask, generator, count, drop_at=(), shape=SMALL):
    """Run `count` decode steps on both layers, dropping rows at the steps in drop_at; compare every step."""
    KV_HEADS, HEADS, HEAD_DIM = shape
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
            if cache.fused:  # the kernel itself answers where it takes the shape, not torch's path behind it
                own_keys, own_values = cache.own[layer]
                own_keys[:, :, cache.length], own_values[:, :, cache.length] = key[:, :, 0], value[:, :, 0]
                prompt_keys, prompt_values = cache.prompt[layer]
                answer = decode_attention.attend(query, cache.engine.scale, prompt_keys, prompt_values,
                                                 cache.bias_rows, cache.prompt_of_row, own_keys, own_values,
                                                 cache.length + 1)
                takes = decode_attention.supports(HEAD_DIM, HEADS // KV_HEADS, query.dtype, query.device)
                assert (answer is not None) == takes
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


@needs_kernel
@pytest.mark.parametrize("shape", FUSED, ids=FUSED_IDS)
@pytest.mark.parametrize("shared", [0, 5], ids=["prefill", "shared prefix"])
def test_fused_decode_attention_equals_dense_attention(shape, shared):
    """speed.decode_attention's kernel: the same contract, as the own part grows and as rows are dropped."""
    generator = torch.Generator().manual_seed(2)
    cache, mask = _cache(generator, shared, shape, fused=True)
    _steps(cache, mask, generator, 30, drop_at=(9, 21), shape=shape)


@needs_kernel
def test_fused_decode_attention_equals_torchs_path_at_a_long_own_part():
    """At 600 own tokens (past any small-length special case), the kernel and torch's path agree."""
    generator = torch.Generator().manual_seed(3)
    shape = FUSED[0]
    caches = []
    for fused in (False, True):
        mask = _mask()
        cache = GroupCache(_engine(shape, fused), mask, GENERATIONS, 602)
        generator.manual_seed(3)
        for layer in range(2):
            cache.attend_prompt(layer, *(torch.randn(PROMPTS, n, WIDTH, shape.dim, generator=generator)
                                         for n in (shape.heads, shape.kv, shape.kv)))
        for keys, values in cache.own:
            keys.normal_(generator=generator), values.normal_(generator=generator)
        cache.length = 600
        caches.append(cache)
    query = torch.randn(PROMPTS * GENERATIONS, shape.heads, 1, shape.dim, generator=generator) * 3
    key, value = (torch.randn(PROMPTS * GENERATIONS, shape.kv, 1, shape.dim, generator=generator) for _ in range(2))
    plain, fused = (cache.attend_step(1, query, key, value) for cache in caches)
    assert (plain - fused).abs().max().item() < 1e-5


def test_the_fused_kernel_declines_what_it_does_not_take():
    """head_dim 16, a bf16 cache or 9 query heads per KV head: attend returns None and the cache runs torch."""
    assert not decode_attention.supports(16, 3, torch.float32, torch.device("cpu"))
    assert not decode_attention.supports(64, 3, torch.bfloat16, torch.device("cpu"))
    assert not decode_attention.supports(64, 9, torch.float32, torch.device("cpu"))
    assert decode_attention.supports(128, 6, torch.float32, torch.device("cpu"))
    generator = torch.Generator().manual_seed(4)
    cache, mask = _cache(generator, 0, SMALL, fused=True)  # head_dim 16: torch's path, the same contract
    _steps(cache, mask, generator, 5)


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


@needs_kernel
def test_the_engine_samples_the_same_with_the_fused_kernel(tokenizer, monkeypatch):
    """LeanEngine with speed.decode_attention on and off: the same tokens for a seed, log-probs within 1e-5,
    and the kernel (not torch's path) answered every decode step's attention."""
    model = head_dim_64_model(len(tokenizer))
    answered = []
    attend = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda *a: answered.append(attend(*a)) or answered[-1])
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    rollouts = [LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], decode_attention=fused)
                .generate(encode(tokenizer), 4, sampling, seed=7) for fused in (False, True)]
    assert answered and all(out is not None for out in answered)
    assert len(answered) == 2 * (rollouts[1].completion_mask.sum(-1).max().item() - 1)  # 2 layers a step
    assert torch.equal(rollouts[0].completion_ids, rollouts[1].completion_ids)
    assert torch.equal(rollouts[0].completion_mask, rollouts[1].completion_mask)
    assert torch.allclose(rollouts[0].sampling_logprobs, rollouts[1].sampling_logprobs, atol=1e-5)


def test_the_engine_turns_the_kernel_on_only_for_heads_it_takes(tokenizer, model):
    """LeanEngine.decode_attention (what the run's plan line reports) is on only where the kernel takes
    the model: head_dim 64 here, not the tiny model's 16, and never when the switch is off."""
    on = LeanEngine(head_dim_64_model(len(tokenizer)), tokenizer.pad_token_id, [2], decode_attention=True)
    assert on.decode_attention is True
    assert LeanEngine(model, tokenizer.pad_token_id, [2], decode_attention=True).decode_attention is False
    assert LeanEngine(head_dim_64_model(len(tokenizer)), tokenizer.pad_token_id, [2]).decode_attention is False


def test_decode_attention_auto_falls_back_with_a_log_line_and_true_is_a_config_error(monkeypatch):
    """resolve: auto keeps torch's path with one line on a CPU that cannot (quietly on a GPU); true is exit 2."""
    from hasten.config import ConfigError

    monkeypatch.setattr(decode_attention, "unavailable_reason", lambda: "the CPU has no AVX-512")
    lines = []
    assert decode_attention.resolve("auto", "cpu", lines.append) is False
    assert lines == ["speed.decode_attention=auto: torch's decode attention (the CPU has no AVX-512)"]
    assert decode_attention.resolve(False, "cpu", lines.append) is False
    with pytest.raises(ConfigError, match=r"speed.decode_attention=true.*no AVX-512"):
        decode_attention.resolve(True, "cpu")
    monkeypatch.setattr(decode_attention, "unavailable_reason", lambda: None)
    assert decode_attention.resolve("auto", "cpu", lines.append) is True and len(lines) == 1
    assert decode_attention.resolve("auto", "cuda", lines.append) is False and len(lines) == 1  # quiet: not a CPU
    with pytest.raises(ConfigError, match=r"speed.decode_attention=true.*model is on cuda"):
        decode_attention.resolve(True, "cuda")


def test_the_kernel_builds_into_the_cache_once_and_refuses_a_library_others_can_write(tmp_path, monkeypatch):
    """The first-run path: an empty $HASTEN_CACHE gets kernels/decode_attention-<key>.so, mode 0700; a
    second build reuses it; a library writable by others is not loaded; a failing compiler is one line."""
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    if decode_attention._compiler() is None:
        pytest.skip("no C compiler")
    lib, reason = decode_attention._build()
    built = list((tmp_path / "kernels").glob("decode_attention-*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob(".decode_attention-*"))  # no scratch left
    assert (lib is None) == (reason is not None)
    assert built[0].stat().st_mode & 0o777 == 0o700
    stamp = built[0].stat().st_mtime_ns
    decode_attention._build()
    assert built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    built[0].chmod(0o766)
    lib, reason = decode_attention._build()
    assert lib is None and "writable by others" in reason
    built[0].unlink()
    monkeypatch.setenv("CC", "false")
    lib, reason = decode_attention._build()
    assert lib is None and "\n" not in reason and ("failed to build" in reason or "does not run" in reason)


def test_a_damaged_library_is_built_again_and_a_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    """A truncated library in the cache (a crash mid-write) is built again instead of failing in every later
    process; a kernels folder others can write in is refused (they could rename a library over ours)."""
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    if decode_attention._compiler() is None:
        pytest.skip("no C compiler")
    import subprocess
    import sys

    # built by another process: truncating a library this process has loaded would crash it
    first = subprocess.run([sys.executable, "-c", "from hasten.kernels import decode_attention as d; "
                            "print(d._build()[1])"], capture_output=True, text=True, check=True)
    if first.stdout.strip() != "None":
        pytest.skip(f"the kernel does not build or load here: {first.stdout.strip()}")
    built = next((tmp_path / "kernels").glob("decode_attention-*.so"))
    built.write_bytes(b"")  # zero length: what a crash after the rename could leave
    lib, reason = decode_attention._build()
    assert lib is not None and reason is None and built.stat().st_size > 0
    (tmp_path / "kernels").chmod(0o777)
    lib, reason = decode_attention._build()
    assert lib is None and "kernels is not this user's own or is writable by others" in reason


def test_a_compiler_command_of_several_words_builds(tmp_path, monkeypatch):
    """$CC as a shell splits it: "ccache cc" or "gcc -m64" build the kernel (as one program name they failed,
    and auto quietly ran torch's path)."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", f"{compiler} -m64")
    assert decode_attention._compiler() == [compiler, "-m64"]
    lib, reason = decode_attention._build()
    assert list((tmp_path / "kernels").glob("decode_attention-*.so")), reason
    assert reason is None or "AVX-512" in reason
