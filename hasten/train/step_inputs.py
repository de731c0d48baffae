"""A GRPO step's batch as the loss sees it: every optional term built once into each chunk's LossInputs.

`Learner.step` reads as the update (log-probs, LOSSES[algo.loss], backward,
the optimizer); what varies by config is decided here, once per step, so the
step never branches on a feature:

    chunks     gradient_accumulation_steps chunks of whole samples (split again to
               speed.token_budget tokens, microbatch.py), empty ones dropped
    passes     per chunk, the samples whose loss can have a gradient
               (speed.skip_zero_advantage, algo/zero_advantage.py); the chunk itself otherwise
    totals     the loss's normalisers over the global batch (distributed.batch_totals)
    anchors    per chunk, fixed on its first pass (before any update): the old log-probs the
               ratio is taken against and the importance weights (the run's Correction),
               times the high-entropy mask (algo.top_entropy_quantile)
    terms      the entropy bonus (algo.entropy_coef: the entropies with their gradient, over
               the tokens the policy term learns from) and a mixture-of-experts model's aux
               loss (algo.router_aux_loss_coef), which losses.add_optional_terms adds

`StepSums` adds up what the step reports over its chunks and iterations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..algo import LossInputs
from ..algo.losses import high_entropy_mask
from ..rollout import Rollout
from .logprobs import TokenStats

# (logps, sampling log-probs, loss mask) of a chunk's first pass -> (old log-probs, importance weights or None)
Anchor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class StepBatch:
    """One step's rollout split into chunks, with what every chunk's loss inputs need."""

    rollout: Rollout
    advantages: torch.Tensor  # (B*G,)
    mask: torch.Tensor  # (B*G, T) the loss mask
    chunks: list[torch.Tensor]  # sample indices per accumulation chunk, none empty
    passes: list[torch.Tensor]  # per chunk, the samples that go through the pass (may be empty)
    totals: tuple[float, int, int]  # global completion tokens, sequences, chunks (bnpo averages every rank's)
    ref_logps: list[torch.Tensor | None] | None  # per pass, the reference's (N, T) log-probs; None without one
    anchor: Anchor  # the run's Correction (learner.py), adding to this step's off-policy statistics
    trackers: tuple  # those statistics (staleness, sampler), None where that correction is off
    top_entropy_quantile: float = 1.0  # < 1: the high-entropy tokens alone learn (TRL)
    entropy_bonus: bool = False  # algo.entropy_coef or adaptive_entropy: the entropies join the loss
    router_aux_loss_coef: float = 0.0  # > 0: the aux loss joins the loss
    # per chunk, fixed on its first pass: (old log-probs, importance weights, high-entropy mask or None)
    anchors: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None] = field(default_factory=list)
    entropy: float = 0.0  # the first pass's entropy sum and tokens (the `entropy` metric)
    entropy_tokens: float = 0.0

    def __post_init__(self):
        self.anchors = [None] * len(self.chunks)

    @property
    def learned(self) -> int:
        """Samples that go through the pass."""
        return sum(rows.numel() for rows in self.passes)

    def loss_inputs(self, index: int, stats: TokenStats, entropy_coef: float) -> LossInputs:
        """Chunk `index`'s LossInputs from its pass's `stats`; its anchors are fixed on the chunk's first pass.

        entropy_coef: the bonus's coefficient this optimizer step (used when the bonus is on)."""
        rows, mask = self.passes[index], self.mask
        if self.anchors[index] is None:
            self.anchors[index] = self._fix_anchors(rows, stats)
        old, weights, keep = self.anchors[index]
        device = stats.logps.device
        completion_mask = mask[rows].to(device)  # (n, T)
        bonus_tokens = None
        if self.entropy_bonus:  # TRL's effective mask: the loss mask times the high-entropy mask
            bonus_tokens = completion_mask.to(stats.entropy.dtype) * (1.0 if keep is None else keep)  # (n, T)
        return LossInputs(
            logps=stats.logps, old_logps=old, ref_logps=None if self.ref_logps is None else self.ref_logps[index],
            advantages=self.advantages[rows].to(device), completion_mask=completion_mask,
            total_tokens=self.totals[0], total_sequences=self.totals[1],
            max_completion_length=self.rollout.sampling.max_new_tokens, num_chunks=self.totals[2],
            importance_weights=weights,
            chunk_mask=None if rows is self.chunks[index] else mask[self.chunks[index]].to(device),
            entropies=stats.entropy if self.entropy_bonus else None, entropy_mask=bonus_tokens,
            entropy_coef=entropy_coef,
            aux_loss=stats.aux_loss if self.router_aux_loss_coef > 0 else None, aux_coef=self.router_aux_loss_coef,
        )

    def _fix_anchors(self, rows: torch.Tensor, stats: TokenStats
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(old log-probs, importance weights, high-entropy mask) from the chunk's first pass, before any update;
        its entropy is counted for the `entropy` metric."""
        mask = self.mask
        old, weights = self.anchor(stats.logps.detach(), self.rollout.sampling_logprobs[rows], mask[rows])
        keep = None
        if self.top_entropy_quantile < 1.0:  # the high-entropy tokens alone learn (TRL)
            keep = high_entropy_mask(stats.entropy.detach(), mask[rows].to(old.device),
                                     self.top_entropy_quantile).to(old.dtype)
            weights = keep if weights is None else weights * keep
        self.entropy += float((stats.entropy.detach() * mask[rows]).sum())
        self.entropy_tokens += float(mask[rows].sum())
        return old, weights, keep


@dataclass
class StepSums:
    """What a step adds up over its chunks and iterations before it reports (this rank's shares)."""

    metrics: dict[str, float] = field(default_factory=lambda: {"clip_ratio/low": 0.0, "clip_ratio/high": 0.0})
    loss: float = 0.0
    policy_loss: float = 0.0  # the loss without the entropy bonus (reported when the bonus is on)
    bonus_entropy: float = 0.0  # this optimizer step's entropy sum and tokens under the bonus (adaptive control)
    bonus_tokens: float = 0.0
    grad_norm: float = 0.0

    @classmethod
    def for_step(cls, reports_kl: bool) -> StepSums:
        """reports_kl: the loss has a KL term; its key is there from the start, so a rank whose every
        sample was skipped reports the same keys as the others."""
        sums = cls()
        if reports_kl:
            sums.metrics["kl"] = 0.0
        return sums

    def start_iteration(self) -> None:
        """A new optimizer step: the loss and the bonus's entropy are per optimizer step."""
        self.loss = self.policy_loss = self.bonus_entropy = self.bonus_tokens = 0.0

    def add(self, inputs: LossInputs, policy_loss: torch.Tensor, loss: torch.Tensor, metrics: dict[str, float],
            num_chunks: int) -> None:
        """One chunk: the registry's loss and metrics, the loss with its optional terms, the bonus's tokens.
        num_chunks: this rank's chunks (the metrics are a mean over them)."""
        self.policy_loss += float(policy_loss.detach())
        if inputs.entropies is not None:
            self.bonus_entropy += float((inputs.entropies.detach() * inputs.entropy_mask).sum())
            self.bonus_tokens += float(inputs.entropy_mask.sum())
        if inputs.aux_loss is not None:
            self.metrics["aux_loss"] = self.metrics.get("aux_loss", 0.0) + float(inputs.aux_loss.detach()) / num_chunks
        self.loss += float(loss.detach())
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value / num_chunks
