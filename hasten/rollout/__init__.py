"""Generation: the Engine protocol, its records, and the KV-cache engine."""

from .engine import KVCacheEngine, left_pad
from .types import Engine, Rollout, SamplingParams

__all__ = ["Engine", "KVCacheEngine", "Rollout", "SamplingParams", "left_pad"]
