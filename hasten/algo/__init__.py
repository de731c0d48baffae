"""The algorithm: group-relative advantages and the loss registry."""

from .advantages import group_advantages, zero_variance_fraction
from .losses import LOSSES, LossInputs, LossSettings

__all__ = ["LOSSES", "LossInputs", "LossSettings", "group_advantages", "zero_variance_fraction"]
