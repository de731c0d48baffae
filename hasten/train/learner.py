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

import torch

from ..algo import LOSSES, LossInputs, LossSettings
from ..config import Config
from ..models import Policy, Reference
from ..rollout import Rollout
from .fast_linear import onednn_linears
from .logprobs import completion_logprobs
from .microbatch import micro_batches
from .packing import packed_logprobs


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
    optimizer = torch.optim.AdamW(
        parameters,
        lr=train.lr,
        betas=(train.adam_beta1, train.adam_beta2),
        weight_decay=train.weight_decay,
    )
    total = train.steps * cfg.algo.num_iterations  # optimizer steps in the run
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, train.warmup_steps, total, train.lr_schedule, train.min_lr_ratio),
    )
    return optimizer, scheduler


class Learner:
    def __init__(self, policy: Policy, cfg: Config, reference: Reference | None = None):
        self.policy = policy
        self.cfg = cfg
        self.reference = reference
        self.loss_fn = LOSSES[cfg.algo.loss]
        self.settings = LossSettings(cfg.algo.epsilon, cfg.algo.epsilon_high, cfg.algo.beta)
        self.parameters = [p for p in policy.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.parameters, cfg)

    def _chunk_logprobs(self, model, rollout: Rollout, rows: torch.Tensor, with_entropy: bool):
        # speed.fast_linear: the model's matmuls in oneDNN for this forward and its backward.
        with onednn_linears(model, self.cfg.speed.fast_linear):
            return self._chunk_pass(model, rollout, rows, with_entropy)

    def _chunk_pass(self, model, rollout: Rollout, rows: torch.Tensor, with_entropy: bool):
        if self.cfg.speed.packed_learning:
            return packed_logprobs(model, rollout, rows, self.cfg.generation.temperature, with_entropy,
                                   self.cfg.speed.logit_chunk_tokens, self.cfg.speed.grouped_attention)
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
        ref_logps = self._reference_logprobs(rollout, chunks) if self.reference is not None else None
        old_logps: list[torch.Tensor | None] = [None] * len(chunks)
        metric_sums: dict[str, float] = {}
        entropy_sum = 0.0
        loss_total = 0.0
        grad_norm = 0.0
        for iteration in range(self.cfg.algo.num_iterations):
            loss_total = 0.0
            for index, rows in enumerate(chunks):
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
                loss.backward()
                loss_total += float(loss.detach())
                for key, value in metrics.items():
                    metric_sums[key] = metric_sums.get(key, 0.0) + value / len(chunks)
            grad_norm = self._optimizer_step()
        iterations = self.cfg.algo.num_iterations
        out = {key: value / iterations for key, value in metric_sums.items()}
        out.update(
            loss=loss_total,
            grad_norm=grad_norm,
            entropy=entropy_sum / max(float(mask.sum()), 1.0),
            lr=lr,
        )
        return out

    @torch.no_grad()
    def _reference_logprobs(self, rollout: Rollout, chunks) -> list[torch.Tensor]:
        with self.reference.active() as reference_model:
            return [self._chunk_logprobs(reference_model, rollout, rows, False).logps for rows in chunks]

    def _optimizer_step(self) -> float:
        max_norm = self.cfg.train.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.parameters, max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)
