"""Mixed precision (speed.precision, speed.tf32): autocast, the fp16 GradScaler.

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
learning pass (measured 1.6x on this AMD EPYC, docs/speedups.md); elsewhere
bf16 is emulated and slower.
tf32: on CUDA, lets fp32 matmuls and convolutions use TF32 tensor cores
(Ampere and newer); it changes numerics slightly and does nothing on a CPU.

The AdamW kernel (speed.optimizer) is speed/adamw.py; train/optimization.py
combines both with the schedule, clipping and the NaN guard.
"""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast context, loss scaling and the unscale/step pair, for one device."""

    def __init__(self, mode: str, device: torch.device, tf32: bool = False):
        self.mode = mode
        self.device_type = device.type
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
        return torch.autocast(self.device_type, dtype=AUTOCAST_DTYPES[self.mode])

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
