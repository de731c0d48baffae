"""The learner: optimizer, schedule and the policy-gradient update on a rollout.

One `step(rollout, advantages)` runs num_iterations (mu) optimizer steps on
one generation batch. The batch is split into gradient_accumulation_steps
chunks of whole samples, each split again to speed.token_budget tokens when
that is set (microbatch.py); each chunk's loss is already scaled to its share
of the batch loss (see algo/losses.py), so gradients simply add up.

No redundant passes:
- old-policy log-probs are the detached log-probs of the first iteration's
  forward (taken before any update), never a separate pass; with mu = 1
  they are used at once and not even stored;
- the reference model runs only when beta > 0 (one no-grad pass per chunk,
  before any update); with LoRA it is the adapter-disabled policy.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..algo import LOSSES, LossInputs, LossSettings
from ..config import Config
from ..models import Policy, Reference
from ..rollout import Rollout
from .fast_linear import onednn_linears
from .logprobs import completion_logprobs
from .microbatch import micro_batches
from .packing import packed_logprobs
from ..speed.memory import on_device, pack_ratio, set_gradient_checkpointing
from ..speed.nan_guard import NanGuard
from ..speed.precision import Precision, make_adamw
from .adamw import Schedule


def lr_factor(optimizer_step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier on the peak lr: linear warmup, then cosine decay (or constant)."""
    if warmup_steps > 0 and optimizer_step < warmup_steps:
        return (optimizer_step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = (optimizer_step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(parameters: list[torch.nn.Parameter], cfg: Config):
    """AdamW and its warmup + cosine (or constant) schedule from `train:`; one scheduler step per optimizer step.

    Shared by the language-model Learner and the game loop (train/policy_loop.py).
    """
    train = cfg.train
    optimizer = make_adamw(parameters, train, cfg.speed)  # speed.optimizer picks the kernel
    total = train.steps * cfg.algo.num_iterations  # optimizer steps in the run
    scheduler = Schedule(optimizer, lambda s: lr_factor(s, train.warmup_steps, total, train.lr_schedule,
                                                         train.min_lr_ratio))
    return optimizer, scheduler


class Learner:
    def __init__(self, policy: Policy, cfg: Config, reference: Reference | None = None,
                 log: Callable[[str], None] = print):
        self.policy = policy
        self.cfg = cfg
        self.reference = reference
        self.loss_fn = LOSSES[cfg.algo.loss]
        self.settings = LossSettings(cfg.algo.epsilon, cfg.algo.epsilon_high, cfg.algo.beta)
        self.parameters = [p for p in policy.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.parameters, cfg)  # speed.optimizer: AdamW kernel
        # Speed hooks (hasten/speed/): autocast + GradScaler, NaN guard, activation checkpointing.
        self.device = next(policy.model.parameters()).device
        self.precision = Precision(cfg.speed.precision, self.device, cfg.speed.tf32)
        self.guard = NanGuard(cfg.speed, self._lower_lr, self.precision.disable, log) if cfg.speed.nan_guard else None
        set_gradient_checkpointing(policy.model, cfg.speed.gradient_checkpointing)

    def _chunk_logprobs(self, model, rollout: Rollout, rows: torch.Tensor, with_entropy: bool):
        # fast_linear and grouped_attention switch the model's kernels for the forward only. With
        # gradient checkpointing, backward recomputes layers after that switch is undone and
        # torch rejects the mismatch, so checkpointing runs them on the plain kernels.
        plain_kernels = bool(getattr(model, "is_gradient_checkpointing", False))
        # speed.fast_linear: the model's matmuls in oneDNN for this forward and its backward.
        with onednn_linears(model, self.cfg.speed.fast_linear and not plain_kernels):
            return self._chunk_pass(model, rollout, rows, with_entropy, plain_kernels)

    def _chunk_pass(self, model, rollout: Rollout, rows: torch.Tensor, with_entropy: bool, plain_kernels: bool):
        if self.cfg.speed.packed_learning and pack_ratio(rollout, rows) >= self.cfg.speed.min_pack_ratio:
            return packed_logprobs(model, rollout, rows, self.cfg.generation.temperature, with_entropy,
                                   self.cfg.speed.logit_chunk_tokens,
                                   self.cfg.speed.grouped_attention and not plain_kernels)
        group = rows // rollout.num_generations  # prompt index of each sample
        return completion_logprobs(
            model,
            rollout.prompt_ids[group],
            rollout.prompt_mask[group],
            rollout.completion_ids[rows],
            rollout.completion_mask[rows],
            temperature=self.cfg.generation.temperature,
            with_entropy=with_entropy,
        )

    def step(self, rollout: Rollout, advantages: torch.Tensor) -> dict[str, float]:
        model = self.policy.model
        lr = self.optimizer.param_groups[0]["lr"]  # the lr these updates use
        mask = rollout.completion_mask
        chunks = micro_batches(rollout, self.cfg.train.gradient_accumulation_steps, self.cfg.speed.token_budget,
                               self.cfg.speed.packed_learning)
        chunks = [rows for rows in chunks if rows.numel()]  # dynamic sampling may leave fewer samples
        ref_logps = self._reference_logprobs(rollout, chunks) if self.reference is not None else None
        old_logps: list[torch.Tensor | None] = [None] * len(chunks)
        metric_sums: dict[str, float] = {}
        entropy_sum = 0.0
        loss_total = 0.0
        grad_norm = 0.0
        for iteration in range(self.cfg.algo.num_iterations):
            loss_total = 0.0
            for index, rows in enumerate(chunks):
                with self.precision.autocast():  # speed.precision: a no-op in fp32
                    stats = self._chunk_logprobs(model, rollout, rows, with_entropy=iteration == 0)
                if iteration == 0:
                    old = stats.logps.detach()  # the sampling policy: no update has happened yet
                    if self.cfg.algo.num_iterations > 1:
                        old_logps[index] = old
                    entropy_sum += float((stats.entropy * mask[rows]).sum())
                else:
                    old = old_logps[index]
                inputs = LossInputs(
                    logps=stats.logps,
                    old_logps=old,
                    ref_logps=None if ref_logps is None else ref_logps[index],
                    advantages=advantages[rows].to(stats.logps.device),
                    completion_mask=mask[rows].to(stats.logps.device),
                    total_tokens=float(mask.sum()),
                    total_sequences=rollout.num_samples,
                    max_completion_length=self.cfg.generation.max_new_tokens,
                    num_chunks=len(chunks),
                )
                loss, metrics = self.loss_fn(inputs, self.settings)
                self.precision.backward(loss)  # fp16: scaled by the GradScaler
                loss_total += float(loss.detach())
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + value / len(chunks)
            grad_norm = self._optimizer_step(loss_total)
        iterations = self.cfg.algo.num_iterations
        out = {key: value / iterations for key, value in metric_sums.items()}
        out.update(
            loss=loss_total,
            grad_norm=grad_norm,
            entropy=entropy_sum / max(float(mask.sum()), 1.0),
            lr=lr,
        )
        if self.guard is not None:
            out["nan_guard/skipped"] = self.guard.skipped  # over the run so far
        return out

    @torch.no_grad()
    def _reference_logprobs(self, rollout: Rollout, chunks) -> list[torch.Tensor]:
        offload = self.cfg.speed.offload_reference and self.reference.frozen is not None
        with self.reference.active() as reference_model, on_device(reference_model, self.device, offload), \
                self.precision.autocast():
            return [self._chunk_logprobs(reference_model, rollout, rows, False).logps for rows in chunks]

    def _optimizer_step(self, loss: float) -> float:
        max_norm = self.cfg.train.max_grad_norm
        self.precision.unscale(self.optimizer)  # fp16: true gradient sizes before clipping
        norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, max_norm if max_norm > 0 else float("inf")))
        # Under fp16 the GradScaler owns gradient overflow (it skips such steps and lowers its scale).
        checked_norm = norm if self.precision.scaler is None else 0.0
        if self.guard is None or self.guard.allow(loss, checked_norm):
            self.precision.step(self.optimizer)
            self.scheduler.step()
        else:
            self.precision.skip(self.optimizer)  # speed.nan_guard: as if this update never happened
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _lower_lr(self, factor: float) -> None:
        """The NaN guard's lower_lr: scale the schedule's peak."""
        self.scheduler.scale_peak(factor)
