"""The optimization layer: one `Optimization` for every training loop (GRPO, game policy, SFT).

What it owns, written once (STYLE.md 18):
    AdamW            the kernel speed.optimizer picks (kernels/adamw.py)
    schedule         linear warmup, then cosine or linear decay to min_lr_ratio (or constant);
                     one schedule step per optimizer step. Warmup starts at (1 / warmup) of the
                     peak by default; warmup_from_zero starts at 0 as transformers' schedules do
    precision        autocast and the fp16 GradScaler (kernels/precision.py)
    clipping         the global gradient norm, at max_grad_norm (0 = no clipping, norm still logged)
    NaN guard        an update from a non-finite loss or gradient is skipped (kernels/nan_guard.py)

A loop calls `autocast()` around its forward, `backward(loss)` per
micro-batch and `step(loss)` once per optimizer step. Under torchrun `step`
first sums the gradients over ranks (distributed.py): each rank's loss is
its share of the global batch's, so the sum is the one-process gradient;
`loss` must then be the global loss too (`step_shares` sums a rank's share first); with FSDP
(fsdp.py) backward has summed them already and the state is gathered whole.
`state_dict()` holds
everything a resumed run needs to continue bit-identically: AdamW's moments
and step counts, the schedule's position and peaks (the guard may have
lowered them), the GradScaler, the guard's counters.

Settings come from the `train:` and `speed:` sections for GRPO and the game
policy (`OptimizerSettings.for_training`) and from `sft:` for SFT
(`for_sft`): the same machinery under two config sections, because SFT's
learning rate and schedule are a different job's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import Config, ConfigError, SpeedConfig
from ..kernels.adamw import make_adamw
from ..kernels.nan_guard import NanGuard
from ..kernels.precision import Precision
from . import distributed, fsdp


def lr_factor(optimizer_step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float,
              warmup_from_zero: bool = False) -> float:
    """Multiplier on the peak lr: linear warmup, then cosine or linear decay (or constant).

    With min_ratio 0 and warmup_from_zero these are transformers' get_{cosine,linear,constant}_schedule_with_warmup.
    """
    if warmup_steps > 0 and optimizer_step < warmup_steps:
        return (optimizer_step + (0 if warmup_from_zero else 1)) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (optimizer_step - warmup_steps) / max(1, total_steps - warmup_steps))
    decay = 1 - progress if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * decay


class Schedule:
    """Set every group's lr to its peak times factor(optimizer step); `step()` after each update.

    Replaces torch.optim.lr_scheduler.LambdaLR (same values: factor(0) at
    construction, factor(k) after k steps), without its torch.optim machinery.
    """

    def __init__(self, optimizer, factor: Callable[[int], float]):
        self.optimizer, self.factor = optimizer, factor
        self.peaks = [group["lr"] for group in optimizer.param_groups]
        self.steps = 0
        self._apply()

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def scale_peak(self, by: float) -> None:
        """The NaN guard's lower_lr: every later lr is this much smaller."""
        self.peaks = [peak * by for peak in self.peaks]
        self._apply()

    def _apply(self) -> None:
        factor = self.factor(self.steps)
        if not math.isfinite(factor):
            raise ValueError(f"lr schedule factor {factor} at step {self.steps}")
        for group, peak in zip(self.optimizer.param_groups, self.peaks):
            group["lr"] = peak * factor

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "peaks": list(self.peaks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.peaks = int(state["steps"]), list(state["peaks"])
        self._apply()


@dataclass(frozen=True)
class OptimizerSettings:
    lr: float
    total_steps: int  # optimizer steps in the run: the schedule's length
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # cosine | linear | constant
    warmup_from_zero: bool = False
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0  # 0 = no clipping
    kernel: str = "auto"  # speed.optimizer: auto | fused | foreach | for_loop
    moments: str = "fp32"  # train.optimizer_moments: fp32 | bf16
    precision: str = "fp32"  # fp32 | bf16 | bf16_fp32head | fp16 (resolved: never auto)
    tf32: bool = False
    attention_fp32: bool | str = "auto"  # train.attention_fp32 (kernels/precision.py)

    @classmethod
    def for_training(cls, cfg: Config, precision: str | None = None) -> OptimizerSettings:
        """GRPO and the game policy: `train:` and `speed:`; mu optimizer steps per GRPO step.

        precision: the learning precision as the run's plan resolved it (kernels.precision.resolve_precision);
        None (the game's small MLP, whose learning bf16 was never measured on): the setting, auto as fp32."""
        train = cfg.train
        if precision is None:
            precision = "fp32" if cfg.train.precision == "auto" else cfg.train.precision
        return cls(lr=train.lr, total_steps=train.steps * cfg.algo.num_iterations, warmup_steps=train.warmup_steps,
                   lr_schedule=train.lr_schedule, warmup_from_zero=train.warmup_from_zero, min_lr_ratio=train.min_lr_ratio, weight_decay=train.weight_decay,
                   betas=(train.adam_beta1, train.adam_beta2), max_grad_norm=train.max_grad_norm,
                   kernel=cfg.speed.optimizer, moments=cfg.train.optimizer_moments, precision=precision,
                   tf32=cfg.train.tf32,
                   attention_fp32=cfg.train.attention_fp32)

    @classmethod
    def for_sft(cls, cfg: Config, total_steps: int, device: torch.device) -> OptimizerSettings:
        sft = cfg.sft
        kernel = {"fused": "fused", "foreach": "foreach", "plain": "for_loop"}[sft.adamw]
        return cls(lr=sft.lr, total_steps=total_steps, warmup_steps=sft.warmup_steps, lr_schedule=sft.lr_schedule,
                   warmup_from_zero=sft.warmup_from_zero,
                   min_lr_ratio=sft.min_lr_ratio, weight_decay=sft.weight_decay, max_grad_norm=sft.max_grad_norm,
                   kernel=kernel, precision=sft_precision(sft.precision, device))


def sft_precision(setting: str, device: torch.device) -> str:
    """sft.precision -> fp32 | bf16 | fp16. auto: bf16 (fp16 without bf16) on CUDA, fp32 on CPU."""
    if device.type != "cuda":
        if setting == "fp16":
            raise ConfigError("config error: sft.precision=fp16 needs a CUDA GPU (on CPU use bf16 or fp32)")
        return "bf16" if setting == "bf16" else "fp32"
    if setting == "auto":
        # native bf16 only: V100/T4 emulate it (slower than fp16), and torch counts emulation by default
        return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    return setting


class Optimization:
    """AdamW + schedule + precision + clipping + NaN guard over `parameters`."""

    def __init__(self, parameters: list[torch.nn.Parameter], settings: OptimizerSettings, speed: SpeedConfig,
                 log: Callable[[str], None] = print, sharded: bool = False):
        self.parameters = parameters
        self.sharded = sharded  # FSDP (fsdp.py): DTensor parameters, gradients already summed in backward
        self.settings = settings
        device = parameters[0].device if parameters else torch.device("cpu")
        self.optimizer = make_adamw(parameters, settings.kernel, settings.lr, settings.betas, settings.weight_decay,
                                    settings.precision, settings.moments)
        self.schedule = Schedule(self.optimizer, lambda step: lr_factor(
            step, settings.warmup_steps, settings.total_steps, settings.lr_schedule, settings.min_lr_ratio,
            settings.warmup_from_zero))
        if not sharded and hasattr(self.optimizer, "reserve_state"):
            self.optimizer.reserve_state()  # before the first forward: a stable heap (FusedAdamW.reserve_state)
        self.precision = Precision(settings.precision, device, settings.tf32, settings.attention_fp32)
        self.guard = (NanGuard(speed, self.schedule.scale_peak, self.precision.disable, log)
                      if speed.nan_guard else None)

    @property
    def lr(self) -> float:
        """The lr the next update uses."""
        return self.optimizer.param_groups[0]["lr"]

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()  # a no-op in fp32

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)  # fp16: scaled by the GradScaler

    def step(self, loss: float) -> float:
        """Clip, guard, update, advance the schedule, drop the gradients; returns the gradient norm."""
        max_norm = self.settings.max_grad_norm
        if not self.sharded:  # FSDP reduce-scattered them in backward
            distributed.all_reduce_gradients(self.parameters)  # torchrun: the sum of every rank's share; else nothing
        self.precision.unscale(self.optimizer)  # fp16: true gradient sizes before clipping
        # Over DTensor gradients the norm is the global one (a DTensor, reduced across shards).
        total = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm if max_norm > 0 else float("inf"))
        norm = float(total.full_tensor() if self.sharded else total)
        # Under fp16 the GradScaler owns gradient overflow (it skips such steps and lowers its scale).
        checked_norm = norm if self.precision.scaler is None else 0.0
        if self.guard is None or self.guard.allow(loss, checked_norm):
            self.precision.step(self.optimizer)
            self.schedule.step()
        else:
            self.precision.skip(self.optimizer)  # speed.nan_guard: as if this update never happened
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def step_shares(self, loss_share: float) -> tuple[float, float]:
        """`step` for a loop whose ranks each hold a share of the loss: the shares summed over ranks first (the
        global loss the NaN guard reads, as `step` sums the gradients); returns (global loss, gradient norm)."""
        loss = distributed.sum_over_ranks(loss_share)
        return loss, self.step(loss)

    def zero_missing_gradients(self, ran_backward: bool) -> None:
        """After a pass that left samples out: every parameter gets the gradient the full pass gives it, zero
        where nothing that ran touched it, not None (AdamW skips a parameter without a gradient: no moment decay,
        no step count). ran_backward False (no pass at all): a zero loss goes through backward, so a GradScaler
        sees one."""
        if not ran_backward:
            self.backward(sum(parameter.reshape(-1)[0] for parameter in self.parameters) * 0.0)
        for parameter in self.parameters:
            if parameter.grad is None:  # e.g. an expert that only skipped samples were routed to
                parameter.grad = torch.zeros_like(parameter)

    @property
    def skipped_updates(self) -> int:
        return 0 if self.guard is None else self.guard.skipped

    def state_dict(self) -> dict[str, Any]:
        """Sharded (FSDP): AdamW's moments gathered whole, the one-process layout (a collective on every rank)."""
        optimizer = self.optimizer.state_dict()
        if self.sharded:
            optimizer = fsdp.full_optimizer_state(optimizer)
        return {"optimizer": optimizer, "schedule": self.schedule.state_dict(),
                "precision": self.precision.state_dict(),
                "guard": None if self.guard is None else self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state["precision"])  # first: a precision resolved otherwise is an error
        optimizer = state["optimizer"]
        if self.sharded:  # a full (one-process, DDP or FSDP) state: this rank's rows of each moment
            optimizer = fsdp.shard_optimizer_state(optimizer, self.parameters)
        self.optimizer.load_state_dict(optimizer)
        self.schedule.load_state_dict(state["schedule"])  # after the optimizer: it rewrites the groups' lr
        if self.guard is not None and state["guard"] is not None:
            self.guard.load_state_dict(state["guard"])
