"""The native model and the lean engine on every Llama family they claim (models/families.py):
Qwen2 (q/k/v biases, tied or untied head), Qwen3 (qk-norm, explicit head_dim, with and without
attention_bias), Llama with Llama-3 and linear rope scaling and with biases, Mistral. Each is a
random-init transformers model built from its config (no download), with its biases and norm
weights perturbed so that they matter, compared with its native copy: logits, padded and packed
log-probs and gradients, the lean engine's tokens against the KV-cache engine on transformers,
oneDNN fast_linear with biases, and checkpoints both ways. Plus the configs that are refused."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import make_engine, rollout_of
from test_lean_engine import PROMPTS, assert_same_rollout
from test_native_llama import native_copy, plain

from hasten.models.families import unsupported_reason
from hasten.models.llama import NativeLlamaForCausalLM
from hasten.rollout import SamplingParams
from hasten.rollout.engine import left_pad
from hasten.rollout.lean import LeanEngine
from hasten.kernels import fast_linear
from hasten.train.packing import packed_logprobs

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # 64: all three bands at head_dim 16
FAMILIES = {
    "qwen2-tied": ("Qwen2", {"tie_word_embeddings": True}),
    "qwen2-untied": ("Qwen2", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3", {"head_dim": 24, "tie_word_embeddings": False}),  # 24 != 64 / 4
    "qwen3-bias": ("Qwen3", {"head_dim": 24, "attention_bias": True, "tie_word_embeddings": True}),
    "llama3-rope": ("Llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope": ("Llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-biases": ("Llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("Mistral", {"sliding_window": None}),
    "mistral-long-window": ("Mistral", {"sliding_window": 4096}),  # >= max_position_embeddings: never masks
}


def family_model(kind: str, vocab_size: int, seed: int = 0):
    """A small random-init transformers model of this family, biases and norm weights made non-trivial."""
    import transformers

    prefix, overrides = FAMILIES[kind]
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **overrides,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():  # HF initializes biases to 0 and norms to 1: neither would be tested
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0.0, 0.2)
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return model


@pytest.fixture(params=list(FAMILIES))
def family(request, tokenizer):
    """(kind, transformers model, native copy), both EOS-prone so completions end at varied lengths."""
    hf = family_model(request.param, len(tokenizer))
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 3.5
    hf.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    return request.param, hf, native_copy(hf, bias)


def test_logits_and_parameters_equal_transformers(family, tokenizer):
    kind, hf, native = family
    assert set(hf.state_dict()) == set(native.state_dict())
    assert (native.lm_head.weight is native.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    assert torch.equal(native.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)  # bitwise, scaled rope too
    ids, mask = left_pad([tokenizer(text)["input_ids"] for text in ("hello there, a longer one", "hi")], 0)  # (2, L)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = native(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert (expected - got)[mask.bool()].abs().max() < 1e-4, kind


def test_padded_logprobs_equal_transformers(family, tokenizer):
    kind, hf, native = family
    rollout = rollout_of(hf, tokenizer, num_generations=3)
    rows = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        expected, got = plain(hf, rollout, rows), plain(native, rollout, rows)
    assert (expected.logps - got.logps)[mask].abs().max() < 1e-4, kind
    assert (expected.entropy - got.entropy)[mask].abs().max() < 1e-4, kind


@pytest.mark.parametrize("grouped", [False, True])
def test_packed_pass_and_gradients_equal_transformers(family, tokenizer, grouped):
    kind, hf, native = family
    rollout = rollout_of(hf, tokenizer, num_generations=4)
    rows = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask
    weights = torch.linspace(-1, 1, rollout.num_samples)[:, None]
    (plain(hf, rollout, rows).logps * mask * weights).sum().backward()
    got = packed_logprobs(native, rollout, rows, 1.0, True, 7, grouped)
    (got.logps * mask * weights).sum().backward()
    assert (plain(hf, rollout, rows).logps - got.logps)[mask.bool()].abs().max() < 1e-4, kind
    hf_grads = dict(hf.named_parameters())
    for name, parameter in native.named_parameters():
        assert torch.allclose(parameter.grad, hf_grads[name].grad, atol=1e-5, rtol=1e-4), (kind, name)


def test_grouped_pass_with_a_shared_prefix_on_either_implementation(family, tokenizer):
    """The unpadded grouped pass with the prompts' common prefix held once (speed.shared_prefix), run on
    transformers' own class of the family (its mask handling takes the one-row placeholder mask) and on the
    native copy: the plain pass's log-probs."""
    from test_shared_prefix import PREFIXED

    kind, hf, native = family
    prompts = [tokenizer(text)["input_ids"] for text in PREFIXED]
    rollout = make_engine(hf, tokenizer).generate(prompts, 3, SamplingParams(max_new_tokens=10), seed=0)
    rows = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        expected = plain(hf, rollout, rows)
        for model in (hf, native):
            got = packed_logprobs(model, rollout, rows, 1.0, False, 0, grouped=True, shared_prefix=True)
            assert (expected.logps - got.logps)[mask].abs().max() < 1e-4, (kind, type(model).__name__)


def test_lean_engine_samples_what_the_kv_cache_engine_samples_on_transformers(family, tokenizer):
    kind, hf, native = family
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    for sampling in (SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9)):
        expected = make_engine(hf, tokenizer).generate(prompts, 3, sampling, seed=1)
        for model in (native, hf):  # the lean engine runs on either implementation
            actual = LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(prompts, 3, sampling, 1)
            assert_same_rollout(expected, actual)
        assert len(set(expected.completion_lengths.tolist())) > 1, kind  # rows ended at different steps


def _packed_gradients(hf, rollout, kernels) -> tuple[dict, object]:
    """One packed learning pass of a native copy of `hf` inside `kernels(native)` (a context manager): the
    gradients by parameter name, and what the context yielded."""
    native = native_copy(hf)
    rows, mask = torch.arange(rollout.num_samples), rollout.completion_mask
    with kernels(native) as yielded:
        (packed_logprobs(native, rollout, rows, 1.0, False, 0, True).logps.float() * mask).sum().backward()
    return {name: p.grad for name, p in native.named_parameters()}, yielded


@pytest.mark.skipif(not fast_linear.available(), reason="torch built without oneDNN's fp32 linear")
@pytest.mark.parametrize("kind", ["qwen2-untied", "qwen3-bias", "llama-biases"])
def test_onednn_linears_with_biases_give_the_same_gradients(kind, tokenizer, monkeypatch):
    monkeypatch.setattr(fast_linear, "MIN_FEATURES", 1)  # the test model's layers are below the threshold
    hf = family_model(kind, len(tokenizer))
    rollout = rollout_of(hf, tokenizer, num_generations=2)

    def gradients(routed: bool):
        grads, count = _packed_gradients(hf, rollout, lambda native: fast_linear.onednn_linears(native, routed))
        assert (count > 0) == routed
        return grads

    reference, routed = gradients(False), gradients(True)
    assert any(name.endswith("bias") for name in routed)
    for name, grad in reference.items():
        assert torch.allclose(grad, routed[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("kind", ["qwen2-untied", "qwen3-bias", "llama3-rope", "mistral"])
def test_checkpoints_load_both_ways(kind, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = family_model(kind, len(tokenizer))
    ids = torch.tensor([tokenizer("round trip")["input_ids"]])
    hf.save_pretrained(tmp_path / "hf")
    native = NativeLlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        native.model.layers[0].self_attn.q_proj.weight.add_(0.01)  # a trained model differs from its init
    native.save_pretrained(tmp_path / "native")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32)
    assert type(reloaded) is type(hf)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, native(ids).logits, atol=1e-5)


def test_refused_configs_say_why():
    assert unsupported_reason({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32768,
                               "max_position_embeddings": 32768, "max_window_layers": 21}) is None  # Qwen2.5's
    assert unsupported_reason({"model_type": "mistral", "sliding_window": None}) is None  # Mistral v0.2+
    v01 = {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}  # Mistral-7B-v0.1
    assert "sliding_window 4096 < max_position_embeddings 32768" in unsupported_reason(v01)
    windowed = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096,
                "max_position_embeddings": 32768}
    assert "sliding_window 4096" in unsupported_reason(windowed)
    dynamic = {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    assert "rope_type 'dynamic'" in unsupported_reason(dynamic)
    assert "partial_rotary_factor" in unsupported_reason({"model_type": "llama", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="sliding_window"):
        from transformers import MistralConfig, MistralForCausalLM

        NativeLlamaForCausalLM.from_hf(MistralForCausalLM(MistralConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64, sliding_window=16)))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("kind", ["qwen3-bias", "qwen2-untied"])
def test_the_lean_learning_pass_gives_autograds_bits(kind, bf16, tokenizer, monkeypatch):
    """With qk-norm (Qwen3) and biases: the native pass whose norms form their normalized state, and whose MLPs
    form down_proj's input, again in backward (and whose recast linears cast a norm's output again) gives the
    plain pass's gradients bit for bit, fp32 and bf16 autocast."""
    from hasten.kernels.recast_linear import recast_linears

    monkeypatch.setattr(fast_linear, "MIN_FEATURES", 1)  # the test model's layers are below the threshold
    hf = family_model(kind, len(tokenizer))
    rollout = rollout_of(hf, tokenizer, num_generations=2)

    @contextlib.contextmanager
    def kernels(native):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), \
                recast_linears(native, bf16, leave=native.lm_head) as routed:
            yield routed

    def gradients(lean: bool):
        with monkeypatch.context() as patch:
            if not lean:  # as if inside another saved-tensor hook: autograd's own saves throughout
                patch.setattr("hasten.models.llama._outer_saved_tensor_hooks", lambda: True)
            return _packed_gradients(hf, rollout, kernels)[0]

    plain, lean = gradients(False), gradients(True)
    assert plain.keys() == lean.keys() and any("q_norm" in name for name in plain) == kind.startswith("qwen3")
    for name, grad in plain.items():
        assert torch.equal(grad, lean[name]), name
