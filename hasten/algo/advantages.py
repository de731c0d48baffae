"""Group-relative advantages: each sample's reward against its group's.

A = r - mean(group). `scale_rewards` then divides by a standard deviation:
  group  the group's own std (GRPO as published; TRL's default "group")
  batch  the std of all rewards in the batch (more robust for small groups)
  none   no division (Dr. GRPO: removes the difficulty bias of per-group std)
Standard deviations are unbiased (n - 1), as in TRL, and 1e-4 keeps an
all-equal group at advantage 0 rather than 0/0.
"""

from __future__ import annotations

import torch

EPS = 1e-4


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """rewards: (B*G,) group-major -> advantages (B*G,)."""
    grouped = rewards.view(-1, num_generations)  # (B, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (B, G)
    if scale_rewards == "group":
        centered = centered / (grouped.std(dim=1, keepdim=True) + EPS)
    elif scale_rewards == "batch":
        centered = centered / (rewards.std() + EPS)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return centered.reshape(-1)


def zero_variance_fraction(rewards: torch.Tensor, num_generations: int) -> float:
    """Fraction of groups whose rewards are all equal (they carry no signal)."""
    grouped = rewards.view(-1, num_generations)
    return float((grouped.max(dim=1).values - grouped.min(dim=1).values).abs().lt(1e-8).float().mean())
