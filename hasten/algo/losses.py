"""Policy-gradient losses as pure functions in a registry.

Each loss takes a LossInputs for one chunk of a generation batch and returns
(loss, metrics). Chunks are scaled so that the sum of their losses is the
loss of the whole batch: gradient accumulation over chunks then gives the
same gradient as one big pass, whatever the chunking (except bnpo, which is
defined per chunk, as in TRL).

Per token, with ratio r = exp(logp - old_logp) and advantage A of its sample:
    l = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL
where KL is the k3 estimator exp(ref - logp) - (ref - logp) - 1 (unbiased,
always >= 0); LossSettings.kl_bias_correction multiplies it by the ratio r (TRL's
use_bias_correction_kl, on by default there: r is 1 in value on-policy but not in
gradient, which makes the KL gradient the unbiased reverse-KL one). The variants differ in how tokens are averaged:
  grpo     mean over each sequence's tokens, then mean over sequences
           (the paper's form; favours short correct answers, long wrong ones)
  bnpo     sum over tokens / tokens in this chunk
  dr_grpo  sum over tokens / (sequences x max_completion_length) (no length bias)
  dapo     sum over tokens / tokens in the whole generation batch (TRL default)
  gspo     sequence-level ratio s = exp(mean_t(logp - old_logp)), clipped per
           sequence, mean over sequences (GSPO; use a small epsilon, ~3e-4)
LossSettings.sequence_level gives grpo, bnpo, dr_grpo and dapo that same
sequence ratio for every token (TRL's importance_sampling_level="sequence"
with any loss_type; with grpo it equals gspo).
  cispo    -min(r, epsilon_high).detach() x A x logp per token, dapo's sum (CISPO)
  sapo     -sigmoid(tau (r - 1)) x 4 / tau x A per token, grpo's means (SAPO;
           tau = sapo_temperature_pos for A > 0, _neg otherwise)
  luspo    the clipped surrogate summed over each sequence's tokens, mean over
           sequences (LUSPO: GSPO without the length normalisation)
  vespo    -phi(w) x A x logp per token, dapo's sum (VESPO), phi(w) = e^lambda
           w^k e^(-lambda w) of the sequence ratio w = exp(sum_t log r), detached
LossSettings.delta caps the unclipped ratio (two-sided clipping) and
off_policy_threshold drops negative-advantage sequences that drifted too far
from the sampling policy; both as TRL 1.16 computes them.
With num_iterations = 1 the old log-probs are the detached current ones, so
r = 1 in value while its gradient is the policy gradient. When a different
implementation sampled (vLLM), `importance_weights` w = min(pi_old / pi_sampler,
cap) multiply each token's surrogate before the KL term (TRL's
vllm_importance_sampling_correction); None leaves every loss unchanged.
The entropy bonus (TRL's entropy_coef) and a mixture-of-experts model's aux
loss are not losses of the registry: they are optional fields of LossInputs,
and `add_optional_terms` adds them to any registered loss (the same for every
loss type, as in TRL), the bonus with the coefficient algo/entropy.py's
control gives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class LossSettings:
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None = epsilon
    beta: float = 0.0
    sequence_level: bool = False  # every token's ratio is its sequence's exp(mean_t(logp - old_logp)) (TRL's
    # importance_sampling_level="sequence"); the loss then averages tokens as its type says
    surrogate: str = "clip"  # clip (PPO's) | cispo | sapo | vespo: the per-token policy term (set by the registry)
    delta: float | None = None  # two-sided clipping: the unclipped ratio capped at delta (TRL's delta)
    off_policy_threshold: float | None = None  # drop sequences with A < 0 whose mean KL(old || current) exceeds it
    sapo_temperature_pos: float = 1.0  # SAPO's soft-gate temperatures for A > 0 and A <= 0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0  # VESPO's gamma weight: exponent and decay for A >= 0 and for A < 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    kl_bias_correction: bool = False  # KL x the ratio r (TRL's use_bias_correction_kl); False: plain k3

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class LossInputs:
    logps: torch.Tensor  # (N, T) current policy, with grad
    old_logps: torch.Tensor  # (N, T) policy that sampled, detached
    ref_logps: torch.Tensor | None  # (N, T) reference policy, when beta > 0
    advantages: torch.Tensor  # (N,)
    completion_mask: torch.Tensor  # (N, T) 1 = completion token
    total_tokens: float  # completion tokens in the whole generation batch
    total_sequences: int  # sequences in the whole generation batch
    max_completion_length: int  # dr_grpo's constant normaliser
    num_chunks: int = 1  # chunks the batch is split into (bnpo averages chunks)
    importance_weights: torch.Tensor | None = None  # (N, T) detached per-token weights (vLLM's TIS), None = 1
    # The chunk's whole loss mask when some of its samples were left out of the pass (they cannot have a
    # gradient: algo/zero_advantage.py); bnpo and the clip metrics count its tokens. None = completion_mask.
    chunk_mask: torch.Tensor | None = None
    # Optional terms beyond the policy loss, built into the chunk's inputs (train/step_inputs.py) and added by
    # add_optional_terms; None leaves the loss as the registry's function returns it.
    entropies: torch.Tensor | None = None  # (N, T) token entropies with their gradient: the entropy bonus is on
    entropy_mask: torch.Tensor | None = None  # (N, T) the tokens the bonus averages (loss mask x high-entropy mask)
    entropy_coef: float = 0.0  # the bonus's coefficient this optimizer step (algo/entropy.py's control)
    aux_loss: torch.Tensor | None = None  # a mixture-of-experts model's load-balancing loss (scalar, with grad)
    aux_coef: float = 0.0  # algo.router_aux_loss_coef

    @property
    def chunk_tokens(self) -> torch.Tensor:
        mask = self.completion_mask if self.chunk_mask is None else self.chunk_mask
        return mask.sum().clamp(min=1)


Metrics = dict[str, float]


def _kl(inputs: LossInputs, settings: LossSettings, ratio: torch.Tensor) -> torch.Tensor | None:
    """(N, T) k3 per token, times the importance ratio `ratio` ((N, T) or (N, 1)) with kl_bias_correction."""
    if inputs.ref_logps is None:
        return None
    delta = inputs.ref_logps - inputs.logps  # (N, T)
    kl = torch.exp(delta) - delta - 1  # k3, >= 0
    return kl * ratio if settings.kl_bias_correction else kl


def _token_losses(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """Clipped surrogate + KL per token, (N, T), and clip metrics."""
    mask = inputs.completion_mask.to(inputs.logps.dtype)
    if settings.sequence_level:  # one ratio per sequence, broadcast over its tokens (N, T)
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1)
        log_ratio = ((inputs.logps - inputs.old_logps) * mask).sum(dim=1, keepdim=True) / lengths  # (N, 1)
        ratio = torch.exp(log_ratio).expand_as(inputs.logps)
    else:
        ratio = torch.exp(inputs.logps - inputs.old_logps)  # (N, T)
    advantages = inputs.advantages[:, None]  # (N, 1)
    losses = _surrogate(inputs, ratio, advantages, settings)  # (N, T)
    if settings.off_policy_threshold is not None:  # sequences too far off-policy with A < 0 learn nothing
        losses = losses * off_policy_mask(inputs.advantages[:, None], inputs.logps, inputs.old_logps,
                                          mask, settings.off_policy_threshold)
    if inputs.importance_weights is not None:  # before the KL term, as TRL applies it
        losses = losses * inputs.importance_weights
    tokens = inputs.chunk_tokens
    with torch.no_grad():
        low = ((ratio < 1 - settings.epsilon) & (advantages < 0)).float()
        high = ((ratio > 1 + settings.upper) & (advantages > 0)).float()
        metrics = {
            "clip_ratio/low": float((low * mask).sum() / tokens),
            "clip_ratio/high": float((high * mask).sum() / tokens),
        }
    kl = _kl(inputs, settings, ratio)
    if kl is not None and settings.beta > 0:
        losses = losses + settings.beta * kl
        metrics["kl"] = float((kl.detach() * mask).sum() / tokens)
    return losses * mask, metrics


def _surrogate(inputs: LossInputs, ratio: torch.Tensor, advantages: torch.Tensor,
               settings: LossSettings) -> torch.Tensor:
    """The per-token policy term (N, T): PPO's clipped surrogate (with delta's cap), CISPO's clipped
    importance weight on the log-prob (arXiv:2506.13585) or SAPO's sigmoid gate (arXiv:2511.20347)."""
    if settings.surrogate == "cispo":
        weight = torch.clamp(ratio, max=settings.upper).detach()
        return -weight * advantages * inputs.logps
    if settings.surrogate == "vespo":
        weight = vespo_weights(advantages, inputs.logps - inputs.old_logps, inputs.completion_mask.to(ratio.dtype),
                               settings)  # (N, 1)
        return -weight * advantages * inputs.logps
    if settings.surrogate == "sapo":
        temperature = torch.where(advantages > 0, torch.full_like(advantages, settings.sapo_temperature_pos),
                                  torch.full_like(advantages, settings.sapo_temperature_neg))  # (N, 1)
        return -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantages
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.upper)
    capped = ratio if settings.delta is None else torch.clamp(ratio, max=settings.delta)
    return -torch.min(capped * advantages, clipped * advantages)


@torch.no_grad()
def vespo_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
                  settings: LossSettings) -> torch.Tensor:
    """(N, 1) VESPO's gamma weight phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1), in log space, of the
    sequence ratio w = exp(sum_t log r) (clamped as TRL clamps it), k and lambda by the advantage's sign
    (arXiv:2602.10693; TRL's get_gamma_weights without a vLLM ratio). advantages: (N, 1); log_ratio, mask: (N, T)."""
    lower = math.log(1e-8)
    log_w = torch.clamp((torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(dim=1, keepdim=True), lower, 20.0)  # (N, 1)
    positive = advantages >= 0
    k = torch.where(positive, settings.vespo_k_pos, settings.vespo_k_neg)
    lam = torch.where(positive, settings.vespo_lambda_pos, settings.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_mask(advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor,
                    mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """(N, 1) 1 = keep: a sequence is dropped when its advantage is negative and its mean token KL from
    the sampling policy, mean_t(sampling_logp - logp), exceeds threshold (DeepSeek-V3.2's off-policy
    sequence masking, TRL's off_policy_mask_threshold)."""
    divergence = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)  # (N, T)
    mean = (divergence * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # (N, 1)
    return ((advantages >= 0) | (mean <= threshold)).to(mask.dtype)


def grpo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """GRPO: the clipped surrogate (and KL) averaged over each sequence's tokens, then over sequences (the
    paper's form; it favours short correct answers and long wrong ones)."""
    losses, metrics = _token_losses(inputs, settings)
    lengths = inputs.completion_mask.sum(dim=1).clamp(min=1)  # (N,)
    per_sequence = losses.sum(dim=1) / lengths  # (N,)
    return per_sequence.sum() / inputs.total_sequences, metrics


def bnpo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """BNPO: the per-token losses summed over the chunk's tokens, divided by that chunk's token count (defined
    per accumulation chunk, as TRL)."""
    losses, metrics = _token_losses(inputs, settings)
    return losses.sum() / inputs.chunk_tokens / inputs.num_chunks, metrics


def dr_grpo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """Dr. GRPO: the per-token losses summed, divided by sequences x max_completion_length (no length bias)."""
    losses, metrics = _token_losses(inputs, settings)
    return losses.sum() / (inputs.total_sequences * inputs.max_completion_length), metrics


def dapo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """DAPO: the per-token losses summed, divided by the tokens of the whole generation batch (TRL's default)."""
    losses, metrics = _token_losses(inputs, settings)
    return losses.sum() / max(inputs.total_tokens, 1.0), metrics


def gspo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """GSPO: the sequence ratio exp(mean_t(logp - old_logp)), clipped per sequence, mean over sequences (TRL's
    loss_type="grpo" with importance_sampling_level="sequence"; use a small epsilon, ~3e-4)."""
    mask = inputs.completion_mask.to(inputs.logps.dtype)
    present = (mask.sum(dim=1) > 0).to(mask.dtype)  # (N,) an empty completion contributes nothing
    lengths = mask.sum(dim=1).clamp(min=1)  # (N,)
    log_ratio = ((inputs.logps - inputs.old_logps) * mask).sum(dim=1) / lengths  # (N,)
    ratio = torch.exp(log_ratio)  # sequence-level importance ratio
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.upper)
    losses = -torch.min(ratio * inputs.advantages, clipped * inputs.advantages)  # (N,)
    if inputs.importance_weights is not None:  # TRL weights the broadcast per-token loss: the token mean here
        losses = losses * (inputs.importance_weights * mask).sum(dim=1) / lengths
    with torch.no_grad():
        chunk = mask if inputs.chunk_mask is None else inputs.chunk_mask.to(mask.dtype)
        sequences = (chunk.sum(dim=1) > 0).sum().clamp(min=1)
        low = (ratio < 1 - settings.epsilon) & (inputs.advantages < 0)
        high = (ratio > 1 + settings.upper) & (inputs.advantages > 0)
        metrics = {
            "clip_ratio/low": float((low.float() * present).sum() / sequences),
            "clip_ratio/high": float((high.float() * present).sum() / sequences),
        }
    kl = _kl(inputs, settings, ratio[:, None])
    if kl is not None and settings.beta > 0:
        losses = losses + settings.beta * (kl * mask).sum(dim=1) / lengths
        # Logged token-weighted, as the other losses (and TRL) log it.
        metrics["kl"] = float((kl.detach() * mask).sum() / inputs.chunk_tokens)
    return (losses * present).sum() / inputs.total_sequences, metrics


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """(N, T) bool: the completion tokens whose entropy is at least the (1 - quantile) quantile of the
    chunk's completion-token entropies (TRL's top_entropy_quantile, arXiv:2506.01939); the rest get no
    policy gradient. quantile 1 keeps every token; no tokens gives an all-False mask."""
    return entropy_quantile_mask(entropies, mask, 1.0 - quantile)


def entropy_quantile_mask(entropies: torch.Tensor, mask: torch.Tensor, level: float) -> torch.Tensor:
    """(N, T) bool: the `mask` tokens whose entropy is at least the `level` quantile of the masked
    entropies (TRL's GRPOTrainer.get_high_entropy_mask(entropies, mask, threshold=level))."""
    present = mask.bool()
    values = entropies[present].float()
    if not values.numel():
        return torch.zeros_like(present)
    threshold = torch.quantile(values, level)
    return ((entropies * mask) >= threshold) & present


def entropy_term(entropies: torch.Tensor, mask: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """The chunk's share of the entropy bonus: the mean entropy over `mask`'s tokens, / num_chunks.

    entropies: (N, T) with grad; mask: (N, T) the loss mask, times the high-entropy mask when
    top_entropy_quantile < 1. TRL's bonus is this mean per micro-batch divided by the accumulation
    steps, never a loss type's normaliser; add_optional_terms subtracts coefficient x this from the loss."""
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1) / num_chunks


def add_optional_terms(loss: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """The chunk's loss to backpropagate: the registry's `loss`, minus coefficient x the entropy bonus, plus
    coefficient x the aux loss, each where its inputs are set. Both are divided by the chunks as TRL divides
    them by its accumulation steps, never by a loss type's normaliser, so they are the same for every loss."""
    if inputs.entropies is not None:
        loss = loss - inputs.entropy_coef * entropy_term(inputs.entropies, inputs.entropy_mask, inputs.num_chunks)
    if inputs.aux_loss is not None:
        loss = loss + inputs.aux_coef * inputs.aux_loss / inputs.num_chunks
    return loss


def cispo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """CISPO: -min(r, epsilon_high) (detached) x A x logp per token, summed over the batch's tokens (as dapo)."""
    return dapo_loss(inputs, dataclasses.replace(settings, surrogate="cispo"))


def sapo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """SAPO: a sigmoid gate on the ratio instead of a hard clip, averaged per sequence (as grpo)."""
    return grpo_loss(inputs, dataclasses.replace(settings, surrogate="sapo"))


def luspo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """LUSPO: the clipped surrogate (and KL) summed over each sequence's tokens, mean over sequences
    (arXiv:2602.05261); TRL pairs it with importance_sampling_level="sequence"."""
    losses, metrics = _token_losses(inputs, settings)
    return losses.sum() / inputs.total_sequences, metrics


def vespo_loss(inputs: LossInputs, settings: LossSettings) -> tuple[torch.Tensor, Metrics]:
    """VESPO: -phi(w) x A x logp per token with the detached gamma weight of the sequence ratio, summed
    over the batch's tokens (as dapo)."""
    return dapo_loss(inputs, dataclasses.replace(settings, surrogate="vespo"))


LOSSES: dict[str, Callable[[LossInputs, LossSettings], tuple[torch.Tensor, Metrics]]] = {
    "grpo": grpo_loss,
    "bnpo": bnpo_loss,
    "dr_grpo": dr_grpo_loss,
    "dapo": dapo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "luspo": luspo_loss,
    "vespo": vespo_loss,
}
