"""Group-relative advantages: each sample's reward against its group's.

A = r - mean(group). `scale_rewards` then divides by a standard deviation:
  group  the group's own std (GRPO as published; TRL's default "group")
  batch  the std of all rewards in the batch (more robust for small groups)
  none   no division (Dr. GRPO: removes the difficulty bias of per-group std)
Standard deviations are unbiased (n - 1), as in TRL, and 1e-4 keeps an
all-equal group at advantage 0 rather than 0/0.

A NaN reward marks a sample no reward function applied to (every one
returned None). As in TRL 1.16, it is left out of its group's mean and std
and its advantage is 0: a sum of nothing is not a score of 0, and counting it
as one would both shift the group's baseline and push the policy towards or
away from a completion nobody judged.
"""

from __future__ import annotations

import torch

EPS = 1e-4


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std over the non-NaN entries; NaN where fewer than two (TRL's nanstd)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True) if dim is not None else torch.nanmean(values)
    present = ~torch.isnan(values)
    count = present.sum(dim=dim, keepdim=True) if dim is not None else present.sum()
    squares = torch.where(present, (values - mean) ** 2, torch.zeros_like(values))
    total = squares.sum(dim=dim, keepdim=True) if dim is not None else squares.sum()
    std = torch.where(count > 1, (total / (count - 1).clamp(min=1)).sqrt(), torch.full_like(total, float("nan")))
    return std if keepdim or dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """rewards: (B*G,) group-major, NaN = unscorable -> advantages (B*G,), 0 for unscorable samples."""
    grouped = rewards.view(-1, num_generations)  # (B, G)
    centered = grouped - torch.nanmean(grouped, dim=1, keepdim=True)  # (B, G); NaN stays NaN
    if scale_rewards == "group":
        centered = centered / (nanstd(grouped, dim=1, keepdim=True) + EPS)
    elif scale_rewards == "batch":
        centered = centered / (nanstd(rewards) + EPS)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return torch.nan_to_num(centered.reshape(-1), nan=0.0)


def normalized_sum_advantages(per_function: torch.Tensor, weights: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL's multi_objective_aggregation="normalize_then_sum": each function's scores z-scored within
    their group, summed with the weights (NaN: the function did not apply), then z-scored over the
    batch. per_function: (B*G, F) group-major; weights: (F,). -> (B*G,), 0 for unscorable samples."""
    grouped = per_function.view(-1, num_generations, per_function.shape[1])  # (B, G, F)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # (B, 1, F)
    std = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + EPS)).view(-1, per_function.shape[1])  # (B*G, F)
    rewards = (normalized * weights[None, :]).nansum(dim=1)  # (B*G,)
    rewards[torch.isnan(per_function).all(dim=1)] = float("nan")  # no function applied: unscorable
    spread = nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())
    return torch.nan_to_num((rewards - torch.nanmean(rewards)) / (spread + EPS), nan=0.0)


def zero_variance_fraction(rewards: torch.Tensor, num_generations: int) -> float:
    """Fraction of groups whose (scorable) rewards are all equal (they carry no signal)."""
    grouped = rewards.view(-1, num_generations)
    present = ~torch.isnan(grouped)
    high = torch.where(present, grouped, torch.full_like(grouped, -float("inf"))).max(dim=1).values
    low = torch.where(present, grouped, torch.full_like(grouped, float("inf"))).min(dim=1).values
    flat = ~present.any(dim=1) | (high - low).abs().lt(1e-8)
    return float(flat.float().mean())
