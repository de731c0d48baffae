"""Token sampling from logits: temperature, top-k, top-p, seeded.

Sampling uses one uniform number per row per step, drawn for every row of
the batch whether it is still running or not, and inverts that row's CDF.
So a row's token depends only on (seed, step, row, logits): removing
finished rows from the batch, or any other batch reshuffle, cannot change
which tokens the others get. (Gumbel-max would need a vocab-sized draw per
row per step; multinomial's stream shifts when rows are removed.)
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
    return logits


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. Returns (tokens (N,), logprobs (N,)).

    logprobs are log-softmax(logits / temperature) at the chosen token, before
    filtering, i.e. what the learner recomputes for the same sequence.
    """
    logits = logits.float()
    if sampling.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)  # (N, V)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / sampling.temperature  # (N, V)
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(filter_logits(scaled, sampling), dim=-1)
    cdf = probs.cumsum(dim=-1)  # (N, V)
    targets = uniforms[:, None] * cdf[:, -1:]  # scale by the total so rounding cannot overshoot
    tokens = torch.searchsorted(cdf, targets).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    # searchsorted may land on a zero-probability token whose cdf ties its neighbour; step back.
    tokens = torch.where(probs.gather(-1, tokens[:, None]).squeeze(-1) > 0, tokens, probs.argmax(-1))
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
