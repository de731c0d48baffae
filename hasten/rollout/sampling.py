"""Token sampling from logits: repetition penalty, temperature, top-k, top-p, min-p, seeded.

Sampling uses one uniform number per row per step, drawn for every row of
the batch whether it is still running or not, and inverts that row's CDF.
So a row's token depends only on (seed, step, row, logits): removing
finished rows from the batch, or any other batch reshuffle, cannot change
which tokens the others get. (Gumbel-max would need a vocab-sized draw per
row per step; multinomial's stream shifts when rows are removed.)

The order is transformers' logits processors': repetition penalty on the raw
logits, then temperature, top-k, top-p, min-p. The recorded log-probs are
log-softmax(logits / temperature) of the unpenalized, unfiltered logits: what
the learner recomputes from the policy (TRL's learner ignores both too).
"""

from __future__ import annotations

import torch

from .types import SamplingParams


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Set logits outside top-k / top-p to -inf. logits: (N, V), already tempered."""
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (N, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if sampling.min_p > 0:
        probs = torch.softmax(logits, dim=-1)  # (N, V)
        floor = sampling.min_p * probs.max(dim=-1, keepdim=True).values  # (N, 1)
        logits = logits.masked_fill(probs < floor, float("-inf"))  # the top token always stays
    return logits


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: seen tokens' logits / penalty (x penalty if < 0).

    logits: (N, V) raw; seen: (N, V) bool, the tokens in each row's prompt and completion so far.
    """
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor | None, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. Returns (tokens (N,), logprobs (N,)).

    logprobs are log-softmax(logits / temperature) at the chosen token, before
    the penalty and the filters, i.e. what the learner recomputes for the same sequence.
    seen: (N, V) bool, needed when sampling.repetition_penalty != 1.
    """
    logits = logits.float()
    penalized = logits if seen is None else penalize_repetition(logits, seen, sampling.repetition_penalty)
    if sampling.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)  # (N, V)
        tokens = penalized.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    # x / 1.0 is x bit for bit: skip the two vocabulary-wide divisions at temperature 1.
    scaled = logits / sampling.temperature if sampling.temperature != 1.0 else logits  # (N, V)
    logprobs = torch.log_softmax(scaled, dim=-1)
    tempered = penalized / sampling.temperature if sampling.temperature != 1.0 else penalized
    probs = torch.softmax(filter_logits(tempered, sampling), dim=-1)
    cdf = probs.cumsum(dim=-1)  # (N, V)
    targets = uniforms[:, None] * cdf[:, -1:]  # scale by the total so rounding cannot overshoot
    tokens = torch.searchsorted(cdf, targets).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    # searchsorted may land on a zero-probability token whose cdf ties its neighbour; step back.
    # On the CPU the vocabulary-wide argmax runs only when that happened; on a GPU, asking would be
    # a host sync per decode step (the engine already has one), so the argmax always runs there.
    positive = probs.gather(-1, tokens[:, None]).squeeze(-1) > 0  # (N,)
    if logits.device.type != "cpu" or not bool(positive.all()):
        tokens = torch.where(positive, tokens, probs.argmax(-1))
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
