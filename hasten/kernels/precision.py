"""Mixed precision (train.precision, train.tf32): autocast, the fp16 GradScaler.

precision:
    fp32  no autocast (the default: exact, and the only safe choice on CPUs
          without native bf16; fp16 has no fast CPU kernels at all)
    bf16  autocast to bfloat16 on the model's device; weights, optimizer
          state and the loss stay fp32
    fp16  autocast to float16 plus a GradScaler: the loss is scaled up before
          backward so small gradients do not flush to zero, gradients are
          unscaled before clipping, and a step whose gradients overflowed is
          skipped by the scaler, which then lowers the scale
On CPUs with AVX512-BF16 or AMX, bf16 autocast is a real speed-up of the
learning pass (docs/results/speedups-notes.md has the measurement); elsewhere
bf16 is emulated and slower.
tf32: on CUDA, lets fp32 matmuls and convolutions use TF32 tensor cores
(Ampere and newer); it changes numerics slightly and does nothing on a CPU.

attention_fp32 (train.attention_fp32: auto | true | false): under autocast,
`attention()` runs scaled_dot_product_attention on fp32 copies of q, k, v
instead of autocast's bf16. auto = on the CPU only. torch 2.13's CPU flash
attention backward in bf16 is slower than in fp32 at B1's completion blocks
(docs/results/speedups-notes.md), and attention is a small share of the pass's
FLOPs, so fp32 costs little forward, and it is the more exact choice. On CUDA bf16 flash attention is the fast one.

The AdamW kernel (speed.optimizer) is kernels/adamw.py; train/optimization.py
combines both with the schedule, clipping and the NaN guard.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Set by Precision.autocast() for its block: attention() then runs fp32 under autocast.
_FP32_ATTENTION = contextvars.ContextVar("hasten_fp32_attention", default=False)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention; in fp32 inside a Precision.autocast() block with attention_fp32 on.

    Out of such a block (sampling, evaluation, a plain fp32 run) it is exactly the torch call.
    """
    if _FP32_ATTENTION.get() and torch.is_autocast_enabled(query.device.type):
        with torch.autocast(query.device.type, enabled=False):
            return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), **kwargs)
    return F.scaled_dot_product_attention(query, key, value, **kwargs)


def resolve_attention_fp32(setting: bool | str, device: torch.device) -> bool:
    """train.attention_fp32: true | false | auto (on for CPU autocast, off on CUDA)."""
    if setting == "auto":
        return device.type == "cpu"
    return bool(setting)


class Precision:
    """Autocast context, loss scaling and the unscale/step pair, for one device."""

    def __init__(self, mode: str, device: torch.device, tf32: bool = False, attention_fp32: bool | str = "auto"):
        self.mode = mode
        self.device_type = device.type
        self.attention_fp32 = resolve_attention_fp32(attention_fp32, device)
        self.scaler = torch.amp.GradScaler(self.device_type) if mode == "fp16" else None
        if tf32 and device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    @property
    def mixed(self) -> bool:
        return self.mode in AUTOCAST_DTYPES

    def autocast(self):
        if not self.mixed:
            return contextlib.nullcontext()
        return self._autocast()

    @contextlib.contextmanager
    def _autocast(self):
        token = _FP32_ATTENTION.set(self.attention_fp32)
        try:
            with torch.autocast(self.device_type, dtype=AUTOCAST_DTYPES[self.mode]):
                yield
        finally:
            _FP32_ATTENTION.reset(token)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true size before clipping or inspecting them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)  # skips the step itself if the gradients hold inf/NaN
            self.scaler.update()
        else:
            optimizer.step()

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """An update the NaN guard refused: let the scaler see the overflow and lower its scale."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict:
        return {"mode": self.mode, "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["mode"] != self.mode:  # the NaN guard switched mixed precision off before the save
            self.disable()
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])

    def disable(self) -> None:
        """Fall back to fp32 for the rest of the run (the NaN guard's disable_mixed_precision)."""
        self.mode = "fp32"
        self.scaler = None
