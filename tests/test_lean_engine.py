"""LeanEngine against KVCacheEngine (the unoptimized path) and a plain forward: same tokens
for the same seed, log-probs, the masks/EOS contract, weight sync after an optimizer step,
LoRA policies sampled from merged weights (and re-merged after an update), and the clear
refusal of adapters it cannot merge and of non-Llama models.

Token equality is exact here (259-token vocabulary). On SmolLM2 (49152 tokens) an
occasional sampled row differs: its uniform fell within ~1e-6 of a CDF step between
two ~1e-7-probability tokens, where float rounding of either forward decides."""

from __future__ import annotations

import pytest
import torch

from conftest import encode, make_engine
from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine
from hasten.train.logprobs import completion_logprobs

PROMPTS = ["hello there", "hi", "a much longer prompt, with punctuation!", "x"]


def lean_engine(model, tokenizer) -> LeanEngine:
    return LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])


def both(model, tokenizer, sampling, num_generations=4, seed=0):
    prompts = encode(tokenizer, PROMPTS)
    expected = make_engine(model, tokenizer).generate(prompts, num_generations, sampling, seed=seed)
    actual = lean_engine(model, tokenizer).generate(prompts, num_generations, sampling, seed=seed)
    return expected, actual


def assert_same_rollout(expected, actual):
    assert torch.equal(expected.prompt_ids, actual.prompt_ids)
    assert torch.equal(expected.prompt_mask, actual.prompt_mask)
    assert torch.equal(expected.completion_ids, actual.completion_ids)
    assert torch.equal(expected.completion_mask, actual.completion_mask)
    assert torch.equal(expected.ended_with_eos, actual.ended_with_eos)
    assert actual.num_generations == expected.num_generations
    assert (expected.sampling_logprobs - actual.sampling_logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_same_tokens_as_the_kv_cache_engine(model, tokenizer, temperature):
    for seed in (0, 1):
        expected, actual = both(model, tokenizer, SamplingParams(max_new_tokens=16, temperature=temperature), seed=seed)
        assert_same_rollout(expected, actual)


def test_same_tokens_when_rows_end_early(short_model, tokenizer):
    for sampling in (SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9)):
        expected, actual = both(short_model, tokenizer, sampling, num_generations=6)
        assert len(set(actual.completion_lengths.tolist())) > 2, "the EOS-prone model should give varied lengths"
        assert_same_rollout(expected, actual)


def test_rope_table_is_bitwise_hfs(model, tokenizer):
    engine = lean_engine(model, tokenizer)
    cos, signed_sin = engine._rope_table(300, torch.device("cpu"))  # (positions, head_dim)
    hf_cos, hf_sin = model.model.rotary_emb(torch.zeros(1), torch.arange(300)[None])  # (1, positions, head_dim)
    half = engine.head_dim // 2
    assert torch.equal(cos, hf_cos[0])
    assert torch.equal(signed_sin[:, half:], hf_sin[0, :, half:]) and torch.equal(signed_sin[:, :half], -hf_sin[0, :, :half])
    theta = model.config.rope_parameters["rope_theta"]  # the buffer is HF's default-rope formula
    expected = 1.0 / (theta ** (torch.arange(0, engine.head_dim, 2, dtype=torch.float) / engine.head_dim))
    assert torch.equal(model.model.rotary_emb.inv_freq, expected)


def test_plain_matmul_fallback_gives_the_same_rollout(model, tokenizer):
    engine = lean_engine(model, tokenizer)
    engine.linear.packed = False  # as where oneDNN is missing, or for bf16 / non-CPU weights
    engine.sync_weights(force=True)
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12)
    expected = make_engine(model, tokenizer).generate(prompts, 3, sampling, seed=4)
    assert_same_rollout(expected, engine.generate(prompts, 3, sampling, seed=4))


def test_logprobs_equal_a_plain_forward(short_model, tokenizer):
    engine = lean_engine(short_model, tokenizer)
    for temperature in (1.0, 0.7):
        rollout = engine.generate(encode(tokenizer, PROMPTS), 4, SamplingParams(12, temperature=temperature), seed=2)
        group = torch.arange(rollout.num_samples) // rollout.num_generations
        with torch.no_grad():
            expected = completion_logprobs(
                short_model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                rollout.completion_ids, rollout.completion_mask, temperature,
            ).logps
        mask = rollout.completion_mask.bool()
        assert (expected - rollout.sampling_logprobs)[mask].abs().max() < 1e-4
        assert rollout.sampling_logprobs[~mask].eq(0).all()


def test_eos_ends_a_row_and_masks_the_rest(short_model, tokenizer):
    rollout = lean_engine(short_model, tokenizer).generate(encode(tokenizer, PROMPTS), 4, SamplingParams(10), seed=0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = rollout.completion_lengths.tolist()
    for row, length in enumerate(lengths):
        ids = rollout.completion_ids[row].tolist()
        assert rollout.completion_mask[row, :length].all() and not rollout.completion_mask[row, length:].any()
        assert all(token == pad for token in ids[length:])
        if rollout.ended_with_eos[row]:
            assert ids[length - 1] == eos and eos not in ids[: length - 1]
        else:
            assert length == 10 and eos not in ids[:length]
    assert rollout.completion_ids.shape[1] == max(lengths)  # trimmed to the longest row


def test_generate_follows_the_weights_after_an_optimizer_step(model, tokenizer):
    engine = lean_engine(model, tokenizer)
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12)
    before = engine.generate(prompts, 2, sampling, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    ids = torch.tensor([prompts[0] * 3])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # updates every weight in place, the fused ones included
    after = engine.generate(prompts, 2, sampling, seed=0)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert_same_rollout(make_engine(model, tokenizer).generate(prompts, 2, sampling, seed=0), after)


def test_fused_adamw_update_is_followed_after_weights_changed(tokenizer):
    # torch's fused CPU AdamW does not bump _version, so the version check alone misses it;
    # the trainer calls weights_changed() after every update for that reason.
    from hasten.models.tiny import tiny_model

    model = tiny_model(len(tokenizer), seed=3)
    engine = lean_engine(model, tokenizer)
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12)
    before = engine.generate(prompts, 2, sampling, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    ids = torch.tensor([prompts[0] * 3])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    engine.weights_changed()
    after = engine.generate(prompts, 2, sampling, seed=0)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert_same_rollout(make_engine(model, tokenizer).generate(prompts, 2, sampling, seed=0), after)


def test_sync_weights_rebuilds_only_after_a_change(model, tokenizer):
    engine = lean_engine(model, tokenizer)
    assert engine.layers == []  # built by the first generate (or sync), not at construction
    engine.sync_weights()
    prepared = engine.layers
    assert len(prepared) == len(model.model.layers)
    engine.sync_weights()
    assert engine.layers is prepared  # nothing changed: no copy, no repacking
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(0.5)  # any in-place update bumps the version
    engine.sync_weights()
    assert engine.layers is not prepared
    prepared = engine.layers
    engine.sync_weights(force=True)
    assert engine.layers is not prepared


def test_same_seed_same_samples_and_other_seed_differs(model, tokenizer):
    engine, prompts, sampling = lean_engine(model, tokenizer), encode(tokenizer, PROMPTS), SamplingParams(12)
    first, again = engine.generate(prompts, 3, sampling, seed=7), engine.generate(prompts, 3, sampling, seed=7)
    other = engine.generate(prompts, 3, sampling, seed=8)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert torch.equal(first.sampling_logprobs, again.sampling_logprobs)
    assert not torch.equal(first.completion_ids, other.completion_ids)


def lora_pair(tokenizer, seed=0):
    """The same LoRA adapters (B non-zero, so they matter) on the tiny model in transformers and natively."""
    from peft import LoraConfig, get_peft_model

    from hasten.models.llama import NativeLlamaForCausalLM
    from hasten.models.tiny import tiny_model

    def wrap(model):
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                            task_type="CAUSAL_LM")
        return get_peft_model(model, config)

    hf = wrap(tiny_model(len(tokenizer), seed=seed))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in hf.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: the merge would be a no-op
                parameter.normal_(0.0, 0.2)
    native = wrap(NativeLlamaForCausalLM.from_hf(tiny_model(len(tokenizer), seed=seed)))
    native.load_state_dict(hf.state_dict())
    return hf, native


def test_lora_policy_samples_from_merged_weights(tokenizer):
    hf, native = lora_pair(tokenizer)
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12, temperature=0.8)
    expected = make_engine(hf, tokenizer).generate(prompts, 3, sampling, seed=3)  # peft's unmerged forward
    for policy in (native, hf):
        before = {name: p.clone() for name, p in policy.named_parameters()}
        assert_same_rollout(expected, lean_engine(policy, tokenizer).generate(prompts, 3, sampling, seed=3))
        after = dict(policy.named_parameters())
        assert all(torch.equal(before[name], after[name]) for name in before)  # adapters kept, W untouched
    with hf.disable_adapter():  # the merge really added B @ A: without it the samples differ
        assert not torch.equal(expected.completion_ids,
                               make_engine(hf, tokenizer).generate(prompts, 3, sampling, seed=3).completion_ids)


def test_lora_update_is_remerged_after_weights_changed(tokenizer):
    _, policy = lora_pair(tokenizer)
    engine = lean_engine(policy, tokenizer)
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12)
    before = engine.generate(prompts, 2, sampling, seed=0)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name, p in policy.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=0.05, fused=True)  # fused: no version bump, as in training
    ids = torch.tensor([prompts[0] * 3])
    logits = policy(input_ids=ids).logits  # (1, L, V)
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    optimizer.step()
    engine.weights_changed()
    after = engine.generate(prompts, 2, sampling, seed=0)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    expected, _ = lora_pair(tokenizer)
    expected.load_state_dict(policy.state_dict())  # the updated adapters, on transformers' KV-cache engine
    assert_same_rollout(make_engine(expected, tokenizer).generate(prompts, 2, sampling, seed=0), after)


@pytest.mark.parametrize("lora", [{"target_modules": ["q_proj", "embed_tokens"]},
                                  {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
                                  {"target_modules": ["q_proj"], "use_dora": True}])
def test_lora_the_engine_cannot_merge_is_refused(model, tokenizer, lora):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(model, LoraConfig(r=4, task_type="CAUSAL_LM", **lora))
    with pytest.raises(ValueError, match="LeanEngine"):
        lean_engine(policy, tokenizer)


def test_other_architectures_are_refused(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        lean_engine(gpt2, tokenizer)


def test_empty_prompt_is_refused(model, tokenizer):
    with pytest.raises(ValueError, match="at least one token"):
        lean_engine(model, tokenizer).generate([[5], []], 2, SamplingParams(4), seed=0)


def test_a_resync_drops_the_old_copy_before_making_the_new_one(tokenizer, monkeypatch):
    # Two engine copies beside the model at once were the 0.5B cell's missing 1.7 GiB (docs/scaling.md):
    # by the time the first new matrix is prepared, no matrix of the previous sync may be alive.
    import gc
    import weakref

    from hasten.models.tiny import tiny_model
    from hasten.rollout.lean import LeanEngine, Matmul

    model = tiny_model(len(tokenizer))
    engine = LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    old = [weakref.ref(tensor) for layer in engine.layers for tensor in (layer.qkv, layer.out, layer.gate_up,
                                                                         layer.down)]
    alive_at_first_prepare = []
    original = Matmul.prepare

    def prepare(self, weight, *args, **kwargs):
        if not alive_at_first_prepare:
            gc.collect()
            alive_at_first_prepare.append(sum(ref() is not None for ref in old))
        return original(self, weight, *args, **kwargs)

    monkeypatch.setattr(Matmul, "prepare", prepare)
    engine.sync_weights(force=True)
    assert alive_at_first_prepare == [0]
