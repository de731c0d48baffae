"""oneDNN matmuls for the learning pass (speed.fast_linear).

torch's fp32 `aten::mm` goes to MKL, whose sgemm takes a generic code path on
non-Intel CPUs; oneDNN, also inside torch, runs the same products much faster
there, and the learning pass spends most of its time in `aten::mm`, so this is
the largest lever left on such CPUs. On Intel CPUs MKL's own tuned path wins.
(Figures: docs/results/code-notes.md.)

`onednn_linears(model)` is a context manager that, for its duration, routes
every large `nn.Linear` of the model through `OneDNNLinear`, an autograd
Function that computes forward, input gradient and weight gradient with
`torch.ops.mkldnn._linear_pointwise` — the same math in fp32, only another
kernel library, so results match F.linear to float rounding
(tests/test_fast_linear.py). Frozen weights (LoRA's base) get no weight
gradient, as with F.linear.

Left out on purpose:
- small layers (LoRA's A and B, rank 16): thin matmuls where oneDNN's setup
  cost dominates;
- the block under CPU autocast (train.precision=bf16/fp16): there the linears
  must run in bf16 (far faster than either fp32 library on AMX), and an autograd Function would keep
  them fp32 unseen; the context then routes nothing;
- anything not fp32 on the CPU, or a torch build without oneDNN: the context
  manager then leaves the model untouched (`available()` says which), and
  the learner logs that choice once.
`_linear_pointwise` is internal to torch, so `available()` probes it on a
small product and compares with F.linear before anything relies on it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

MIN_FEATURES = 128  # smaller layers stay on F.linear (see above)


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T through oneDNN; x (M, K), weight (N, K), fp32, contiguous or transposed views."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@functools.cache
def reads_transposed() -> bool:
    """oneDNN takes transposed views as they are and gives what it gives on contiguous copies. The backward
    then hands it g.T, x.T and W.T as views: a transposed weight operand (x.T, W.T) is read through its
    strides, no copy; the input operand (g.T) torch's op still makes contiguous itself. Peak memory is the
    same (docs/speedups.md, fast_linear). Probed once on small products; where it does not hold, the
    backward makes every copy itself."""
    generator = torch.Generator().manual_seed(0)  # its own stream: the probe leaves the global RNG as it was
    g, x, weight = (torch.randn(*shape, generator=generator) for shape in ((7, 24), (7, 16), (24, 16)))
    try:
        return (torch.allclose(_onednn(g.t(), x.t()), _onednn(g.t().contiguous(), x.t().contiguous()), atol=1e-5)
                and torch.allclose(_onednn(g, weight.t()), _onednn(g, weight.t().contiguous()), atol=1e-5))
    except (RuntimeError, AttributeError):
        return False


def _transposed(tensor: torch.Tensor) -> torch.Tensor:
    """tensor.T as oneDNN will read it: the view itself where it reads strides, else a contiguous copy."""
    return tensor.t() if reads_transposed() else tensor.t().contiguous()


def intel_cpu() -> bool:
    """The CPU is Intel's: MKL takes its own tuned path there (elsewhere a generic one)."""
    from ..device import cpu_info

    return cpu_info().vendor == "GenuineIntel"


def resolve(setting: bool | str) -> bool:
    """speed.fast_linear: true / false as given; auto = oneDNN unless MKL is on its Intel fast path.

    On AMD CPUs oneDNN wins at the learning shapes, on Intel CPUs MKL does (measured:
    docs/results/code-notes.md). Either way the math is the same fp32 product
    (tests/test_fast_linear.py); only the kernel library differs.
    """
    if isinstance(setting, bool):
        return setting
    return not intel_cpu()


@functools.cache
def available() -> bool:
    """True when oneDNN's fp32 linear exists in this torch build and agrees with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    x, weight = torch.randn(5, 16), torch.randn(8, 16)
    try:
        return torch.allclose(_onednn(x, weight), F.linear(x, weight), atol=1e-5)
    except (RuntimeError, AttributeError):
        return False


def _weight_gradient(grad_flat: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """dW = g.T @ x (N, K) from g (M, N) and x (M, K). oneDNN's input operand is made contiguous by torch's op,
    its weight operand is read through strides (reads_transposed), so the narrower of g.T and x.T goes in as
    the input and gets copied: for N <= K, a linear of g.T (N, M) with "weight" x.T (K, M); for N > K (the head,
    gate and up) the same product transposed, dW.T = x.T @ g, a linear of x.T (K, M) with "weight" g.T (N, M),
    returned as a view (N, K) that autograd accumulates like any gradient. At SmolLM2's head that copies
    576 x M floats instead of 49152 x M; the sums are the same (float rounding aside)."""
    if grad_flat.shape[1] > flat.shape[1] and reads_transposed():  # where g.T would be copied anyway: as before
        return _onednn(_transposed(flat), _transposed(grad_flat)).t()
    return _onednn(_transposed(grad_flat), _transposed(flat))


class OneDNNLinear(torch.autograd.Function):
    """y = x @ weight.T + bias with oneDNN kernels in forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
        out = _onednn(flat, weight.contiguous())  # (M, N)
        if bias is not None:
            out = out + bias
        ctx.save_for_backward(flat, weight)
        ctx.has_bias = bias is not None
        # a 2D input's output is returned whole, not as a view: the packed pass turns the head's logits
        # into their softmax in place (train/packing.py), which autograd forbids on a Function's view
        return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        flat, weight = ctx.saved_tensors
        grad_flat = grad.reshape(-1, grad.shape[-1]).contiguous()  # (M, N)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # dx = g @ W: a linear with weight W.T (K, N).
            grad_x = _onednn(grad_flat, _transposed(weight)).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_gradient(grad_flat, flat)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_flat.sum(0)
        return grad_x, grad_weight, grad_bias


def _forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return OneDNNLinear.apply(x, module.weight, module.bias)


def eligible(module: torch.nn.Module) -> bool:
    return (
        type(module) is torch.nn.Linear  # not peft's LoRA layers, which wrap their own nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and min(module.in_features, module.out_features) >= MIN_FEATURES
    )


@contextlib.contextmanager
def route_linears(model: torch.nn.Module, chosen, forward):
    """While the block runs, every module of `model` that `chosen(module)` accepts and that has no instance
    forward of its own calls `forward(module, x)` instead. Yields how many; restored even if the block raises."""
    routed: list[torch.nn.Module] = []
    for module in model.modules():
        if chosen(module) and "forward" not in vars(module):
            module.forward = functools.partial(forward, module)
            routed.append(module)
    try:
        yield len(routed)
    finally:
        for module in routed:
            del module.forward  # back to the class's forward


def onednn_linears(model: torch.nn.Module, enabled: bool = True):
    """Route the model's large fp32 CPU linears through oneDNN while the block runs (a context manager).

    Yields the number of layers routed (0 when disabled or
    unavailable). The original forward is restored even if the block raises.
    """
    # Under autocast (train.precision=bf16/fp16) the linears must run in the autocast dtype: an
    # autograd Function is not autocast-aware, so routing them here would silently keep them fp32.
    if enabled and available() and not torch.is_autocast_enabled("cpu"):
        return route_linears(model, eligible, _forward)
    return contextlib.nullcontext(0)
