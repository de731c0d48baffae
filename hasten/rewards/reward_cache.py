"""Reward cache (speed.reward_cache): an LRU of scores of deterministic reward functions.

The key is (function name, a 128-bit digest of the sample's prompt,
completion, completion ids and dataset columns), so a hit needs the exact
same inputs; the value is the score (or None). Only functions declared
deterministic are cached (RewardFunction.deterministic, or their name in
speed.cache_rewards): a function that reads the clock, a random draw or
external state must not be.

Hits come from repeats: GRPO samples G completions per prompt, and short
answers repeat within a group and across epochs. For a reward that costs
microseconds (a regex) the digest costs about as much as the call; the cache
pays off for slow deterministic rewards (running tests, type checking).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

MISSING = object()  # a cached None is a real value ("does not apply")


def sample_key(name: str, prompt: Any, completion: Any, completion_ids: list[int], columns: dict[str, Any]) -> tuple:
    """(name, digest) for one sample; columns are this sample's values."""
    text = json.dumps([prompt, completion, completion_ids, columns], sort_keys=True, default=repr)
    return name, hashlib.blake2b(text.encode(), digest_size=16).digest()


class RewardCache:
    """Least-recently-used map from sample_key to score, at most max_size entries."""

    def __init__(self, max_size: int):
        self.max_size = max_size
        self.entries: OrderedDict[tuple, float | None] = OrderedDict()
        self.hits = 0
        self.lookups = 0

    def get(self, key: tuple) -> Any:
        """The cached score, or MISSING."""
        self.lookups += 1
        value = self.entries.get(key, MISSING)
        if value is not MISSING:
            self.hits += 1
            self.entries.move_to_end(key)
        return value

    def put(self, key: tuple, value: float | None) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_size:
            self.entries.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0
