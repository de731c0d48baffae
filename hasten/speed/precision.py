"""Mixed precision (speed.precision, speed.tf32) and the AdamW kernel (speed.optimizer).

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

optimizer: torch's AdamW kernels give the same update up to rounding:
    for_loop  one parameter at a time (torch's CPU default)
    foreach   multi-tensor: a few large kernels over all parameters
    fused     a single fused kernel (CUDA, and CPU since torch 2.4)
    auto      fused on CUDA, foreach elsewhere (fused measured 0.20 s per
              SmolLM2-135M step on this CPU against 1.05 s for_loop and 1.17 s
              foreach, but see docs/speedups.md: not yet trusted on CPU)
"""

from __future__ import annotations

import contextlib

import torch

from ..config import SpeedConfig, TrainConfig

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

    def disable(self) -> None:
        """Fall back to fp32 for the rest of the run (the NaN guard's disable_mixed_precision)."""
        self.mode = "fp32"
        self.scaler = None


def adamw_kernel(choice: str, device: torch.device) -> dict[str, bool]:
    """AdamW keyword arguments for speed.optimizer on `device`."""
    if choice == "auto":
        # Fused where torch has the kernel (CUDA and CPU): 5.4x faster per step than for-loop here.
        # On the CPU it leaves the parameters' _version alone, which is why the trainer tells the
        # lean engine about every update (LeanEngine.weights_changed) instead of relying on it.
        choice = "fused" if device.type in ("cuda", "cpu") else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True},
            "for_loop": {"foreach": False, "fused": False}}[choice]


def make_adamw(parameters: list[torch.nn.Parameter], train: TrainConfig, speed: SpeedConfig):
    """AdamW with the kernel speed.optimizer picks. The fused kernel is called directly
    (train/adamw.py: the same update, without torch.optim's ~1 s import of torch._dynamo),
    except under the fp16 GradScaler, which steps torch.optim optimizers only."""
    device = parameters[0].device if parameters else torch.device("cpu")
    kernel = adamw_kernel(speed.optimizer, device)
    common = {"lr": train.lr, "betas": (train.adam_beta1, train.adam_beta2), "weight_decay": train.weight_decay}
    if kernel.get("fused") and speed.precision != "fp16":
        from ..train.adamw import FusedAdamW, available

        if available(device.type):
            return FusedAdamW(parameters, **common)
    return torch.optim.AdamW(parameters, **common, **kernel)
