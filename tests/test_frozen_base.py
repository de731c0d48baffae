"""kernels/frozen_base.py: under bf16 learning with LoRA the frozen base projections are held in bf16. The learning
pass gives the same bits (log-probs and every adapter gradient, torch.equal) on autocast's linears and on the
recast ones; the engine merges from the bf16 base; the file's pages of a converted weight leave the process
while anonymous memory is never touched; the plan applies it only where no fp32 pass can read the base."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from conftest import native_lora_model, pass_gradients, rollout_of
from hasten.kernels import fast_linear
from hasten.kernels.frozen_base import hold_in_bf16, reason_not


def _bases(model) -> list[torch.nn.Parameter]:
    return [module.base_layer.weight for module in model.modules() if hasattr(module, "lora_A")]


@pytest.mark.parametrize("recast", [True, False])  # False: autocast's own linears (gradient checkpointing's)
@pytest.mark.parametrize("precision", ["bf16", "bf16_fp32head"])
def test_the_learning_pass_reads_the_same_bits(monkeypatch, short_model, tokenizer, precision, recast):
    monkeypatch.setattr(fast_linear, "MIN_FEATURES", 1)  # route the tiny model's layers too
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=12)
    advantages = torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(0))
    model = native_lora_model(tokenizer)
    held = copy.deepcopy(model)
    fp32 = {id(p): p.detach().clone() for p in _bases(held)}
    assert hold_in_bf16(held) == 4 * sum(p.numel() for p in _bases(held))
    for weight in _bases(held):
        assert weight.dtype == torch.bfloat16 and not weight.requires_grad
        assert torch.equal(weight, fp32[id(weight)].to(torch.bfloat16))  # autocast's rounding, the Parameter kept
    _, logps, grads = pass_gradients(model, rollout, advantages, precision, recast, 0)
    _, held_logps, held_grads = pass_gradients(held, rollout, advantages, precision, recast, 0)
    assert torch.equal(logps, held_logps)
    assert len(grads) == len(held_grads) > 0 and all(torch.equal(a, b) for a, b in zip(grads, held_grads))
    assert hold_in_bf16(held) == 0  # nothing left to convert


def test_only_frozen_fp32_projection_bases_under_plain_lora_change(tokenizer):
    """Norms, the embedding and the head left out (LoRA on lm_head too), the adapters and a base being trained
    stay as they were; DoRA's layers (their weight norm reads the base in the input's dtype) keep an fp32 base."""
    from hasten.train.packing import backbone_and_head

    model = native_lora_model(tokenizer, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"])
    trained = _bases(model)[0]
    trained.requires_grad_(True)
    before = {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()}
    hold_in_bf16(model, leave=backbone_and_head(model)[1])
    changed = {name for name, p in model.named_parameters() if (p.dtype, p.data_ptr()) != before[name]}
    projections = {name for name in before if name.endswith("_proj.base_layer.weight")}
    assert changed == projections - {"base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"}
    assert trained.dtype == torch.float32 and not any("lm_head" in name or "embed" in name for name in changed)
    dora = native_lora_model(tokenizer, use_dora=True)
    assert hold_in_bf16(dora) == 0 and {weight.dtype for weight in _bases(dora)} == {torch.float32}


def test_the_engine_merges_from_the_bf16_base(tokenizer):
    """Greedy (fp32) sampling from the held model is the sampling of a model whose fp32 base is float(bf16(W)):
    the same tokens and log-probs; bf16 sampling runs on it too."""
    from hasten.rollout import SamplingParams
    from hasten.rollout.lean import LeanEngine, _effective

    model = native_lora_model(tokenizer).eval()
    held = copy.deepcopy(model)
    hold_in_bf16(held)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for weight in _bases(rounded):
            weight.copy_(weight.to(torch.bfloat16).float())  # the fp32 model the bf16 base stands for
    for linear in (m for m in held.modules() if hasattr(m, "lora_A")):
        weight, _ = _effective(linear)
        assert weight.dtype == torch.float32
    prompts = [tokenizer(text)["input_ids"] for text in ("hello there", "hi")]
    eos = [tokenizer.eos_token_id]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    ours = LeanEngine(held, tokenizer.pad_token_id, eos).generate(prompts, 1, greedy, seed=0)
    theirs = LeanEngine(rounded, tokenizer.pad_token_id, eos).generate(prompts, 1, greedy, seed=0)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.equal(ours.sampling_logprobs, theirs.sampling_logprobs)
    sampled = LeanEngine(held, tokenizer.pad_token_id, eos, sample_precision="bf16").generate(
        prompts, 2, SamplingParams(max_new_tokens=8, temperature=1.0), seed=0)
    assert torch.isfinite(sampled.sampling_logprobs).all()


def _mapping_rss_kib(path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_converted_weights_file_pages_leave_the_process(tmp_path, tokenizer):
    """A LoRA base lies on the weights file's private mapping: once converted, its pages are handed back (the
    mapping's resident size falls), and the values everything reads are the file's."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from hasten.models.llama import NativeLlamaForCausalLM

    torch.manual_seed(0)  # wide enough that each projection spans whole pages
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").resolve()
    model = get_peft_model(NativeLlamaForCausalLM.from_pretrained(tmp_path),
                           LoraConfig(r=4, target_modules=["q_proj", "gate_proj", "down_proj"]))
    expected = [weight.detach().clone().to(torch.bfloat16) for weight in _bases(model)]  # reads every page
    resident = _mapping_rss_kib(weights)
    converted = hold_in_bf16(model)
    assert converted > 0 and resident - _mapping_rss_kib(weights) >= 0.9 * converted / 1024
    assert all(torch.equal(weight, value) for weight, value in zip(_bases(model), expected))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7]])).logits).all()


def test_anonymous_memory_is_never_handed_back(tokenizer):
    """A base in the process's own memory (a model built in memory) is converted, and the old tensor, which
    something else may still hold, keeps its values: MADV_DONTNEED would have zeroed them."""
    model = native_lora_model(tokenizer)
    olds = [weight.data for weight in _bases(model)]
    copies = [old.clone() for old in olds]
    hold_in_bf16(model)
    assert all(torch.equal(old, value) for old, value in zip(olds, copies))


ELIGIBLE = dict(device="cpu", lora=True, native=True, precision="bf16_fp32head", engine="lean",
                engine_weights="copy", nan_guard_action="lower_lr", world_size=1, compiled=False)


@pytest.mark.parametrize("change", [
    {}, {"lora": False}, {"precision": "fp32"}, {"precision": "fp16"}, {"precision": "bf16"}, {"device": "cuda:0"},
    {"native": False}, {"engine": "vllm"}, {"engine": "hf"}, {"engine": "lean+speculative (ngram)"},
    {"engine_weights": "shared"}, {"nan_guard_action": "disable_mixed_precision"}, {"world_size": 2},
    {"compiled": True}])
def test_where_the_base_is_held_in_bf16(change):
    held = reason_not(**{**ELIGIBLE, **change}) is None
    assert held == (change in ({}, {"precision": "bf16"}))
