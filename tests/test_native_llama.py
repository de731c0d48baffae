"""The native Llama (models/llama.py) and its tokenizer (models/tokenizer.py) stand in for transformers':
same logits, log-probs and gradients; checkpoints that load both ways; the same text <-> ids; and the
trainer picks it by speed.model_impl."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

from conftest import eos_prone_model, rollout_of, tiny_config
from hasten.config import ConfigError
from hasten.models.llama import NativeLlamaForCausalLM, unsupported_reason
from hasten.models.tokenizer import FastTokenizer
from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine
from hasten.train.logprobs import completion_logprobs
from hasten.train.packing import packed_logprobs


def native_copy(hf_model, bias: torch.Tensor | None = None):
    native = NativeLlamaForCausalLM.from_hf(hf_model)
    if bias is not None:  # eos_prone_model's hook, so both see one distribution
        native.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    return native


@pytest.fixture
def pair(tokenizer):
    hf = eos_prone_model(tokenizer)
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 3.5
    return hf, native_copy(hf, bias)


def plain(model, rollout, rows, temperature=1.0):
    group = rows // rollout.num_generations
    return completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                               rollout.completion_ids[rows], rollout.completion_mask[rows], temperature, True)


def test_parameter_names_and_values_are_transformers(pair):
    hf, native = pair
    hf_state, native_state = hf.state_dict(), native.state_dict()
    assert set(hf_state) == set(native_state)
    assert all(torch.equal(hf_state[k], native_state[k]) for k in hf_state)
    assert native.lm_head.weight is native.model.embed_tokens.weight  # tied, as in the config


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_logprobs_equal_transformers(pair, tokenizer, temperature):
    hf, native = pair
    rollout = rollout_of(hf, tokenizer, num_generations=3)  # left-padded prompts, ragged completions
    rows = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        expected, got = plain(hf, rollout, rows, temperature), plain(native, rollout, rows, temperature)
    assert (expected.logps - got.logps)[mask].abs().max() < 1e-5
    assert (expected.entropy - got.entropy)[mask].abs().max() < 1e-5


@pytest.mark.parametrize("grouped", [False, True])
def test_packed_pass_and_gradients_equal_transformers_plain_pass(pair, tokenizer, grouped):
    hf, native = pair
    rollout = rollout_of(hf, tokenizer, num_generations=4)
    rows = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask
    weights = torch.linspace(-1, 1, rollout.num_samples)[:, None]

    expected = plain(hf, rollout, rows)
    (expected.logps * mask * weights).sum().backward()
    got = packed_logprobs(native, rollout, rows, 1.0, True, 7, grouped)
    (got.logps * mask * weights).sum().backward()

    assert (expected.logps - got.logps)[mask.bool()].abs().max() < 1e-4
    hf_grads = dict(hf.named_parameters())
    for name, parameter in native.named_parameters():
        assert torch.allclose(parameter.grad, hf_grads[name].grad, atol=1e-5, rtol=1e-4), name


def test_gradient_checkpointing_gives_the_same_gradients(pair, tokenizer):
    hf, native = pair
    rollout = rollout_of(hf, tokenizer, num_generations=2)
    rows = torch.arange(rollout.num_samples)

    def gradients(model):
        model.zero_grad()
        (plain(model, rollout, rows).logps * rollout.completion_mask).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = gradients(native)
    recomputing = copy.deepcopy(native)
    recomputing.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert recomputing.is_gradient_checkpointing
    for a, b in zip(reference, gradients(recomputing)):
        assert torch.allclose(a, b, atol=1e-6)


def test_lean_engine_samples_the_same_tokens_on_either_model(pair, tokenizer):
    hf, native = pair
    prompts = [tokenizer(text)["input_ids"] for text in ("hello there", "hi", "a longer prompt, with commas")]
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0)
    results = [LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(prompts, 3, sampling, 5)
               for model in (hf, native)]
    assert torch.equal(results[0].completion_ids, results[1].completion_ids)
    assert torch.allclose(results[0].sampling_logprobs, results[1].sampling_logprobs, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_autograd_bitwise_and_keeps_one_tensor_fewer(dtype):
    """The MLP's SiluMul equals autograd on silu(gate) * up bit for bit (output and both gradients), and an
    MLP's learning pass keeps one intermediate-wide tensor less (gate, up and the product; not silu(gate))."""
    from hasten.models.llama import MLP, LlamaSettings, SiluMul

    torch.manual_seed(0)
    gate, up = (torch.randn(3, 5, 64, dtype=dtype) * 4 for _ in range(2))
    upstream = torch.randn(3, 5, 64, dtype=dtype)

    def run(function):
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
        out = function(g, u)
        out.backward(upstream)
        return out.detach(), g.grad, u.grad

    for fused, reference in zip(run(SiluMul.apply), run(lambda g, u: torch.nn.functional.silu(g) * u)):
        assert torch.equal(fused, reference)
    g = gate.clone().requires_grad_()  # only one input trained: the other gets no gradient
    SiluMul.apply(g, up).backward(upstream)
    assert torch.equal(g.grad, run(lambda g, u: torch.nn.functional.silu(g) * u)[1])

    settings = LlamaSettings.from_dict({"model_type": "llama", "hidden_size": 16, "intermediate_size": 48,
                                        "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 32,
                                        "rope_theta": 10000.0})
    mlp = MLP(settings)
    x = torch.randn(2, 7, 16, requires_grad=True)
    parameters = {p.untyped_storage().data_ptr() for p in mlp.parameters()}

    def saved_bytes(function) -> int:
        seen = {}

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in parameters:
                seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            function()
        return sum(seen.values())

    token_bytes = 2 * 7 * 4
    fused = saved_bytes(lambda: mlp(x))
    plain = saved_bytes(lambda: mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    assert fused == token_bytes * (16 + 3 * 48) and plain == fused + token_bytes * 48
    with torch.no_grad():  # no graph: the plain ops, the same values
        assert torch.equal(mlp(x), mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


def test_checkpoints_load_both_ways(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from hasten.models.tiny import tiny_model

    hf = tiny_model(len(tokenizer))
    native = NativeLlamaForCausalLM.from_hf(hf)
    with torch.no_grad():
        native.model.layers[0].mlp.up_proj.weight.add_(0.01)  # a trained model differs from its init
    native.save_pretrained(tmp_path / "native")
    ids = torch.tensor([tokenizer("round trip")["input_ids"]])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, native(ids).logits, atol=1e-5)
    hf.save_pretrained(tmp_path / "hf")
    loaded = NativeLlamaForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, hf(ids).logits, atol=1e-5)


def test_unsupported_models_are_named():
    assert unsupported_reason({"model_type": "llama", "hidden_act": "silu", "attention_bias": True}) is None
    assert "model_type 'gpt2'" in unsupported_reason({"model_type": "gpt2"})
    assert "hidden_act 'gelu'" in unsupported_reason({"model_type": "llama", "hidden_act": "gelu"})
    assert unsupported_reason({"model_type": "llama", "rope_parameters": {"rope_type": "default"}}) is None
    assert "rope_type 'dynamic'" in unsupported_reason({"model_type": "llama", "rope_scaling": {"type": "dynamic"}})
    assert "rope_type 'yarn'" in unsupported_reason({"model_type": "qwen2", "rope_scaling": {"rope_type": "yarn"}})


def test_fast_tokenizer_matches_transformers(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(tokenizer.chat_template)
    fast = FastTokenizer(tmp_path)
    texts = ["hello there", "Ünïcode and emoji 🙂, tabs\tand\nnewlines", "<|im_end|> as text"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert fast(text, add_special_tokens=False)["input_ids"] == ids
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    for generation_prompt in (True, False):
        assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt) == \
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert (fast.eos_token_id, fast.pad_token_id, len(fast)) == (tokenizer.eos_token_id, tokenizer.pad_token_id,
                                                                 len(tokenizer))
    fast.save_pretrained(tmp_path / "copy")
    assert FastTokenizer(tmp_path / "copy")("hi", add_special_tokens=False) == fast("hi", add_special_tokens=False)


_config = tiny_config


def test_speed_model_impl_picks_the_implementation():
    from hasten.rollout.factory import use_native_model

    logged: list[str] = []
    assert use_native_model(_config(), logged.append) is True
    assert use_native_model(_config(model_impl="hf"), logged.append) is False
    assert use_native_model(_config(engine="hf"), logged.append) is False  # auto: logged, not an error
    assert any("speed.engine=hf" in line for line in logged)
    with pytest.raises(ConfigError, match="speed.model_impl=native"):
        use_native_model(_config(model_impl="native", engine="hf"))
    lora = _config(model_impl="native")
    lora.model.lora = True
    assert use_native_model(lora) is True  # peft wraps the native model


def test_lora_runs_on_the_native_model_and_the_lean_engine(tokenizer):
    """model.lora with speed.model_impl/engine auto: peft wraps the native Llama, the lean engine samples
    from its merged weights, and the KL reference is the same model with adapters disabled."""
    from hasten.models import Reference, load_policy
    from hasten.models.tiny import tiny_model
    from hasten.rollout.factory import make_engine, use_native_model

    cfg = _config()
    cfg.model.lora, cfg.model.lora_r = True, 4
    logged: list[str] = []
    policy = load_policy(cfg.model, logged.append, native=use_native_model(cfg, logged.append))
    assert isinstance(policy.model.get_base_model(), NativeLlamaForCausalLM) and policy.lora
    assert isinstance(make_engine(cfg, policy, logged.append), LeanEngine)
    assert all(line.startswith(("speed.engine_weights=auto: ", "generation.precision=auto: "))
               for line in logged)  # no fallback to report
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name:
                parameter.add_(0.1)  # the adapters now change the output
        adapted = policy.model(input_ids=ids).logits
        with Reference(policy).active() as reference:
            base = reference(input_ids=ids).logits
        assert torch.allclose(base, native_copy(tiny_model(len(tokenizer)))(input_ids=ids).logits, atol=1e-6)
    assert not torch.allclose(adapted, base, atol=1e-3)


def _file_mapped(tensor: torch.Tensor, path) -> bool:
    """True when the tensor's first byte lies in a mapping of `path` (/proc/self/maps)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(end, 16) for end in fields[0].split("-"))
            if low <= address < high:
                return len(fields) == 6 and fields[5].strip() == str(path)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("native", [True, False])
def test_full_fine_tune_weights_are_not_the_files_pages(tmp_path, tokenizer, native):
    """safetensors maps the weights file copy-on-write and both loaders keep those pages as the
    parameters; load_policy copies them for a full fine-tune (the first optimizer step would otherwise
    fault on every 4 KiB page), and a LoRA base stays on the file, which nothing writes."""
    from hasten.config import ModelConfig
    from hasten.models import load_policy, own_memory
    from hasten.models.tiny import tiny_model

    tiny_model(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").resolve()
    raw = NativeLlamaForCausalLM.from_pretrained(tmp_path)  # the loader alone: the check sees the mapping
    assert any(_file_mapped(p, weights) for p in raw.parameters())
    expected = {name: p.detach().clone() for name, p in raw.named_parameters()}
    del raw

    policy = load_policy(ModelConfig(name=str(tmp_path)), log=lambda text: None, native=native)
    assert not any(_file_mapped(p, weights) for p in policy.model.parameters())
    loaded = dict(policy.model.named_parameters())
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)  # the file's values
    assert policy.model.config.tie_word_embeddings  # the tiny model ties its head: still one tensor
    assert policy.model.get_output_embeddings().weight is policy.model.get_input_embeddings().weight

    owned = {name: p.data_ptr() for name, p in policy.model.named_parameters()}
    own_memory(policy.model)  # memory torch owns already is not copied again
    assert {name: p.data_ptr() for name, p in policy.model.named_parameters()} == owned

    lora = load_policy(ModelConfig(name=str(tmp_path), lora=True, lora_r=4), log=lambda text: None,
                       native=native)
    base = [p for name, p in lora.model.named_parameters() if "lora_" not in name]
    assert any(_file_mapped(p, weights) for p in base)


def test_lora_keeps_no_full_size_gradient_or_optimizer_buffers(tokenizer):
    """LoRA without full-size gradient buffers (issue 33): the base weights are frozen, so backward
    leaves them without a .grad and AdamW holds moments for the adapters only."""
    from hasten.models import load_policy
    from hasten.rollout.factory import use_native_model
    from hasten.train.learner import Learner

    cfg = _config()
    cfg.model.lora, cfg.model.lora_r = True, 4
    policy = load_policy(cfg.model, lambda _: None, native=use_native_model(cfg, lambda _: None))
    learner = Learner.from_config(policy, cfg, log=lambda _: None)
    trained = [p for group in learner.optimization.optimizer.param_groups for p in group["params"]]
    names = {id(p): name for name, p in policy.model.named_parameters()}
    assert trained and all("lora_" in names[id(p)] for p in trained)
    total = sum(p.numel() for p in policy.model.parameters())
    assert sum(p.numel() for p in trained) < total / 5
    policy.model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.sum().backward()
    for name, parameter in policy.model.named_parameters():
        assert (parameter.grad is not None) == ("lora_" in name), name


def test_speed_model_impl_learns_the_same(pair, tokenizer):
    """speed.model_impl=native and =hf: one Learner.step on either implementation of the same weights gives the
    same loss and gradients (within fp32 reordering)."""
    from conftest import learner_step
    from hasten.rollout.factory import use_native_model

    hf, native = pair
    rollout = rollout_of(hf, tokenizer, num_generations=4)
    advantages = torch.linspace(-1.0, 1.0, rollout.num_samples)
    models = {"hf": hf, "native": native}
    assert {impl: use_native_model(_config(model_impl=impl), lambda text: None) for impl in models} == {
        "hf": False, "native": True}  # the key picks exactly these two implementations
    results = {impl: learner_step(model, tokenizer, rollout, advantages, lambda cfg: None)
               for impl, model in models.items()}
    assert results["native"][0]["loss"] == pytest.approx(results["hf"][0]["loss"], abs=1e-6)
    gradients = {impl: dict(zip([name for name, _ in model.named_parameters()], results[impl][1]))
                 for impl, model in models.items()}  # by name: the two list their parameters in their own order
    assert set(gradients["hf"]) == set(gradients["native"])
    for name, gradient in gradients["hf"].items():
        assert torch.allclose(gradient, gradients["native"][name], atol=1e-5, rtol=1e-4), name



def _lean_off(monkeypatch):
    """The learning pass as before the product hooks: MLP takes them for outer hooks and leaves the saves alone."""
    monkeypatch.setattr("hasten.models.llama._outer_saved_tensor_hooks", lambda: True)


def _lean_gradients(model, tokenizer, monkeypatch, lean: bool, bf16: bool):
    from hasten.kernels.recast_linear import recast_linears

    if not lean:
        _lean_off(monkeypatch)
    torch.manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (2, 24))
    model.zero_grad(set_to_none=True)
    head = model.get_base_model().lm_head if hasattr(model, "get_base_model") else model.lm_head
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16), recast_linears(model, bf16, leave=head):
        logits = model(input_ids=ids).logits.float()
    (logits.log_softmax(-1)[..., 5].sum()).backward()
    monkeypatch.undo()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_product_formed_again_gives_autograds_gradients_bit_for_bit(tokenizer, monkeypatch, bf16, lora):
    """down_proj's saved input, the SiLU-gated product, is formed again from gate and up in backward
    (MLP's saved-tensor hooks), and each norm's normalized state from its input and rstd (RMSNorm's explicit
    F.rms_norm ops): the same ops, so every gradient is autograd's (F.rms_norm's, the saved product's) bit for
    bit; fp32 or bf16 autocast with recast linears, full or LoRA (peft's adapters on down_proj save a view of
    the product)."""
    from hasten.models.tiny import tiny_model

    model = native_copy(tiny_model(len(tokenizer))).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj", "up_proj"]))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1)
    plain = _lean_gradients(model, tokenizer, monkeypatch, False, bf16)
    lean = _lean_gradients(model, tokenizer, monkeypatch, True, bf16)
    assert plain.keys() == lean.keys() and plain
    for name in plain:
        assert torch.equal(plain[name], lean[name]), name


def test_the_product_is_not_held_for_backward(tokenizer, monkeypatch):
    """After a learning pass's forward the SiLU-gated product is gone (a weak reference dies), where autograd
    kept it for down_proj's backward. Under gradient checkpointing (the layer recomputed whole) or inside
    another saved-tensor hook (an outer checkpoint) the hooks stay out of the way; a forward run between a
    checkpointed forward and its backward changes nothing the recompute saves."""
    import weakref

    from torch.utils.checkpoint import checkpoint

    from hasten.models import llama
    from hasten.models.tiny import tiny_model

    model = native_copy(tiny_model(len(tokenizer))).train()
    ids = torch.randint(3, len(tokenizer), (2, 24))
    layers = model.config.num_hidden_layers
    hooked = []
    again = llama._formed_again
    monkeypatch.setattr(llama, "_formed_again", lambda *a: hooked.append(1) or again(*a))

    def products_alive(lean: bool, run=lambda: model(input_ids=ids).logits):
        products = []
        apply = llama.SiluMul.apply
        with monkeypatch.context() as patch:
            patch.setattr(llama.SiluMul, "apply",
                          lambda *a: (lambda out: products.append(weakref.ref(out)) or out)(apply(*a)))
            if not lean:
                _lean_off(patch)
            out = run()
        alive = sum(ref() is not None for ref in products)
        out.sum().backward()
        return alive

    assert (products_alive(True), products_alive(False)) == (0, layers)
    hooked.clear()
    products_alive(True, run=lambda: checkpoint(lambda i: model(input_ids=i).logits, ids, use_reentrant=False))
    assert not hooked  # an outer checkpoint's hooks apply, not the product's
    model.model.gradient_checkpointing = True
    out = model(input_ids=ids).logits
    with torch.no_grad():
        model(input_ids=ids)  # between the checkpointed forward and its backward
    out.sum().backward()  # the recompute saves what its forward saved (no CheckpointError)
    assert not hooked


def test_the_norms_normalized_state_is_not_held_for_backward(tokenizer, monkeypatch):
    """Each decoder norm's normalized state (its input times rstd, which autograd keeps for the weight's gradient)
    is gone after the forward and formed again in backward: every tensor handed to the recipes dies, two norms a
    layer, and the explicit norm gives F.rms_norm's output bit for bit."""
    import weakref

    from hasten.models import llama
    from hasten.models.tiny import tiny_model

    model = native_copy(tiny_model(len(tokenizer))).train()
    ids = torch.randint(3, len(tokenizer), (2, 24))
    formed = []
    again = llama._formed_again
    monkeypatch.setattr(llama, "_formed_again", lambda tensor, form: formed.append(weakref.ref(tensor)) or again(
        tensor, form))
    out = model(input_ids=ids).logits
    layers = model.config.num_hidden_layers
    assert len(formed) == 3 * layers and all(ref() is None for ref in formed)  # two norms and the product a layer
    out.sum().backward()
    norm = model.model.layers[0].input_layernorm
    hidden = torch.randn(3, 5, model.config.hidden_size, requires_grad=True)
    token = llama.LEAN_SAVES.set(True)
    try:
        lean = norm(hidden)
    finally:
        llama.LEAN_SAVES.reset(token)
        llama.form_again(None)  # the norm named its output to the recast linears
    assert torch.equal(lean, llama.rms_norm(hidden, norm.weight, norm.eps))
