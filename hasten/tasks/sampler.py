"""The seeded stream of training rows a run draws its prompts from.

Its whole position is `state_dict()`: the shuffle RNG and what is left of
the current epoch's order, so a resumed run draws exactly the rows the
uninterrupted run would have drawn.
"""

from __future__ import annotations

import random
from typing import Any


class PromptSampler:
    """Endless seeded stream of rows: a fresh shuffle every epoch over the data (or the data's order)."""

    def __init__(self, rows: list[dict], seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("the task has no training rows")
        self.rows = rows
        self.random = random.Random(seed)
        self.shuffle = shuffle  # False: every epoch in the rows' own order (train.shuffle)
        self.order: list[int] = []

    def next(self, count: int) -> list[dict]:
        batch = []
        while len(batch) < count:
            if not self.order:
                self.order = list(range(len(self.rows)))
                if self.shuffle:
                    self.random.shuffle(self.order)
                else:
                    self.order.reverse()  # pop() takes from the end: row 0 first
            batch.append(self.rows[self.order.pop()])
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"random": self.random.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.random.setstate(as_random_state(state["random"]))
        self.order = list(state["order"])


def as_random_state(state) -> tuple:
    """random.Random state after a round trip through a checkpoint (lists back to tuples)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
