"""int8 linears for sampling (generation.precision=int8): weights int8 per output channel, activations
quantized per call, int32 accumulation, fp32 out, with SmoothQuant's per-channel smoothing.

The kernel is fbgemm's dynamic quantized linear (`quantized::linear_dynamic`), which PyTorch ships for x86:
it packs the int8 weight once and runs u8 x s8 dot products on AVX-512 VNNI (and AVX2 elsewhere). It was
chosen by timing the int8 paths torch 2.13 has on the CPU at SmolLM2-135M's decode shapes: `torch._int_mm`
with per-row activation scales (its quantize and dequantize are separate passes) and
`_weight_int8pack_mm` (weight-only int8, dequantized into an fp32 GEMM) were both slower
(docs/speedups.md, "int8 sampling").

What the numbers are: each weight row (output channel) has its own scale, max |w| / 127, zero point 0;
activations get one scale per call over the whole (rows, in) input, as fbgemm's dynamic linear does, so a
row's output depends a little on the other rows in the batch. The learner never uses these outputs: the
sampler's log-probs are only the denominator of the truncated importance weight (train/learner.py), so
that coupling is part of the mismatch the correction measures, not of what is learned.

Smoothing: LLM activations have outlier channels, and one activation scale per call then leaves the other
channels a few levels of the int8 range. Each projection keeps the running max |x| per input channel of
what it was called on; the next quantization (after the next update) uses W * s and x / s with
s = max|x|^0.5 / max|W|^0.5, an exact identity before rounding. Inputs with massive activations (SmolLM2's
down_proj: thousands of times the median) are left to fp32 by the engine (rollout/lean.py).

reduce_range: fbgemm's AVX2 kernels accumulate pairs of u8 x s8 products in int16 and saturate, so torch
quantizes activations to 7 bits there; AVX-512 VNNI accumulates in int32 and takes the full 8 bits.

The quantized tensor constructors warn that they are deprecated; the warning is silenced here only, since
torch is pinned (pyproject.toml) and tests/test_int8_sampling.py fails first if a release drops them.
"""

from __future__ import annotations

import warnings

import torch

from ..device import cpu_has_vnni, cpu_int8_unavailable_reason

SMOOTHING_ALPHA = 0.5  # SmoothQuant's migration strength: its paper's default, and the best of 0.5 / 0.8 measured here


def reduce_range() -> bool:
    """7-bit activations unless the CPU has VNNI (int32 accumulation without int16 saturation)."""
    return not cpu_has_vnni()


def unavailable_reason() -> str | None:
    """None when this torch build runs int8 linears here, else why not (device.py probes it once)."""
    return cpu_int8_unavailable_reason()


def absmax(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| along `dim`, as max(amax, -amin): two vectorized reductions and no |x| copy of the tensor
    (torch 2.13's aminmax along a dimension ran several times slower than both together)."""
    tensor = tensor.detach()
    return torch.maximum(tensor.amax(dim=dim), tensor.amin(dim=dim).neg()).float()


def scales(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales, max |w| / 127 (a zero row gets 1, so it quantizes to zeros)."""
    amax = absmax(weight, 1)  # (out,)
    return torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 weight the int8 form stands for (round to nearest, clamp at +-127): what tests compare with."""
    channel_scales = scales(weight)[:, None]  # (out, 1)
    return (weight.detach().float() / channel_scales).round().clamp(-127, 127) * channel_scales


def smoothing(activation_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s = max|x|^alpha / max|w|^(1 - alpha), (in,).

    x @ W.T == (x / s) @ (W * s).T exactly; quantizing x / s and W * s instead of x and W moves an
    activation channel's outliers into the weight's columns, where per-output-channel scales absorb them.
    Channels never seen (max |x| = 0) keep s = 1.
    """
    seen = activation_absmax > 0
    weight_absmax = absmax(weight, 0).clamp(min=1e-8)  # (in,)
    factors = activation_absmax.clamp(min=1e-8) ** alpha / weight_absmax ** (1 - alpha)
    return torch.where(seen, factors.clamp(min=1e-4, max=1e4), torch.ones_like(factors))


class Int8Weight:
    """One projection in int8: fbgemm's packed weight (W * s), the 1/s its inputs are multiplied by, the
    per-output-channel scales its outputs are multiplied by, and the running max |x| per input channel of
    the activations it is called on (the next sync's s)."""

    def __init__(self, weight: torch.Tensor, activation_absmax: torch.Tensor):
        weight = weight.detach().float()  # (out, in)
        self.inverse_smoothing = None  # (in,) or None: before any activation was seen, plain int8
        if bool((activation_absmax > 0).any()):
            factors = smoothing(activation_absmax, weight)
            weight = weight * factors
            self.inverse_smoothing = 1.0 / factors
        self.activation_absmax = torch.zeros(weight.shape[1])  # this weight's own period of statistics
        self.output_scales = scales(weight)  # (out,)
        self.packed = _pack(weight, self.output_scales)
        self.shape = weight.shape


def _pack(weight: torch.Tensor, channel_scales: torch.Tensor):
    """fbgemm's packed int8 form of `weight` (out, in) / channel_scales per row, rounded to nearest and
    clamped at +-127, as a per-tensor qint8 of scale 1: `linear` multiplies each output channel by its
    scale afterwards. The same numbers as fbgemm's per-channel form up to float rounding, but packing a
    per-channel tensor reads its scales and zero points one `.item()` at a time (two per output
    channel: 375k calls for SmolLM2's projections and head), which was a fifth of each re-quantization."""
    levels = torch.div(weight, channel_scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch._make_per_tensor_quantized_tensor(levels, 1.0, 0)
        return torch.ops.quantized.linear_prepack(quantized, None)


def prepare(weight: torch.Tensor, activation_absmax: torch.Tensor | None = None) -> Int8Weight:
    """`weight` (out, in) in int8, smoothed by `activation_absmax` (in,), the max |x| per channel that the
    same projection's last int8 form saw; None or all zero (nothing seen yet): plain per-channel int8."""
    return Int8Weight(weight, activation_absmax if activation_absmax is not None else torch.zeros(weight.shape[1]))


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., in) fp32 @ the int8 weight.T -> (..., out) fp32, plus bias in fp32; records max |x| per channel."""
    x = x.float()
    flat = x.reshape(-1, x.shape[-1])  # (rows, in)
    torch.maximum(weight.activation_absmax, absmax(flat, 0), out=weight.activation_absmax)
    if weight.inverse_smoothing is not None:
        x = x * weight.inverse_smoothing
    out = torch.ops.quantized.linear_dynamic(x.contiguous(), weight.packed, reduce_range())
    out = out.mul_(weight.output_scales)
    return out if bias is None else out.add_(bias)
