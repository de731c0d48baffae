"""speed.engine_weights: the lean engine samples from the training parameters themselves (`shared`), or from
its own fused, packed fp32 copy of them (`copy`); `auto` picks by the copy's size against the machine.

`shared` holds nothing weight-sized: each projection is read from the model's live tensors at every call,
so an optimizer update is seen without a resync and no second fp32 copy of the weights exists (5.75 GiB
for Qwen2.5-1.5B under LoRA, where the copy is the merged W + scale * B @ A). What it gives up is the
copy's speed: q, k, v and gate, up run as separate matmuls (fusing them would need a copy), on
unpacked weights. Each matmul is oneDNN's `_linear_pointwise` on the plain weight where torch has it,
measured faster than F.linear's MKL sgemm at decode shapes summed over a layer (docs/speedups.md), else
F.linear.

LoRA (a peft policy): the base projection reads the frozen base weight, and each active adapter adds
its low-rank path (x @ A^T) @ B^T * scale, read live: peft's unmerged forward with dropout off
(sampling is eval). The adapters refused are lean.py's (`_check_adapters`): plain LoRA only.

The `auto` rule: `shared` when the fp32 copy (4 bytes per parameter) would take more than 1/8 of the
machine's memory, `copy` otherwise (docs/speedups.md says why 1/8); with generation.precision
bf16 or int8 the engine's copy is already low precision and small, so `auto` is `copy` (and `shared`
with them is a config error: config.validate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

COPY_SHARE = 8  # auto: shared when the fp32 copy would exceed 1/COPY_SHARE of the machine's memory


def copy_binds(copy_bytes: int, machine_bytes: int) -> bool:
    """The `auto` rule: a copy of `copy_bytes` would take more than 1/COPY_SHARE of the machine's memory."""
    return copy_bytes * COPY_SHARE > machine_bytes


def resolve(setting: str, parameters: int, generation_precision: str, machine_bytes: int) -> tuple[str, str]:
    """speed.engine_weights -> ("copy" | "shared", why); auto decided from the copy's size (4 bytes a parameter)."""
    if setting != "auto":
        return setting, "as set"
    if generation_precision not in ("fp32", "auto"):  # auto: the factory resolves it first; else as fp32
        return "copy", f"generation.precision={generation_precision}: the copy is low precision"
    copy_bytes = 4 * parameters
    choice = "shared" if copy_binds(copy_bytes, machine_bytes) else "copy"
    relation = ">" if choice == "shared" else "<="
    return choice, (f"an fp32 copy would take {copy_bytes / 1024**3:.2f} GiB, {relation} 1/{COPY_SHARE} of "
                    f"{machine_bytes / 1024**3:.1f} GiB")


class Projections:
    """One or more projections that read the same input (q, k, v; gate, up), applied one by one and
    concatenated along the features, as the fused matrix would give them. Holds the modules, not tensors."""

    def __init__(self, *linears):
        self.linears = linears


class SharedMatmul:
    """LeanEngine's fp32 matmul over live parameters: `Matmul`'s call surface, nothing prepared.

    Called with a Projections (the modules: their weights, biases and LoRA adapters read now) or a
    plain weight tensor (lm_head's, tied or not).
    """

    precision = "fp32"
    bf16 = False

    def __init__(self, device: torch.device):
        # oneDNN's linear on an unpacked weight; probed as Matmul probes the packed form (internal to torch)
        self.pointwise = device.type == "cpu" and torch.backends.mkldnn.is_available()
        if self.pointwise:
            x, weight = torch.randn(3, 16), torch.randn(8, 16)
            try:
                self.pointwise = torch.allclose(self._linear(x, weight), F.linear(x, weight), atol=1e-5)
            except (RuntimeError, AttributeError):
                self.pointwise = False

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.pointwise and weight.dtype == torch.float32 and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return self._linear(x, weight.detach(), bias)
        outputs = [self._project(x, linear) for linear in weight.linears]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)  # (..., sum of out_features)
        return out if bias is None else out + bias

    def _project(self, x: torch.Tensor, linear) -> torch.Tensor:
        """linear(x) in eval mode: a plain nn.Linear, or a peft LoRA layer's base plus its active adapters."""
        base = getattr(linear, "base_layer", None)
        if base is None:
            return self._linear(x, linear.weight.detach(), _detached(linear.bias))
        out = self._linear(x, base.weight.detach(), _detached(base.bias))
        if linear.disable_adapters or linear.merged:  # merged: peft already added the delta into W
            return out
        for adapter in linear.active_adapters:
            if adapter in linear.lora_A:
                down = self._linear(x, linear.lora_A[adapter].weight.detach())  # (..., r)
                out = out + self._linear(down, linear.lora_B[adapter].weight.detach()) * linear.scaling[adapter]
        return out


def _detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach()
