"""kernels/recast_linear.py: under bf16 autocast, linears that save the fp32 weight and cast it again in backward
give autocast's F.linear bits exactly (output and every gradient, torch.equal), hold no bf16 copy of a weight
for backward, share one saved cast of a shared input, route only under CPU bf16 autocast, and leave the
model as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import native_lora_model, pass_gradients, peft_head_model, rollout_of
from hasten.kernels import fast_linear
from hasten.kernels.recast_linear import RecastLinear, _SharedInputCast, recast_linears
from hasten.train.packing import backbone_and_head


@pytest.fixture
def route_small_layers(monkeypatch):
    """The tiny model's layers are below MIN_FEATURES; route them anyway."""
    monkeypatch.setattr(fast_linear, "MIN_FEATURES", 1)


def _run(function, x, weight, bias, upstream):
    for tensor in (x, weight, bias):
        if tensor is not None and tensor.grad is not None:
            tensor.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = function(x, weight, bias)
    (out.float() * upstream).sum().backward()
    return out.detach(), [None if t is None or t.grad is None else t.grad.clone() for t in (x, weight, bias)]


@pytest.mark.parametrize("shape", [(37, 160), (3, 11, 160)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("frozen", [False, True])  # a LoRA base weight: no weight gradient
def test_the_bits_of_autocast_f_linear(shape, with_bias, frozen):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    weight = torch.randn(144, 160, requires_grad=not frozen)
    bias = torch.randn(144, requires_grad=True) if with_bias else None
    upstream = torch.randn(*shape[:-1], 144)
    expected, expected_grads = _run(F.linear, x, weight, bias, upstream)
    def recast(x, weight, bias):  # as recast_linears runs it: the Function on the rows, the view outside
        return RecastLinear.apply(x, weight, bias, _SharedInputCast()).view(*x.shape[:-1], weight.shape[0])

    actual, actual_grads = _run(recast, x, weight, bias, upstream)
    assert actual.dtype == expected.dtype == torch.bfloat16 and torch.equal(actual, expected)
    for a, b in zip(actual_grads, expected_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


def test_a_transposed_input_runs_autocast_s_own_linear():
    """A strided input takes autograd's column-major products: the routed layer leaves it to autocast."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(160, 144)
    base = torch.randn(160, 29, requires_grad=True)
    upstream = torch.randn(29, 144)

    def run(routed: bool):
        layer.zero_grad(set_to_none=True)
        base.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), recast_linears(layer, routed) as count:
            assert count == int(routed)
            out = layer(base.t())
        (out.float() * upstream).sum().backward()
        return [out.detach(), base.grad, layer.weight.grad, layer.bias.grad]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def _saved_bf16(function) -> list[tuple[int, int]]:
    """(shape, storage) of each bf16 tensor autograd saves while `function` runs."""
    saved = []

    def pack(tensor):
        if tensor.dtype == torch.bfloat16:
            saved.append((tuple(tensor.shape), tensor.untyped_storage().data_ptr()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return saved


def test_no_bf16_weight_is_saved_and_q_k_v_share_their_input():
    """autocast saves a bf16 copy of each weight and one of the shared input per projection; the recast linears
    save the input once and no weight at all."""
    torch.manual_seed(2)
    layers = torch.nn.ModuleList(torch.nn.Linear(160, width) for width in (160, 128, 128))  # q, k, v
    x = torch.randn(2, 9, 160, requires_grad=True) * 1.0  # a norm's output: not a leaf (autocast caches leaves)
    weights = {layer.weight.numel() for layer in layers}

    def project():
        return [layer(x) for layer in layers]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _saved_bf16(project)
    assert weights <= {math.prod(shape) for shape, _ in plain}
    assert len({storage for shape, storage in plain if math.prod(shape) == x.numel()}) == 3  # a cast per projection
    with recast_linears(layers) as routed:
        assert routed == 0  # not under autocast: nothing routed
    with torch.autocast("cpu", dtype=torch.bfloat16), recast_linears(layers) as routed:
        assert routed == 3
        recast = _saved_bf16(project)
    assert {math.prod(shape) for shape, _ in recast} == {x.numel()}  # every weight is saved as its fp32 self
    assert len({storage for _, storage in recast}) == 1  # the one shared cast of x
    assert all("forward" not in vars(layer) for layer in layers)


def test_an_input_changed_in_place_is_cast_again():
    shared = _SharedInputCast()
    x = torch.ones(4, 8)
    first = shared.get(x)
    assert shared.get(x) is first
    x.mul_(3.0)
    again = shared.get(x)
    assert again is not first and torch.equal(again, torch.full((4, 8), 3.0, dtype=torch.bfloat16))


def test_routes_only_under_cpu_bf16_autocast():
    layer = torch.nn.Linear(160, 160)
    for dtype, expected in ((torch.bfloat16, 1), (torch.float16, 0)):
        with torch.autocast("cpu", dtype=dtype), recast_linears(layer) as routed:
            assert routed == expected
    with torch.autocast("cpu", dtype=torch.bfloat16), recast_linears(layer, enabled=False) as routed:
        assert routed == 0
    assert "forward" not in vars(layer)


def test_the_model_is_restored_when_the_block_raises():
    layer = torch.nn.Linear(160, 160)
    with pytest.raises(RuntimeError), torch.autocast("cpu", dtype=torch.bfloat16):
        with recast_linears(layer) as routed:
            assert routed == 1 and "forward" in vars(layer)
            raise RuntimeError("boom")
    assert "forward" not in vars(layer)


@pytest.mark.parametrize("precision", ["bf16", "bf16_fp32head"])
@pytest.mark.parametrize("chunk", [0, 7])  # 7: logit chunks, each recomputed in backward (checkpointed)
def test_a_packed_pass_gives_autocast_bits(route_small_layers, short_model, tokenizer, precision, chunk):
    """The learning pass with recast linears: log-probs and every parameter's gradient equal to autocast's
    (the head left to autocast under bf16, to its fp32 forward under bf16_fp32head)."""
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=12)
    advantages = torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(0))
    model = copy.deepcopy(short_model)
    _, plain_logps, plain_grads = pass_gradients(model, rollout, advantages, precision, False, chunk)
    routed, logps, grads = pass_gradients(model, rollout, advantages, precision, True, chunk)
    layers = len(backbone_and_head(model)[0].layers)
    assert routed == 7 * layers
    assert torch.equal(logps, plain_logps)
    assert len(grads) == len(plain_grads) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


@pytest.mark.parametrize("switch", ["gradient_checkpointing", "compile"])
def test_the_learner_routes_them_unless_checkpointing_or_compiling(switch):
    """Checkpointing's recompute must see the forward's kernels; dynamo cannot trace the shared input cast."""
    from conftest import tiny_config
    from hasten.train.learner import LogprobPass

    cfg = tiny_config(precision="bf16_fp32head")
    assert LogprobPass.choose(cfg, "bf16_fp32head").recast
    setattr(cfg.speed, switch, True)
    assert not LogprobPass.choose(cfg, "bf16_fp32head").recast


@pytest.mark.parametrize("wrap", ["lora", "modules_to_save"])
def test_a_peft_wrapped_head_is_left_to_autocast_whole(route_small_layers, short_model, tokenizer, wrap):
    """The linear inside peft's head wrapper stays on autocast too: routed, it ran RecastLinear in the forward
    and autocast's F.linear when backward recomputed a checkpointed logit chunk (torch's CheckpointError)."""
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=12)
    advantages = torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(0))
    model = peft_head_model(short_model, wrap)
    head = backbone_and_head(model)[1]
    _, plain_logps, plain_grads = pass_gradients(model, rollout, advantages, "bf16", False, 7)
    routed, logps, grads = pass_gradients(model, rollout, advantages, "bf16", True, 7)
    assert routed > 0 and not any("forward" in vars(module) for module in head.modules())
    assert torch.equal(logps, plain_logps)
    assert len(grads) == len(plain_grads) > 0 and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_routed_output_can_be_changed_in_place(with_bias):
    """A model may clamp a projection's output in place (OLMo's clip_qkv): autocast's linear allows it, and a
    view returned by an autograd Function would not; the gradient is autocast's."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(160, 144, bias=with_bias)
    x = torch.randn(3, 11, 160, requires_grad=True)

    def run(recast: bool):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), recast_linears(layer, recast) as routed:
            out = layer(x).clamp_(-0.5, 0.5)
        out.float().square().sum().backward()
        return routed, out.detach(), x.grad.clone(), layer.weight.grad.clone()

    plain, routed = run(False), run(True)
    assert routed[0] == 1 and plain[0] == 0
    assert all(torch.equal(a, b) for a, b in zip(plain[1:], routed[1:]))


@pytest.mark.parametrize("lora", [{}, {"lora_dropout": 0.1}, {"use_dora": True}], ids=["plain", "dropout", "dora"])
@pytest.mark.parametrize("precision", ["bf16", "bf16_fp32head"])
def test_lora_adapters_give_autocast_bits(route_small_layers, short_model, tokenizer, precision, lora):
    """Plain LoRA's A recast beside its base layer and handed the input itself (peft's dtype cast off); with a
    dropout or DoRA, the adapters on autocast's linears and peft's cast: log-probs and every adapter gradient
    equal to plain autocast's with peft casting, and peft's switch restored after."""
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=12)
    advantages = torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(0))
    model = native_lora_model(tokenizer, **lora)
    before = {name: getattr(module, "cast_input_dtype_enabled", None) for name, module in model.named_modules()}
    torch.manual_seed(1)  # the dropout's draws
    _, plain_logps, plain_grads = pass_gradients(model, rollout, advantages, precision, False, 0)
    torch.manual_seed(1)
    routed, logps, grads = pass_gradients(model, rollout, advantages, precision, True, 0)
    layers = len(backbone_and_head(model)[0].layers)
    assert routed == 7 * layers * (1 if lora else 2)  # plain LoRA: the adapters' A too
    assert torch.equal(logps, plain_logps)
    assert len(grads) == len(plain_grads) > 0 and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert {name: getattr(module, "cast_input_dtype_enabled", None) for name, module in model.named_modules()} == before


def test_lora_adapters_save_no_copy_of_their_input(route_small_layers, tokenizer, monkeypatch):
    """Under autocast each adapter's A saves its own bf16 cast of the layer's input, and down_proj's A a bf16 copy
    of the SiLU-gated product (peft casts it to fp32, autocast back); recast, the adapters share their base
    layer's cast, and down_proj's A saves the product itself (which models/llama.py then forms again)."""
    from hasten.models import llama

    model = native_lora_model(tokenizer)
    config = model.get_base_model().config
    ids = torch.randint(3, len(tokenizer), (2, 9))
    head = backbone_and_head(model)[1]
    apply = llama.SiluMul.apply

    def saves(recast: bool):
        products = []
        with monkeypatch.context() as patch:
            patch.setattr(llama.SiluMul, "apply",
                          lambda *a: (lambda out: products.append(out.untyped_storage().data_ptr()) or out)(apply(*a)))
            with torch.autocast("cpu", dtype=torch.bfloat16), recast_linears(model, recast, leave=head):
                saved = _saved_bf16(lambda: model(input_ids=ids).logits)
        hidden = {storage for shape, storage in saved if shape[-1] == config.hidden_size
                  and math.prod(shape) == ids.numel() * config.hidden_size}
        return len(hidden), {storage for shape, storage in saved if shape[-1] == config.intermediate_size}, products

    layers = config.num_hidden_layers
    hidden, intermediate, products = saves(False)
    # a frozen base saves its weight's cast, not its input; each adapter's A a cast of its own (q k v o gate up)
    assert hidden == 6 * layers and not set(products) & intermediate  # down_proj's A: a copy of the product
    hidden, intermediate, products = saves(True)
    assert hidden == 3 * layers  # q/k/v's input, o's, gate/up's: one cast each, base and adapter sharing it
    assert len(products) == layers and set(products) <= intermediate  # down_proj's A: the product itself


def test_an_adapter_behind_a_dropout_leaves_the_shared_cast_alone(route_small_layers, tokenizer, monkeypatch):
    """With a LoRA dropout, A reads the dropout's output, a new tensor: recast, it would take the shared cast's
    one entry and k and v would cast their input again. A stays on autocast's linear instead, and the base
    layers cast once per input: q/k/v's, o's, gate/up's and down's (the bf16 product, which is its own cast)."""
    model = native_lora_model(tokenizer, lora_dropout=0.1)
    ids = torch.randint(3, len(tokenizer), (2, 9))
    casts = []
    get = _SharedInputCast.get
    monkeypatch.setattr(_SharedInputCast, "get", lambda self, x: (
        casts.append(1) if x is not self.source or x._version != self.version else None) or get(self, x))
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            recast_linears(model, True, leave=backbone_and_head(model)[1]) as routed:
        model(input_ids=ids)
    layers = model.get_base_model().config.num_hidden_layers
    assert routed == 7 * layers and len(casts) == 4 * layers


@pytest.mark.parametrize("precision", ["bf16", "bf16_fp32head"])
def test_the_native_norms_inputs_are_cast_again_in_backward(route_small_layers, short_model, tokenizer,
                                                             monkeypatch, precision):
    """On the native model a decoder norm's output (q/k/v's input, gate/up's) can be formed again from what the
    norm keeps (models/llama.py): the recast linears keep no bf16 cast of it and cast it again in backward. After
    the forward only o_proj's cast is alive (attention's output); log-probs and every gradient are autocast's."""
    import weakref

    from hasten.models.llama import NativeLlamaForCausalLM
    from hasten.models.tiny import tiny_model

    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=12)
    advantages = torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(0))
    model = NativeLlamaForCausalLM.from_hf(tiny_model(len(tokenizer))).train()
    _, plain_logps, plain_grads = pass_gradients(model, rollout, advantages, precision, False, 0)
    casts = []
    get = _SharedInputCast.get
    monkeypatch.setattr(_SharedInputCast, "get", lambda self, x: (lambda cast: casts.append(
        weakref.ref(cast)) or cast)(get(self, x)))
    routed, logps, grads = pass_gradients(model, rollout, advantages, precision, True, 0)
    assert routed == 7 * model.config.num_hidden_layers
    assert torch.equal(logps, plain_logps)
    assert len(grads) == len(plain_grads) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))

    ids = torch.randint(3, len(tokenizer), (2, 9))
    casts.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16), recast_linears(model, True, leave=model.lm_head):
        from hasten.models import llama

        token = llama.LEAN_SAVES.set(True)  # as Decoder sets it for its layers
        try:
            out = model.model.layers[0](model.model.embed_tokens(ids), *model.model.rotary_emb(
                model.model.embed_tokens(ids), torch.arange(9).expand(2, -1)), llama.causal_padding_mask(
                torch.ones(2, 9, dtype=torch.long)))
        finally:
            llama.LEAN_SAVES.reset(token)
            llama.form_again(None)
    alive = {tuple(ref().shape) for ref in casts if ref() is not None}
    assert alive == {(2, 9, model.config.hidden_size)} and sum(ref() is not None for ref in casts) == 1  # o_proj's
    out.float().sum().backward()
