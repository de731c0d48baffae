"""The learning pass's linears under bf16 autocast, without a bf16 copy of the weights held for backward.

Under CPU autocast (train.precision bf16 / bf16_fp32head) `F.linear` casts its
fp32 weight to bf16 and autograd saves that cast for the backward's input
gradient: from the end of the forward to the end of the backward, a bf16 copy
of every projection lives beside the fp32 weights, at the learning pass's
peak (0.7 GB at Qwen2.5-0.5B, 2.6 GB at 1.5B, whose base weights under LoRA
are cast in the same way). And q, k, v (gate, up) each save their own bf16
copy of the one input they share.

`RecastLinear` computes the same products with the same kernels, so forward output and every gradient are
bit-identical to autocast's (tests/test_recast_linear.py compares them with torch.equal; that holds where each
routed weight and each shared leaf input is used once per pass, as in every decoder hasten supports: autocast
sums a reused cast's gradients in bf16, this in fp32), but saves the fp32 weight itself (a reference, no
memory) and casts it again in backward, one layer at a time, and casts a shared input once (and keeps no
cast of it where the weight is frozen, or where the model forms the input again: `form_again`). The cost is one
more cast of each weight per micro-batch, a pass over the weights' bytes (~0.1 s at 0.5B, against a learning
pass of tens of seconds).

`recast_linears(model)` routes the model's large nn.Linear modules through it
while its block runs, on the CPU under bf16 autocast only (elsewhere it routes
nothing and the pass runs as before). The learner enters it with
speed.fast_linear's oneDNN routing, which does the same for fp32 passes, and
leaves both out under gradient checkpointing, and recast under speed.compile (train/learner.py
LogprobPass).
The LM head stays on autocast's linear (recast_linears' `leave`), and under bf16_fp32head it has its own
fp32 forward anyway.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref

import torch
import torch.nn.functional as F

from . import fast_linear


class _SharedInputCast:
    """The last input cast to bf16, so q, k and v (gate and up) share one cast of their input (saved once, or
    not at all where the model forms the input again: `form_again`).

    One entry: a projection's input replaces it; kept only for the block (recast_linears clears it),
    and only while the input is unchanged (its version)."""

    def __init__(self):
        self.source: torch.Tensor | None = None
        self.version = -1
        self.cast: torch.Tensor | None = None

    def get(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self.source or x._version != self.version:
            self.source, self.version = x, x._version
            self.cast = x.to(torch.bfloat16)  # autocast's cast: the same rounding
        return self.cast

    def clear(self) -> None:
        self.source = self.cast = None


class RecastLinear(torch.autograd.Function):
    """y = F.linear(x, weight, bias) as bf16 autocast runs it, the weight cast again in backward; x contiguous."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                shared: _SharedInputCast) -> torch.Tensor:
        x_bf16 = shared.get(x)
        # On the flattened input, as F.linear runs an N-D one (addmm or mm, then a view): the product is returned
        # whole and _forward takes the view, so a model may change a projection's output in place (autograd
        # forbids that on a view a Function returned)
        out = F.linear(x_bf16.reshape(-1, x.shape[-1]), weight.to(torch.bfloat16),
                       None if bias is None else bias.to(torch.bfloat16))  # (M, N)
        # The input's cast serves the weight's gradient only: none kept for a frozen weight, and none where the
        # input can be formed again (`form_again`): backward casts that again, from the recipe's tensors (saved
        # here too, so autograd frees them after backward and checks their versions)
        form, inputs = _form_of(x) if ctx.needs_input_grad[1] else (None, ())
        keep = ctx.needs_input_grad[1] and form is None
        ctx.save_for_backward(weight, x_bf16 if keep else None, *inputs)  # the fp32 parameter: no copy
        ctx.form = form
        ctx.input_dtype = x.dtype
        ctx.input_shape = x.shape
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # AddmmBackward's products on the flattened input (mm_mat1_backward, mm_mat2_backward), each gradient
        # then cast to its leaf's dtype as autocast's casts' backward does: the bits autocast's graph gives.
        weight, x_bf16, *inputs = ctx.saved_tensors
        grad_flat = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_flat.mm(weight.to(torch.bfloat16)).view(ctx.input_shape)
            grad_x = grad_x.to(ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            if ctx.form is not None:
                x_bf16 = ctx.form(*inputs).to(torch.bfloat16)  # the forward's cast of the same bits
            grad_weight = grad_flat.t().mm(x_bf16.reshape(-1, x_bf16.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_flat.sum(0).float()
        return grad_x, grad_weight, grad_bias, None


# The latest tensor a model said it can form again, as (weak reference, its version, form, inputs):
# models/llama.py's norm output, made from tensors the norm keeps anyway. One at a time: a norm's output feeds
# the projections right after it (q/k/v, gate/up) before the next norm runs.
_FORMED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("hasten_formed_input", default=None)


def form_again(tensor: torch.Tensor | None, form=None, *inputs: torch.Tensor) -> None:
    """`tensor` equals `form(*inputs)` bit for bit (the same ops on tensors autograd keeps for backward anyway;
    `form` holds no tensor itself): a recast linear reading it keeps no bf16 cast of it for its weight's gradient
    and casts `form(*inputs)` again in backward. form_again(None) forgets it (the model does at the end of its
    layers)."""
    _FORMED.set(None if tensor is None else (weakref.ref(tensor), tensor._version, form, inputs))


def _form_of(x: torch.Tensor) -> tuple:
    """(form, inputs) where `x` is the tensor form_again named, unchanged since; else (None, ())."""
    entry = _FORMED.get()
    if entry is None or entry[0]() is not x or entry[1] != x._version:
        return None, ()
    return entry[2], entry[3]


def eligible(module: torch.nn.Module) -> bool:
    """A plain nn.Linear on the CPU (peft's base layer and its adapters' A, which reads the same input) taking at
    least MIN_FEATURES inputs: an fp32 weight, or a frozen bf16 one (a LoRA base held in bf16,
    kernels/frozen_base.py: autocast's cast of it is itself), and an fp32 bias or none. What a layer saves is its
    input, so the input's width decides (recast_linears leaves LoRA's B, whose input is rank-wide, to autocast)."""
    weight = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and weight.device.type == "cpu"
            and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and not weight.requires_grad))
            and module.in_features >= fast_linear.MIN_FEATURES
            and (module.bias is None or module.bias.dtype == torch.float32))


def _forward(module: torch.nn.Linear, shared: _SharedInputCast, x: torch.Tensor) -> torch.Tensor:
    # A strided input (a transposed view) takes other backward products in autograd (mm_mat1_backward's
    # column-major branch): autocast's own linear keeps those bits. The decoder's inputs are contiguous.
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous() or not active():
        return torch.nn.Linear.forward(module, x)
    out = RecastLinear.apply(x, module.weight, module.bias, shared)  # (M, N)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def active() -> bool:
    """Whether recast_linears routes anything now: CPU autocast to bf16."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


@contextlib.contextmanager
def recast_linears(model: torch.nn.Module, enabled: bool = True, leave: torch.nn.Module | None = None):
    """Route the model's large CPU linears through RecastLinear while the block runs, under bf16 autocast.

    leave: a linear kept on autocast's own, with every module inside it (the LM head, or peft's wrapper of
    it: its logit chunks all use one cached bf16 cast of the weight, whose gradient autograd sums over the
    chunks in bf16; a cast per chunk would sum them in fp32, other bits). Yields the number of layers routed
    (0 when disabled or not under CPU bf16 autocast). The original forward is restored, and the shared input
    cast dropped, even if the block raises."""
    if not (enabled and active()):
        yield 0
        return
    shared = _SharedInputCast()
    try:
        left = set(leave.modules()) if leave is not None else set()  # a peft-wrapped head: its inner linears too
        # LoRA's B reads A's rank-wide output: nothing to save there, and its input would take the shared cast's
        # one entry from the next projection's (q's adapters between q and k). So would A's where it reads a
        # dropout's output or runs in a peft variant (DoRA): only plain LoRA's A, reading the input itself.
        adapters = [layer for layer in model.modules() if hasattr(layer, "lora_A") and hasattr(layer, "lora_B")]
        plain = [layer for layer in adapters if layer not in left and _plain_lora(layer)]
        skipped = left | {b for layer in adapters for b in layer.lora_B.values()} | {
            a for layer in set(adapters) - set(plain) for a in layer.lora_A.values()}
        with fast_linear.route_linears(model, lambda module: module not in skipped and eligible(module),
                                       lambda module, x: _forward(module, shared, x)) as routed, \
                _adapters_read_their_input(plain):
            yield routed
    finally:
        shared.clear()


def _plain_lora(layer: torch.nn.Module) -> bool:
    """A peft LoRA layer whose adapters read its input as given: every dropout the identity, no variant (DoRA's
    weight norm reads the input's dtype), and peft's input cast switch present."""
    return (hasattr(layer, "_cast_input_dtype") and not getattr(layer, "lora_variant", None)
            and not any(getattr(layer, "use_dora", {}).values())
            and all(type(dropout) is torch.nn.Identity for dropout in layer.lora_dropout.values()))


@contextlib.contextmanager
def _adapters_read_their_input(layers: list[torch.nn.Module]):
    """These plain LoRA layers hand their adapters the input itself, not a copy cast to the adapter's dtype.

    peft casts a bf16 input (down_proj's, the SiLU product under autocast) to fp32 for the fp32 adapter, and
    autocast casts it back to bf16 for the adapter's matmul: the same values, but a new intermediate-wide tensor
    that A saves for backward (Qwen2.5-1.5B: 17.5 KB a token a layer). Handed the product itself, A saves it
    (or RecastLinear shares it), and the product is formed again in backward as for down_proj's base
    (models/llama.py). The bits are autocast's either way: bf16 -> fp32 -> bf16 is exact, the gradient reaching
    the product is bf16 on both paths, and its two terms (base and adapter) add in either order."""
    changed = []
    for module in layers:
        changed.append((module, vars(module).get("cast_input_dtype_enabled", _UNSET)))
        module.cast_input_dtype_enabled = False  # peft's switch (peft.helpers.disable_input_dtype_casting)
    try:
        yield
    finally:
        for module, before in changed:
            if before is _UNSET:
                del module.cast_input_dtype_enabled
            else:
                module.cast_input_dtype_enabled = before


_UNSET = object()
