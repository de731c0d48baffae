"""Speculative decoding (rollout/speculative.py, drafters.py) against the plain lean engine.

- greedy: the same tokens, masks, EOS flags and log-probs as LeanEngine, for the
  prompt-lookup drafter, a self-draft (layers:1) and a separate draft model,
  with groups (G > 1), prompts of different lengths and rows ending at EOS at
  different times (so finished rows are compacted out mid-way);
- exactness: the verify rule alone on synthetic p and q (200k rows) gives
  the first token's distribution p; end to end, thousands of 3-token samples
  match the exact sequence distribution enumerated from the policy. Both
  checks fail for the two classic mistakes (always accepting drafts,
  resampling from p instead of the residual), monkeypatched in;
- log-probs equal the learner's recomputation; a seed fixes the output; a
  RowRange split equals one call; the config errors.
"""

from __future__ import annotations


import pytest
import torch

from conftest import encode, eos_prone_model, tiny_config
from hasten.config import ConfigError, ModelConfig, validate
from hasten.models.tiny import tiny_model
from hasten.rollout import RowRange, SamplingParams
from hasten.rollout import speculative
from hasten.rollout.drafters import ModelDrafter, NgramDrafter
from hasten.rollout.lean import LeanEngine
from hasten.rollout.speculative import SpeculativeEngine, processed_probs, verify
from hasten.train.logprobs import completion_logprobs

PROMPTS = ["hello there hello there", "hi", "a much longer prompt, with punctuation!", "x", "abcabcabc",
           "the cat sat on the mat"]


def lean(model, tokenizer) -> LeanEngine:
    return LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])


def drafter(kind: str, tokenizer):
    if kind == "ngram":
        return NgramDrafter(3)
    if kind == "layers:1":
        return ModelDrafter(layers=1)
    return ModelDrafter(lean(tiny_model(len(tokenizer), seed=1), tokenizer))  # another model, same vocabulary


def spec(model, tokenizer, kind: str, k: int = 4) -> SpeculativeEngine:
    return SpeculativeEngine(lean(model, tokenizer), drafter(kind, tokenizer), k)


def assert_same(expected, actual, logprob_tolerance=1e-5):
    assert torch.equal(expected.completion_ids, actual.completion_ids)
    assert torch.equal(expected.completion_mask, actual.completion_mask)
    assert torch.equal(expected.ended_with_eos, actual.ended_with_eos)
    assert (expected.sampling_logprobs - actual.sampling_logprobs).abs().max() < logprob_tolerance


@pytest.mark.parametrize("kind", ["ngram", "layers:1", "model"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_output_is_the_plain_engines(tokenizer, kind, k):
    model = eos_prone_model(tokenizer, boost=1.0)  # greedy rows end after 1, 19 or 24 tokens
    prompts, greedy = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=24, temperature=0)
    expected = lean(model, tokenizer).generate(prompts, 2, greedy, seed=0)
    assert len(set(expected.completion_lengths.tolist())) >= 3 and expected.ended_with_eos.any()
    engine = spec(model, tokenizer, kind, k)
    actual = engine.generate(prompts, 2, greedy, seed=0)
    assert_same(expected, actual)
    assert actual.stats["spec/forwards"] < 23  # drafts were accepted: fewer forwards than tokens
    plain = tiny_model(len(tokenizer))  # no early EOS: longer runs, more rounds
    assert_same(lean(plain, tokenizer).generate(prompts, 3, greedy, seed=0),
                spec(plain, tokenizer, kind, k).generate(prompts, 3, greedy, seed=0))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of counts against probs; inf if a zero-probability cell was hit."""
    expected = probs * counts.sum()
    if counts[probs == 0].sum() > 0:
        return float("inf")
    cells = probs > 0
    return float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())


def first_token_statistic(sampling: SamplingParams, point_mass: bool, rows: int = 200_000) -> float:
    """verify() on fixed p, q (k = 2, vocabulary 6): chi-square of the first committed token against p_1."""
    generator = torch.Generator().manual_seed(0)
    vocab, k = 6, 2
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 1.0, 2.0, 0.0, 0.5, -0.5],
                           [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]]).expand(rows, k + 1, vocab)  # (N, k+1, V)
    q = torch.tensor([[0.05, 0.1, 0.05, 0.5, 0.1, 0.2], [0.3, 0.1, 0.2, 0.1, 0.2, 0.1]])  # unlike p on purpose
    # drafts from q either way; a point mass (prompt lookup) means verify is told nothing about q
    drafts = torch.stack([torch.multinomial(q[i], rows, True, generator=generator) for i in range(k)], dim=1)
    draft_probs = None if point_mass else q.expand(rows, k, vocab)
    uniforms = torch.rand(rows, k + 1, 3, generator=generator)
    tokens, accepted = verify(logits, drafts, draft_probs, uniforms, sampling)
    assert accepted.min() >= 0 and accepted.max() <= k
    counts = torch.bincount(tokens[:, 0], minlength=vocab).float()
    return chi_square(counts, processed_probs(logits[:1, 0], sampling)[0])


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                      SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)])
@pytest.mark.parametrize("point_mass", [False, True])
def test_verify_keeps_the_policy_distribution(sampling, point_mass, monkeypatch):
    # 5 degrees of freedom at most: P(chi2 > 30) < 2e-5; the uniforms are seeded, so this is deterministic.
    assert first_token_statistic(sampling, point_mass) < 30
    with monkeypatch.context() as patch:  # always accepting a draft: the drafter's distribution leaks in
        patch.setattr(speculative, "acceptance", lambda p, q: torch.ones_like(p))
        assert first_token_statistic(sampling, point_mass) > 300
    with monkeypatch.context() as patch:  # resampling from p instead of the residual over-weights the drafts
        patch.setattr(speculative, "residual", lambda p, q: p)
        assert first_token_statistic(sampling, point_mass) > 300


def exact_sequence_probs(model, prompt: list[int], sampling: SamplingParams, eos: int) -> dict[tuple, float]:
    """Every completion of up to max_new_tokens tokens with its exact probability under `sampling`."""
    table: dict[tuple, float] = {}

    def extend(prefix: tuple, probability: float) -> None:
        if len(prefix) == sampling.max_new_tokens or (prefix and prefix[-1] == eos):
            table[prefix] = probability
            return
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + list(prefix)])).logits[0, -1]
        probs = processed_probs(logits[None], sampling)[0]
        for token in probs.nonzero().squeeze(-1).tolist():
            extend(prefix + (token,), probability * float(probs[token]))

    extend((), 1.0)
    return table


def sequence_statistic(engine, prompt, sampling, table, rows: int, seed: int) -> float:
    rollout = engine.generate([prompt], rows, sampling, seed=seed)
    cells = {sequence: index for index, sequence in enumerate(table)}
    counts = torch.zeros(len(cells) + 1)
    for sequence in rollout.completion_token_lists():
        counts[cells.get(tuple(sequence), len(cells))] += 1  # the last cell: a sequence of probability 0
    return chi_square(counts, torch.tensor(list(table.values()) + [0.0]))


def perturbed(model, scale: float, seed: int = 5):
    """A draft close to the policy but not equal: acceptance well below 1, residuals that matter."""
    import copy

    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return draft


def test_sampled_sequences_follow_the_exact_distribution(tokenizer, monkeypatch):
    model = tiny_model(len(tokenizer))
    with torch.no_grad():  # a peaked model: few sequences carry the mass, so 3000 rows resolve it
        model.lm_head.weight.mul_(4.0)
    prompt = encode(tokenizer, ["abab"])[0]
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3)
    table = exact_sequence_probs(model, prompt, sampling, tokenizer.eos_token_id)
    degrees = len(table)  # the zero cell adds none; P(chi2_27 > 70) < 1e-5
    draft = ModelDrafter(lean(perturbed(model, 0.02), tokenizer))
    engines = {"plain": lean(model, tokenizer), "ngram": SpeculativeEngine(lean(model, tokenizer), NgramDrafter(2), 2),
               "draft": SpeculativeEngine(lean(model, tokenizer), draft, 2)}
    statistics = {name: sequence_statistic(engine, prompt, sampling, table, 3000, seed=1)
                  for name, engine in engines.items()}
    assert all(value < 2.5 * degrees for value in statistics.values()), statistics
    acceptance = engines["draft"].generate([prompt], 300, sampling, seed=2).stats["spec/acceptance"]
    assert 0.2 < acceptance < 0.95  # the test exercises both accepted drafts and residual samples
    with monkeypatch.context() as patch:
        patch.setattr(speculative, "residual", lambda p, q: p)
        assert sequence_statistic(engines["draft"], prompt, sampling, table, 3000, seed=1) > 5 * degrees
    with monkeypatch.context() as patch:
        patch.setattr(speculative, "acceptance", lambda p, q: torch.ones_like(p))
        assert sequence_statistic(engines["ngram"], prompt, sampling, table, 3000, seed=1) > 5 * degrees


@pytest.mark.parametrize("kind", ["ngram", "layers:1"])
def test_logprobs_equal_the_learners_recomputation(tokenizer, kind):
    model = eos_prone_model(tokenizer, boost=1.0)
    for sampling in (SamplingParams(16, temperature=1.0), SamplingParams(16, temperature=0.7, top_k=20, top_p=0.9)):
        rollout = spec(model, tokenizer, kind).generate(encode(tokenizer, PROMPTS), 3, sampling, seed=2)
        assert len(set(rollout.completion_lengths.tolist())) > 2
        group = torch.arange(rollout.num_samples) // rollout.num_generations
        with torch.no_grad():
            expected = completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                           rollout.completion_ids, rollout.completion_mask,
                                           sampling.temperature).logps
        mask = rollout.completion_mask.bool()
        assert (expected - rollout.sampling_logprobs)[mask].abs().max() < 1e-4
        assert rollout.sampling_logprobs[~mask].eq(0).all()
        for row, length in enumerate(rollout.completion_lengths.tolist()):  # the masks/EOS contract
            ids = rollout.completion_ids[row, :length].tolist()
            assert (tokenizer.eos_token_id in ids) == bool(rollout.ended_with_eos[row])
            assert tokenizer.eos_token_id not in ids[:-1] and (rollout.ended_with_eos[row] or length == 16)


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_seeded_and_independent_of_the_row_split(tokenizer, kind):
    model, prompts = eos_prone_model(tokenizer, boost=1.0), encode(tokenizer, PROMPTS[:4])
    sampling = SamplingParams(12, temperature=0.9, top_p=0.95)
    engine = spec(model, tokenizer, kind, k=3)
    whole = engine.generate(prompts, 2, sampling, seed=7)
    assert_same(whole, engine.generate(prompts, 2, sampling, seed=7), logprob_tolerance=1e-7)
    assert not torch.equal(whole.completion_ids, engine.generate(prompts, 2, sampling, seed=8).completion_ids)
    first = engine.generate(prompts[:2], 2, sampling, seed=7, rows=RowRange(0, 8))
    second = engine.generate(prompts[2:], 2, sampling, seed=7, rows=RowRange(4, 8))
    for half, rows in ((first, slice(0, 4)), (second, slice(4, 8))):
        length = half.completion_ids.shape[1]
        assert torch.equal(half.completion_ids, whole.completion_ids[rows, :length])
        assert not whole.completion_mask[rows, length:].any()
        assert (half.sampling_logprobs - whole.sampling_logprobs[rows, :length]).abs().max() < 1e-5


_config = tiny_config


def test_make_engine_builds_the_speculative_engine(tokenizer, tmp_path):
    from hasten.models import load_policy
    from hasten.rollout.factory import make_engine

    policy = load_policy(ModelConfig(name="tiny"), log=lambda text: None)
    assert isinstance(make_engine(_config(), policy), LeanEngine)  # off: today's engine, as it was
    ngram = make_engine(_config(speculative="ngram", speculative_tokens=3, ngram_size=2), policy)
    assert isinstance(ngram.drafter, NgramDrafter) and (ngram.k, ngram.drafter.max_ngram) == (3, 2)
    assert make_engine(_config(speculative="draft", draft_model="layers:2"), policy).drafter.layers == 2
    with pytest.raises(ConfigError, match="layers:5: the policy has 2 layers"):
        make_engine(_config(speculative="draft", draft_model="layers:5"), policy)
    with pytest.raises(ConfigError, match="whole number"):
        make_engine(_config(speculative="draft", draft_model="layers:x"), policy)
    same, other = tmp_path / "same", tmp_path / "other"
    tiny_model(len(tokenizer), seed=1).save_pretrained(same)
    tokenizer.save_pretrained(same)
    tiny_model(len(tokenizer) + 5, seed=1).save_pretrained(other)
    tokenizer.save_pretrained(other)
    engine = make_engine(_config(speculative="draft", draft_model=str(same)), policy)
    prompts, greedy = encode(tokenizer, PROMPTS[:3]), SamplingParams(8, temperature=0)
    assert torch.equal(engine.generate(prompts, 2, greedy, 0).completion_ids,
                       make_engine(_config(), policy).generate(prompts, 2, greedy, 0).completion_ids)
    with pytest.raises(ConfigError, match="another vocabulary"):
        make_engine(_config(speculative="draft", draft_model=str(other)), policy)


def test_config_refuses_what_speculative_does_not_do():
    for engine in ("hf", "vllm"):
        with pytest.raises(ConfigError, match="speed.speculative=ngram runs in the lean engine only"):
            validate(_config(speculative="ngram", engine=engine))
    penalized = _config(speculative="draft")
    penalized.generation.repetition_penalty = 1.2
    with pytest.raises(ConfigError, match="generation.repetition_penalty"):
        validate(penalized)
    with pytest.raises(ConfigError, match="speed.speculative must be one of"):
        validate(_config(speculative="medusa"))
    with pytest.raises(ConfigError, match="speed.speculative_tokens must be >= 1"):
        validate(_config(speculative="ngram", speculative_tokens=0))
    validate(_config(speculative="ngram", engine="lean"))


def test_ngram_drafter_proposes_what_followed_the_last_match():
    from hasten.rollout.speculative import Sequences

    context = torch.tensor([[5, 6, 7, 8, 9, 5, 6, -1, -1, -1], [1, 2, 3, 4, -1, -1, -1, -1, -1, -1],
                            [3, 3, 3, -1, -1, -1, -1, -1, -1, -1]])
    length = torch.tensor([7, 4, 3])
    sequences = Sequences(context, length, torch.ones(3, dtype=torch.long), length - 1)
    drafts, probs = NgramDrafter(3).propose(sequences, torch.rand(3, 4), 4, SamplingParams())
    assert probs is None
    assert drafts[0].tolist() == [7, 8, 9, 5]  # "5 6" occurred at 0: what followed it
    assert drafts[1].tolist() == [4, 4, 4, 4]  # no earlier occurrence: the last token repeated
    assert drafts[2].tolist() == [3, 3, 3, 3]  # "3 3" at 0, then periodic


@pytest.mark.parametrize("settings", [
    {"speculative": "ngram", "speculative_tokens": 3, "ngram_size": 1},
    {"speculative": "draft", "speculative_tokens": 2, "draft_model": "layers:1"},
])
def test_speculative_settings_from_the_config_keep_the_exact_distribution(tokenizer, settings):
    """Whatever speed.speculative_tokens, speed.ngram_size or speed.draft_model say, the engine the config builds
    samples the policy's own distribution (tests/test_speed_exact.py names this test for those keys)."""
    from hasten.models import load_policy
    from hasten.rollout.factory import make_engine

    policy = load_policy(ModelConfig(name="tiny"), log=lambda text: None)
    with torch.no_grad():  # peaked, as above: few sequences carry the mass
        policy.model.lm_head.weight.mul_(4.0)
    prompt = encode(tokenizer, ["abab"])[0]
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3)
    table = exact_sequence_probs(policy.model, prompt, sampling, tokenizer.eos_token_id)
    engine = make_engine(_config(**settings), policy, log=lambda text: None)
    assert isinstance(engine, SpeculativeEngine)
    assert sequence_statistic(engine, prompt, sampling, table, 3000, seed=1) < 2.5 * len(table)


def test_a_released_engine_s_weights_are_not_held_by_the_drafter(tokenizer):
    """The self-draft (layers:N) drafts from a shallow copy of the policy's engine and its own cache; both are
    dropped when the generate ends, so release_weights frees the prepared matrices for the learning pass."""
    import gc
    import weakref

    torch.manual_seed(0)
    engine = LeanEngine(tiny_model(len(tokenizer)), tokenizer.pad_token_id, [tokenizer.eos_token_id],
                        sample_precision="bf16")
    spec = SpeculativeEngine(engine, ModelDrafter(layers=1), 3)
    spec.generate(encode(tokenizer), 2, SamplingParams(max_new_tokens=8, temperature=1.0), seed=0)
    prepared = [weakref.ref(engine.head), weakref.ref(engine.layers[0].qkv)]
    assert spec.drafter.cache is None and spec.drafter.draft is None
    spec.release_weights()
    gc.collect()
    assert all(ref() is None for ref in prepared)
    again = spec.generate(encode(tokenizer), 2, SamplingParams(max_new_tokens=8, temperature=1.0), seed=0)
    assert again.completion_ids.shape[0] == 2 * len(encode(tokenizer))
