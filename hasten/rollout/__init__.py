"""Generation: the Engine protocol, its records, and the KV-cache engine."""

from .engine import KVCacheEngine, left_pad
from .types import Engine, Rollout, RowRange, SamplingParams

__all__ = ["Engine", "KVCacheEngine", "Rollout", "RowRange", "SamplingParams", "left_pad"]
