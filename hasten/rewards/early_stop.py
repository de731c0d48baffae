"""Early termination (algo.gate_reward): a cheap gate decides which samples get the other rewards.

The gate function (e.g. "does the code parse") runs first, on every sample.
A sample whose gate score is below algo.gate_threshold fails: no other
reward function sees it (their columns hold NaN, "did not apply"), and its
total reward is the fixed algo.gate_failed_reward. A gate that returns None
for a sample does not judge it, so it passes.

This changes what is learned only for failing samples, whose total becomes
the fixed value instead of the weighted sum; choose gate_failed_reward at or
below what those samples would have scored, or the gate rewards failing.
"""

from __future__ import annotations

import math

import torch


def passed_samples(gate_scores: list[float], threshold: float) -> list[bool]:
    """True where the sample passes (score >= threshold, or the gate did not apply)."""
    return [math.isnan(score) or score >= threshold for score in gate_scores]


def apply_gate(total: torch.Tensor, passed: list[bool], failed_reward: float) -> torch.Tensor:
    """total: (N,) -> (N,) with failed samples set to the fixed reward."""
    failed = ~torch.tensor(passed, dtype=torch.bool)  # (N,)
    return torch.where(failed, torch.full_like(total, failed_reward), total)
