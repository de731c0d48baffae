"""The lean engine's matmuls (rollout/lean.py): x @ weight.T with the weight prepared once per weight sync, in
fp32, bf16 or int8 (generation.precision)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Matmul:
    """x @ weight.T with the weight prepared once, in one precision: fp32, bf16 or int8.

    fp32: oneDNN with packed weights beats F.linear's MKL sgemm at decode shapes on CPUs where MKL
    takes a generic path, and packing costs a pass over the weights, hence sync_weights'
    version check. `_linear_pointwise` is internal to torch:
    the constructor probes it and falls back to F.linear (also for non-CPU).

    bf16 (generation.precision=bf16) packs bf16 copies the same way, with outputs
    bit-identical to F.linear's. int8 (generation.precision=int8) keeps fbgemm's packed int8
    weights (kernels/int8.py): a quarter of the fp32 bytes, and VNNI dot products. Both take fp32
    inputs and give fp32 outputs, so the residual stream, norms, attention and sampling stay fp32.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device, precision: str = "fp32"):
        if precision not in ("fp32", "bf16", "int8"):
            raise ValueError(f"precision must be fp32, bf16 or int8, got {precision!r}")
        self.precision = precision
        self.bf16 = precision == "bf16"  # bf16 weights and inputs, fp32 out (AMX / AVX512-BF16)
        if precision == "int8":
            from ..kernels import int8

            reason = int8.unavailable_reason() if device.type == "cpu" else "int8 sampling runs on the CPU only"
            if reason is not None:
                raise ValueError(f"int8 matmuls: {reason}")
            self.packed = True
            from ..device import cpu_has_native_bf16

            # The projections int8 cannot carry (prepare's `exact`): bf16 where the CPU has bf16 matmuls
            # (SmolLM2's down_proj measured as close to fp32's samples, at half the bytes), else fp32.
            self.exact = Matmul(dtype, device, "bf16" if cpu_has_native_bf16() else "fp32")
            # name -> the activation statistics of that projection's newest int8 form, kept across a
            # switch to fp32 (evaluation) so the next int8 sync still smooths
            self.statistics: dict[str, torch.Tensor] = {}
            return
        self.packed = (device.type == "cpu" and (self.bf16 or dtype == torch.float32)
                       and torch.backends.mkldnn.is_available())
        if self.packed:
            x, weight = torch.randn(3, 16), torch.randn(8, 16)
            expected = F.linear(x.bfloat16(), weight.bfloat16()).float() if self.bf16 else F.linear(x, weight)
            try:
                self.packed = torch.allclose(self(x, self.prepare(weight)), expected, atol=1e-5)
            except (RuntimeError, AttributeError):
                self.packed = False

    def prepare(self, weight: torch.Tensor, previous=None, exact: bool = False, name: str = ""):
        """The weight in this Matmul's form; bf16 writes into `previous` (the last sync's copy) when it fits.

        In place, a bf16 copy kept through a learning pass (one the trainer did not release: algo.async_steps
        samples during it) keeps its memory from step to step; allocated anew while the pass ran, such copies
        took holes the pass had used, which then grew the heap: seconds of fresh page faults per bf16 learning
        pass. A released copy (release_weights) is allocated anew after the pass, from the memory it freed.
        int8's form is made anew (a quarter of the fp32 bytes),
        smoothed by the activations its last int8 form under the same `name` saw (kernels/int8.py);
        `exact` keeps that weight in bf16 or fp32 (`self.exact`).
        """
        weight = weight.detach()
        if self.precision == "int8":
            from ..kernels import int8

            if exact:
                return self.exact.prepare(weight)
            seen = self.statistics.get(name) if name else None
            if seen is not None and seen.shape[0] != weight.shape[1]:
                seen = None  # another weight under this name (a different model): nothing to smooth by
            prepared = int8.prepare(weight, seen)
            if name:
                self.statistics[name] = prepared.activation_absmax
            return prepared
        if self.bf16:
            # A copy even when the weight is bf16 already: this engine's own memory, never an alias.
            fresh = weight.to(torch.bfloat16, memory_format=torch.contiguous_format, copy=True)
            if self.packed:
                fresh = torch.ops.mkldnn._reorder_linear_weight(fresh, 64)
            if getattr(previous, "_hasten_bf16_copy", False) and previous.shape == fresh.shape:
                return previous.copy_(fresh)  # the temporary is freed at once, same size every sync
            fresh._hasten_bf16_copy = True  # safe to overwrite at the next sync
            return fresh
        # 64: the row count to pack for; measured as good at 8..400 rows (prefill included).
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64) if self.packed else weight

    def raw(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x @ weight.T in this Matmul's own dtype, no casts around it: bf16 in and out for bf16, fp32 for fp32
        (the fused decode step casts in its kernels); int8 is not taken."""
        if self.bf16:
            if self.packed:
                return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
            return F.linear(x, weight)
        return self(x, weight)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.precision == "int8":
            from ..kernels import int8

            if isinstance(weight, int8.Int8Weight):
                return int8.linear(x, weight, bias)
            return self.exact(x, weight, bias)
        if self.bf16:  # the residual stream, norms, attention and sampling stay fp32
            x = x.to(torch.bfloat16)
            if self.packed:
                out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "").float()
            else:
                out = F.linear(x, weight).float()
            return out if bias is None else out + bias
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)
