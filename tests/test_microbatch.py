"""speed.token_budget: micro-batches cover every sample once, in order, within the
budget, and the learner's gradient does not depend on how the batch is split."""

from __future__ import annotations


import pytest
import torch

from conftest import learner_step, rollout_of
from hasten.algo import group_advantages
from hasten.config import ConfigError, load_config
from hasten.train.microbatch import count_tokens, micro_batches


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("budget", [1, 20, 60, 10_000])
def test_micro_batches_cover_samples_in_order_within_budget(short_model, tokenizer, packed, budget):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    pieces = micro_batches(rollout, 2, budget, packed)
    assert torch.cat(pieces).tolist() == list(range(rollout.num_samples))
    half = rollout.num_samples // 2
    assert all(p.max() < half or p.min() >= half for p in pieces)  # never across accumulation chunks
    for piece in pieces:
        assert piece.numel() == 1 or count_tokens(rollout, piece, packed) <= budget
    if budget == 1:
        assert len(pieces) == rollout.num_samples  # every sample is over budget alone
    if budget == 10_000:
        assert len(pieces) == 2  # only the accumulation split


def _lengths_rollout(prompts, completions, group_size):
    """A stand-in rollout with these prompt lengths (one per group) and completion lengths (one per sample)."""
    from types import SimpleNamespace

    width = max(completions)
    completion_mask = torch.tensor([[1] * n + [0] * (width - n) for n in completions])
    prompt_mask = torch.tensor([[1] * n + [0] * (max(prompts) - n) for n in prompts])
    return SimpleNamespace(prompt_mask=prompt_mask, completion_mask=completion_mask, num_generations=group_size,
                           num_samples=len(completions))


def _greedy(rollout, budget, packed):
    pieces, current = [], []
    for sample in range(rollout.num_samples):
        if current and count_tokens(rollout, torch.tensor(current + [sample]), packed) > budget:
            pieces.append(current)
            current = []
        current.append(sample)
    return pieces + [current]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("budget", [40, 64, 100, 150])
def test_micro_batches_are_as_few_as_greedy_and_evened_out(packed, budget):
    """As many micro-batches as the greedy cut at the budget, and the largest is the smallest any contiguous cut
    into that many pieces can have (brute force)."""
    import itertools

    generator = torch.Generator().manual_seed(budget)
    completions = torch.randint(1, 12, (12,), generator=generator).tolist()
    rollout = _lengths_rollout([9, 5, 7], completions, 4)
    pieces = micro_batches(rollout, 1, budget, packed)
    assert torch.cat(pieces).tolist() == list(range(12))
    greedy = _greedy(rollout, budget, packed)
    assert len(pieces) == len(greedy)
    size = lambda piece: count_tokens(rollout, torch.as_tensor(piece), packed)  # noqa: E731
    largest = max(size(piece) for piece in pieces)
    assert largest <= max(size(piece) for piece in greedy)
    assert all(piece.numel() == 1 or size(piece) <= budget for piece in pieces)
    best = min(max(size(list(range(a, b))) for a, b in zip((0, *cuts), (*cuts, 12)))
               for cuts in itertools.combinations(range(1, 12), len(pieces) - 1))
    assert largest == best


def test_micro_batches_split_an_uneven_batch_evenly():
    """Two groups of 8 x 10-token completions with 5-token prompts (2 x 77 packed tokens) under a 120 budget:
    greedy cut 118 + 41 tokens, the even cut 77 + 77."""
    rollout = _lengths_rollout([5, 5], [10] * 16, 8)
    assert [count_tokens(rollout, piece, True) for piece in micro_batches(rollout, 1, 120, True)] == [77, 77]


def test_packed_count_has_each_prompt_once(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    group = torch.arange(4)
    prompt = int(rollout.prompt_mask[0].sum())
    completions = rollout.completion_mask[:4].sum(1)
    assert count_tokens(rollout, group, packed=True) == prompt + int((completions - 1).clamp(min=0).sum())
    assert count_tokens(rollout, group, packed=False) == 4 * (prompt + int(completions.max()))


def test_budget_zero_is_the_accumulation_split(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    pieces = micro_batches(rollout, 3, 0, True)
    expected = torch.arange(rollout.num_samples).tensor_split(3)
    assert [p.tolist() for p in pieces] == [e.tolist() for e in expected]


def test_negative_budget_is_a_config_error():
    with pytest.raises(ConfigError, match="speed.token_budget"):
        load_config(None, [("speed.token_budget", -5)])


@pytest.mark.parametrize("loss", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("packed", [True, False])
def test_learner_gradient_is_the_same_with_a_token_budget(short_model, tokenizer, loss, packed):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    advantages = group_advantages(torch.randn(rollout.num_samples), 4)
    def configure(budget):
        def apply(cfg):
            cfg.algo.loss = loss
            cfg.speed.packed_learning = packed
            cfg.speed.token_budget = budget
        return apply

    results = [learner_step(short_model, tokenizer, rollout, advantages, configure(b)) for b in (0, 25)]
    assert len(micro_batches(rollout, 1, 25, packed)) > 2  # the budget really split the batch
    (whole, whole_grads), (split, split_grads) = results
    assert whole["loss"] == pytest.approx(split["loss"], abs=1e-5)
    assert whole["entropy"] == pytest.approx(split["entropy"], rel=1e-5)
    for a, b in zip(whole_grads, split_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_auto_budget_is_a_quarter_of_the_machine_over_the_models_activations():
    from types import SimpleNamespace

    from hasten.bench import cost
    from hasten.train.microbatch import (
        AUTO_CPU_TOKENS,
        AUTO_FLOOR,
        activation_bytes_per_token,
        resolve_budget,
        static_bytes,
    )

    smollm2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152)
    per_token = activation_bytes_per_token(smollm2, checkpointing=False)
    shape = cost.Shape(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152)
    estimate = cost.training_memory_bytes(shape, 1, 1, 0, 1, lora=True)["activations"]
    assert per_token == estimate  # the bench's memory model and the learner's budget agree
    gib = 1024 ** 3
    # a quarter of the device's memory (~4,300 tokens), on a CPU at most AUTO_CPU_TOKENS
    quarter = 6 * gib // per_token
    assert quarter > AUTO_CPU_TOKENS and resolve_budget("auto", smollm2, False, total_bytes=24 * gib) == AUTO_CPU_TOKENS
    assert resolve_budget("auto", smollm2, False, total_bytes=24 * gib, device="cuda") == quarter
    assert resolve_budget("auto", smollm2, True, total_bytes=24 * gib, device="cuda") > quarter  # checkpointing
    assert resolve_budget("auto", smollm2, True, total_bytes=24 * gib) == AUTO_CPU_TOKENS
    small = resolve_budget("auto", smollm2, False, total_bytes=6 * gib)  # what the model leaves binds, under the floor
    assert small < AUTO_FLOOR and small == int(0.3 * (6 * gib - static_bytes(smollm2, False, 0))) // per_token
    assert resolve_budget("auto", smollm2, False, total_bytes=gib) == 1  # the model alone does not fit: one sample
    assert resolve_budget(512, smollm2, False, total_bytes=gib) == 512  # a number stays as given


@pytest.mark.parametrize("loss, sharded, more, expected", [
    ("dapo", False, [], "auto"), ("bnpo", False, [], 0), ("dapo", True, [], 0),
    ("dapo", False, [("algo.entropy_coef", 0.01)], 0), ("grpo", False, [("algo.top_entropy_quantile", 0.2)], 0)])
def test_auto_budget_is_off_where_a_split_changes_the_result(loss, sharded, more, expected):
    from types import SimpleNamespace

    from hasten.train.learner import token_budget
    from hasten.train.microbatch import resolve_budget

    tiny = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           vocab_size=300)
    cfg = load_config(None, [("speed.token_budget", "auto"), ("algo.loss", loss), *more])
    budget = token_budget(cfg, sharded, tiny)
    assert budget == (resolve_budget("auto", tiny, False) if expected == "auto" else 0)
    assert load_config(None, [("speed.token_budget", 300)]).speed.token_budget == 300
    with pytest.raises(ConfigError, match="speed.token_budget"):
        load_config(None, [("speed.token_budget", "big")])


def test_the_plan_line_names_the_resolved_budget(short_model, tokenizer):
    from hasten.train.learner import LearningPlan

    cfg = load_config(None, [("speed.token_budget", "auto")])
    plan = LearningPlan.resolve(cfg, False, short_model.config)
    assert plan.settings.token_budget >= 1024
    assert f"micro-batches of <= {plan.settings.token_budget} tokens" in plan.describe()


def test_auto_budget_leaves_room_for_what_a_large_model_holds_anyway():
    """From ~0.5B parameters in 24 GiB the weights, their copy, gradient, moments and logits leave less than
    three quarters of the memory: the budget is then 0.3 of what they leave (0.5B x 256 was OOM-killed at
    a quarter of the machine), below the floor too where that is all there is."""
    from transformers import LlamaConfig, Qwen2Config

    from hasten.bench import cost
    from hasten.bench.scaling import SHAPES
    from hasten.train.microbatch import (
        AUTO_FLOOR,
        AUTO_ROOM,
        AUTO_SHARE,
        COPY_BYTES,
        MOMENT_BYTES,
        RUNTIME_BYTES,
        activation_bytes_per_token,
        effective_logit_chunk,
        parameter_count,
        resolve_budget,
        static_bytes,
    )

    gib = 1024 ** 3
    qwen = Qwen2Config(**SHAPES["qwen2.5-0.5b"])
    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    assert parameter_count(smollm2) == 134_515_008 and parameter_count(qwen) == 494_032_768  # the published counts
    room = 24 * gib - static_bytes(qwen, False, 2048)
    assert 0 < AUTO_ROOM * room < AUTO_SHARE * 24 * gib
    assert resolve_budget("auto", qwen, False, total_bytes=24 * gib, logit_chunk=2048) == int(
        AUTO_ROOM * room) // activation_bytes_per_token(qwen, False)
    large = Qwen2Config(**SHAPES["qwen2.5-1.5b"])  # LoRA: the weights and their merged copy leave ~8 GiB
    tight = resolve_budget("auto", large, False, total_bytes=24 * gib, lora=True, logit_chunk=2048)
    assert tight < AUTO_FLOOR and tight == int(AUTO_ROOM * (24 * gib - static_bytes(large, True, 2048))) // (
        activation_bytes_per_token(large, False))
    assert resolve_budget("auto", qwen, False, total_bytes=24 * gib, lora=True, logit_chunk=2048) > resolve_budget(
        "auto", qwen, False, total_bytes=24 * gib, logit_chunk=2048)  # LoRA holds no gradient or moments
    smollm2_budget = resolve_budget("auto", smollm2, False, total_bytes=24 * gib, logit_chunk=2048, device="cuda")
    assert 0.95 * AUTO_SHARE * 24 * gib <= smollm2_budget * activation_bytes_per_token(smollm2, False) <= (
        AUTO_SHARE * 24 * gib)  # SmolLM2 on a device without the CPU cap: within 5% of a quarter of its memory
    # the bench's memory model counts the same static memory (full fine-tune: model + copy + logits + runtime)
    shape = cost.Shape.from_config(qwen)
    chunk = effective_logit_chunk(2048, qwen.vocab_size)
    for copy_bytes, moment_bytes in ((4, 8), (0, 8), (2, 4), (COPY_BYTES["int8"], MOMENT_BYTES["bf16"])):
        parts = cost.training_memory_bytes(shape, 32, 8, 48, 256, lora=False, logits_chunk=chunk,
                                           copy_bytes=copy_bytes, moment_bytes=moment_bytes)
        assert parts["model"] + parts["logits"] + parts["runtime"] == static_bytes(qwen, False, 2048, copy_bytes,
                                                                                   moment_bytes)
    # a full fine-tune's state is 16 bytes a parameter in fp32 (weight, gradient, two moments), 12 with bf16
    # moments; the engine's copy 4 in fp32 and 2 in bf16; LoRA keeps no gradient or moments
    count = parameter_count(qwen)
    assert static_bytes(qwen, False, 0, 4, 8) - static_bytes(qwen, False, 0, 4, 4) == 4 * count
    assert static_bytes(qwen, False, 0, 4, 8) - static_bytes(qwen, False, 0, 2, 8) == 2 * count
    assert static_bytes(qwen, True, 0, 0, 8) == static_bytes(qwen, True, 0, 0, 4) == 4 * count + RUNTIME_BYTES


def test_logit_chunks_are_bounded_in_bytes():
    from hasten.train.microbatch import LOGIT_CHUNK_BYTES, effective_logit_chunk

    assert effective_logit_chunk(2048, 49152) == 2048  # SmolLM2: as set
    assert effective_logit_chunk(2048, 151936) == LOGIT_CHUNK_BYTES // (4 * 151936) == 883  # Qwen2.5
    assert effective_logit_chunk(0, 151936) == 0 and effective_logit_chunk(16, 151936) == 16
    assert effective_logit_chunk(2048, 10 ** 9) == 1


@pytest.mark.parametrize("overrides, copy_bytes, moment_bytes", [
    ([], 4, 8),
    ([("train.optimizer_moments", "bf16")], 4, 4),
    ([("generation.precision", "bf16")], 2, 8),
    ([("generation.precision", "int8"), ("train.optimizer_moments", "bf16")], 2, 4),
    ([("speed.engine_weights", "shared")], 0, 8),
])
def test_auto_budget_counts_the_copy_and_moments_at_their_precision(monkeypatch, overrides, copy_bytes, moment_bytes):
    """token_budget=auto leaves room for what the run holds: bf16 moments and a bf16 or int8 sampling copy
    take less than fp32's, so at 0.5B (where the static memory binds) the budget grows with them."""
    from transformers import Qwen2Config

    from hasten.bench.scaling import SHAPES
    from hasten.train import learner, microbatch

    gib = 1024 ** 3
    monkeypatch.setattr(learner, "machine_bytes", lambda device="cpu": 24 * gib)
    monkeypatch.setattr(microbatch, "machine_bytes", lambda device="cpu": 24 * gib)
    qwen = Qwen2Config(**SHAPES["qwen2.5-0.5b"])
    cfg = load_config(None, [("speed.token_budget", "auto"), *overrides])
    expected = microbatch.resolve_budget("auto", qwen, False, total_bytes=24 * gib,
                                         logit_chunk=cfg.speed.logit_chunk_tokens, copy_bytes=copy_bytes,
                                         moment_bytes=moment_bytes)
    assert learner.token_budget(cfg, False, qwen) == expected
    plain = microbatch.resolve_budget("auto", qwen, False, total_bytes=24 * gib,
                                      logit_chunk=cfg.speed.logit_chunk_tokens)
    assert (expected > plain) == ((copy_bytes, moment_bytes) != (4, 8))


@pytest.mark.parametrize("family", ["llama", "llama_bias", "qwen2", "qwen2_untied"])
def test_parameter_count_is_the_models_own(family):
    """The memory estimate's parameter count against transformers' model of the same config: Llama's
    attention_bias puts a bias on o_proj too (it was missed), Qwen2's on q, k and v only."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from hasten.train.microbatch import parameter_count

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300)
    config, model_class = {
        "llama": (LlamaConfig(**shape, tie_word_embeddings=True), LlamaForCausalLM),
        "llama_bias": (LlamaConfig(**shape, tie_word_embeddings=True, attention_bias=True), LlamaForCausalLM),
        "qwen2": (Qwen2Config(**shape, tie_word_embeddings=True), Qwen2ForCausalLM),
        "qwen2_untied": (Qwen2Config(**shape, tie_word_embeddings=False), Qwen2ForCausalLM),
    }[family]
    model = model_class(config)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())  # tied weights counted once


def test_logit_chunks_are_cut_evenly():
    """As many chunks as the cap needs and none over it, all of one length but the last, which is short by fewer
    tokens than there are chunks: a 1,024-target micro-batch under Qwen2.5's 883-token cap is two chunks of
    512, not 883 + 141."""
    import math

    from hasten.train.packing import even_step

    assert even_step(1024, 883) == 512 and even_step(100, 0) == 100 and even_step(50, 883) == 50
    for count in range(1, 300):
        for cap in range(1, 40):
            step = even_step(count, cap)
            sizes = [min(step, count - start) for start in range(0, count, step)]
            assert len(sizes) == math.ceil(count / cap) and max(sizes) <= cap
            assert set(sizes[:-1]) <= {step} and step - sizes[-1] < len(sizes)
