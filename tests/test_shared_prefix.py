"""speed.shared_prefix: the prompts' common prefix computed once, in the grouped packed learning pass and in
the lean engine's prefill, gives what computing it per prompt gives: log-probs, entropies and gradients
within float rounding (1e-4 / 1e-5, as test_packing.py), the learner's loss, and the same sampled tokens."""

from __future__ import annotations

import pytest
import torch

from conftest import encode, learner_step, make_engine
from hasten.algo import group_advantages
from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine
from hasten.kernels.grouped_attention import SHARED_SEGMENT, build_layout
from hasten.kernels.shared_prefix import common_prefix
from hasten.train.logprobs import completion_logprobs
from hasten.train.packing import pack, packed_logprobs
from test_lean_engine import assert_same_rollout
from test_native_llama import native_copy

EXAMPLE = "Q: what is 12 + 30? A: 42.\nQ: "  # a worked example before every question, as the demo's prompts
PREFIXED = [EXAMPLE + "hello there", EXAMPLE + "hi", EXAMPLE + "a much longer prompt, with punctuation!"]
# Identical prompts too: the shortest keeps only its last token of its own.
SETS = {"worked example": PREFIXED, "with repeats": [PREFIXED[1], PREFIXED[0], PREFIXED[1]]}


def test_common_prefix():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix([[1, 2, 3], [1, 2, 3]]) == 2  # each keeps its last token
    assert common_prefix([[7], [7, 8]]) == 0
    assert common_prefix([[1, 2], [3, 2]]) == 0
    assert common_prefix([[1, 2, 3]]) == 0  # one prompt: nothing to share
    assert common_prefix([torch.tensor([4, 5, 6]), torch.tensor([4, 5, 7])]) == 2


def _rollout(model, tokenizer, texts, num_generations=4, seed=0):
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    return make_engine(model, tokenizer).generate(encode(tokenizer, texts), num_generations, sampling, seed=seed)


def _plain(model, rollout, rows, temperature=1.0, with_entropy=False):
    group = rows // rollout.num_generations
    return completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                               rollout.completion_ids[rows], rollout.completion_mask[rows], temperature, with_entropy)


def test_pack_holds_the_prefix_once(short_model, tokenizer):
    rollout = _rollout(short_model, tokenizer, PREFIXED)
    rows = torch.arange(rollout.num_samples)
    shared = common_prefix(encode(tokenizer, PREFIXED))
    assert shared == len(encode(tokenizer, [EXAMPLE])[0])
    plain, once = pack(rollout, rows), pack(rollout, rows, share_prefix=True)
    assert plain.shared == 0 and once.shared == shared
    real = lambda packed: int((packed.segments != -1).sum())  # noqa: E731
    assert real(plain) - real(once) == 2 * shared  # rows 1 and 2 leave it to row 0
    assert once.segments[0, :shared].eq(SHARED_SEGMENT).all() and not once.segments[1:].eq(SHARED_SEGMENT).any()
    assert once.position_ids[1, 0] == shared  # the rest of a prompt keeps its positions
    assert torch.equal(once.targets, plain.targets) and torch.equal(once.sample, plain.sample)
    # the position that predicts each first completion token is its prompt's last one
    first = once.column == 0
    last_prompt = once.input_ids[once.source_row[first], once.source_position[first]]
    assert torch.equal(last_prompt, plain.input_ids[plain.source_row[first], plain.source_position[first]])


def test_layout_reads_the_prefix_from_row_0():
    # row 0: prefix of 2, own prompt of 1, one completion of 2 inputs; row 1: own prompt of 2, one completion of 1
    segments = torch.tensor([[-2, -2, 0, 1, 1], [0, 0, 1, -1, -1]])
    layout = build_layout(segments)
    assert layout.prompt_index.tolist() == [[0, 1, 2], [5, 6, 0]]  # queries: the prefix once, in row 0
    assert layout.key_index.tolist() == [[0, 1, 2, 0], [0, 1, 5, 6]]  # keys: every row sees the prefix
    assert layout.key_valid.tolist() == [[True, True, True, False], [True, True, True, True]]
    # row 1's second prompt token sees the prefix and both own tokens; its first, not the second
    assert layout.prompt_mask[1, 0, 1].tolist() == [True, True, True, True]
    assert layout.prompt_mask[1, 0, 0].tolist() == [True, True, True, False]
    assert layout.prompt_mask[0, 0, 0].tolist() == [True, False, False, False]  # row 0 stays causal
    # row 1's completion sees the prefix, its prompt and itself
    assert layout.completion_mask[1, 0, 0].tolist() == [True, True, True, True, True, False]


@pytest.mark.parametrize("prompts", list(SETS))
@pytest.mark.parametrize("chunk_tokens", [0, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_and_entropy_equal_plain(short_model, tokenizer, prompts, chunk_tokens, temperature):
    rollout = _rollout(short_model, tokenizer, SETS[prompts])
    rows = torch.tensor([0, 1, 2, 3, 5, 6, 9, 10, 11])  # partial groups too
    mask = rollout.completion_mask[rows].bool()
    with torch.no_grad():
        expected = _plain(short_model, rollout, rows, temperature, with_entropy=True)
        got = packed_logprobs(short_model, rollout, rows, temperature, True, chunk_tokens, grouped=True,
                              shared_prefix=True)
    assert (expected.logps - got.logps)[mask].abs().max() < 1e-4
    assert (expected.entropy - got.entropy)[mask].abs().max() < 1e-4


@pytest.mark.parametrize("native", [False, True])
def test_gradients_equal_without_sharing(short_model, tokenizer, native):
    model = native_copy(short_model) if native else short_model
    rollout = _rollout(short_model, tokenizer, PREFIXED)
    rows = torch.arange(rollout.num_samples)
    weights = torch.randn(rollout.completion_ids.shape, generator=torch.Generator().manual_seed(0))

    def gradients(shared: bool):
        model.zero_grad()
        logps = packed_logprobs(model, rollout, rows, 1.0, False, 5, grouped=True, shared_prefix=shared).logps
        (logps * weights * rollout.completion_mask).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    reference, shared = gradients(False), gradients(True)
    assert len(reference) == len(shared) > 0
    for a, b in zip(reference, shared):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_learner_step_is_the_same_with_and_without(short_model, tokenizer):
    rollout = _rollout(short_model, tokenizer, PREFIXED)
    advantages = group_advantages(torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(1)), 4)

    def configure(shared):
        def apply(cfg):
            cfg.train.lr = 1e-2
            cfg.train.gradient_accumulation_steps = 2
            cfg.speed.shared_prefix = shared
        return apply

    (off, off_grads), (on, on_grads) = [learner_step(short_model, tokenizer, rollout, advantages, configure(shared))
                                        for shared in (False, True)]
    assert off["loss"] == pytest.approx(on["loss"], abs=1e-5)
    assert off["grad_norm"] == pytest.approx(on["grad_norm"], rel=1e-4)
    for a, b in zip(off_grads, on_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("prompts", list(SETS))
def test_lean_engine_samples_the_same(short_model, tokenizer, prompts):
    """Prefilled once or per prompt: the same tokens for a seed, sampled or greedy, and the same log-probs."""
    encoded = encode(tokenizer, SETS[prompts])
    assert common_prefix(encoded) > 10
    for model in (short_model, native_copy(short_model)):
        for sampling in (SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.0),
                         SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9)):
            engines = [LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], shared_prefix=shared)
                       for shared in (False, True)]
            expected, actual = (engine.generate(encoded, 3, sampling, seed=1) for engine in engines)
            assert_same_rollout(expected, actual)
