"""The KV-cache engine: seeding, log-probs against a plain forward, EOS and masks,
greedy decoding, and the sampling distribution."""

from __future__ import annotations

import math

import torch

from conftest import encode, make_engine, rollout_of
from hasten.rollout import SamplingParams
from hasten.rollout.sampling import filter_logits, sample_tokens
from hasten.train.logprobs import completion_logprobs


def plain_logprobs(model, rollout, temperature=1.0):
    group = torch.arange(rollout.num_samples) // rollout.num_generations
    with torch.no_grad():
        return completion_logprobs(
            model, rollout.prompt_ids[group], rollout.prompt_mask[group],
            rollout.completion_ids, rollout.completion_mask, temperature,
        ).logps


def test_same_seed_same_samples_and_other_seed_differs(model, tokenizer):
    first = rollout_of(model, tokenizer, seed=3)
    again = rollout_of(model, tokenizer, seed=3)
    other = rollout_of(model, tokenizer, seed=4)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert torch.equal(first.sampling_logprobs, again.sampling_logprobs)
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_logprobs_equal_a_plain_forward(short_model, tokenizer):
    for temperature in (1.0, 0.7):
        rollout = rollout_of(short_model, tokenizer, num_generations=4, temperature=temperature)
        mask = rollout.completion_mask.bool()
        expected = plain_logprobs(short_model, rollout, temperature)
        assert (expected - rollout.sampling_logprobs)[mask].abs().max() < 1e-4


def test_eos_ends_a_row_and_masks_the_rest(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=12)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = rollout.completion_lengths.tolist()
    assert len(set(lengths)) > 1, "the EOS-prone model should give varied lengths"
    for row, length in enumerate(lengths):
        ids = rollout.completion_ids[row].tolist()
        assert rollout.completion_mask[row, :length].all() and not rollout.completion_mask[row, length:].any()
        assert all(token == pad for token in ids[length:])
        assert rollout.sampling_logprobs[row, length:].eq(0).all()
        if rollout.ended_with_eos[row]:
            assert ids[length - 1] == eos and eos not in ids[: length - 1]
        else:
            assert length == 12 and eos not in ids[:length]
    assert rollout.completion_ids.shape[1] == max(lengths)  # trimmed to the longest row


def test_rows_are_group_major(model, tokenizer):
    rollout = rollout_of(model, tokenizer, num_generations=3)
    assert rollout.num_prompts == 3 and rollout.num_samples == 9
    # samples of one prompt differ from each other (they are sampled, not copied)
    assert len({tuple(r) for r in rollout.completion_ids[:3].tolist()}) > 1


def test_greedy_matches_transformers_generate(model, tokenizer):
    engine = make_engine(model, tokenizer)
    prompts = encode(tokenizer)
    rollout = engine.generate(prompts, 1, SamplingParams(max_new_tokens=10, temperature=0.0), seed=0)
    for row, prompt in enumerate(prompts):
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt):].tolist()
        length = int(rollout.completion_lengths[row])
        assert rollout.completion_ids[row, :length].tolist() == out[:length]


def test_top_k_one_is_greedy(model, tokenizer):
    engine = make_engine(model, tokenizer)
    prompts = encode(tokenizer)
    greedy = engine.generate(prompts, 2, SamplingParams(8, temperature=0.0), seed=0)
    top1 = engine.generate(prompts, 2, SamplingParams(8, temperature=1.0, top_k=1), seed=5)
    assert torch.equal(greedy.completion_ids, top1.completion_ids)


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, SamplingParams(top_k=2))).tolist() == [[False, False, True, True]]
    # top_p 0.7: 0.5 alone is short of 0.7, 0.5+0.3 reaches it -> keep two
    assert torch.isinf(filter_logits(logits, SamplingParams(top_p=0.7))).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, SamplingParams(top_p=0.5))).tolist() == [[False, True, True, True]]


def test_sampling_matches_the_softmax_distribution():
    """Inverse-CDF sampling with one uniform per row draws from softmax(logits / T)."""
    torch.manual_seed(0)
    probs = torch.tensor([0.45, 0.25, 0.15, 0.1, 0.05])
    temperature = 0.8
    logits = torch.log(probs) * temperature  # so that softmax(logits / T) == probs
    draws = 40_000
    tokens, logprobs = sample_tokens(logits.expand(draws, -1), SamplingParams(temperature=temperature),
                                     torch.rand(draws))
    counts = torch.bincount(tokens, minlength=5).float()
    chi_square = float(((counts - draws * probs) ** 2 / (draws * probs)).sum())
    assert chi_square < 20.5  # p = 0.0004 for 4 degrees of freedom: a real bias fails, noise passes
    assert torch.allclose(logprobs, torch.log(probs)[tokens], atol=1e-5)


def test_top_p_sampling_never_draws_a_filtered_token():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(5000, -1)
    tokens, _ = sample_tokens(logits, SamplingParams(top_p=0.8), torch.rand(5000))
    assert set(tokens.tolist()) == {0, 1}
    share = float((tokens == 0).float().mean())
    assert math.isclose(share, 0.6 / 0.9, abs_tol=0.03)  # renormalised over the kept tokens
