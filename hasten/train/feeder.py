"""The run's prompt source, with background prefetch (speed.prefetch).

The trainer takes each step's prompts from a `Feeder`: rows from the sampler
(plain shuffle or curriculum) and their token ids. With prefetch on, the next
step's rows are drawn and tokenized on a background thread while the current
step generates and learns. Rows come from one FIFO buffer over the sampler's
single stream, so the sequence of rows is exactly the one without prefetch,
including refills for dynamic sampling. While a curriculum's draws depend
on rewards (success_rate during warmup), nothing is drawn ahead.

Honest size of the win: tokenizing 4 chat prompts takes about a millisecond,
so on built-in tasks this saves little; it matters for tasks whose rows are
expensive to produce (read from disk, rendered from templates, retrieved).
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import Any

from ..rollout.prompts import encode_prompt


def make_feeder(cfg, rows: list[dict[str, Any]], tokenizer) -> Feeder:
    """The run's prompt source: plain shuffle or curriculum (algo.curriculum), prefetched or not."""
    from ..tasks.curriculum import CurriculumSampler
    from ..tasks.sampler import PromptSampler

    if cfg.algo.curriculum == "off":
        sampler = PromptSampler(rows, cfg.train.seed, cfg.train.shuffle)
    else:
        sampler = CurriculumSampler(rows, cfg.train.seed, cfg.algo.curriculum, cfg.algo.curriculum_warmup_steps,
                                    cfg.train.prompts_per_step)
    return Feeder(sampler, tokenizer, cfg.train.prompts_per_step, cfg.speed.prefetch,
                  cfg.generation.chat_template_kwargs)


class Feeder:
    """take(count) -> (rows, prompt token ids); observe() passes rewards to a curriculum."""

    def __init__(self, sampler, tokenizer, batch_size: int, prefetch: bool, template_kwargs: dict | None = None):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs or {}
        self.batch_size = batch_size
        self.buffer: deque[tuple[dict[str, Any], list[int]]] = deque()
        self.pending: concurrent.futures.Future | None = None
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "hasten-prefetch") if prefetch else None

    def _draw(self, count: int) -> list[tuple[dict[str, Any], list[int]]]:
        return [(row, self._encode(row)) for row in self.sampler.next(count)]

    def _encode(self, row: dict[str, Any]) -> list[int]:
        return encode_prompt(self.tokenizer, row["prompt"], **self.template_kwargs)

    def _settle(self) -> None:
        if self.pending is not None:
            self.buffer.extend(self.pending.result())
            self.pending = None

    def take(self, count: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
        self._settle()
        if len(self.buffer) < count:
            self.buffer.extend(self._draw(count - len(self.buffer)))
        items = [self.buffer.popleft() for _ in range(count)]
        self.prefetch()
        return [row for row, _ in items], [ids for _, ids in items]

    def prefetch(self) -> None:
        """Start drawing the next batch in the background, if on and the sampler allows it."""
        if self.executor is None or self.pending is not None or getattr(self.sampler, "depends_on_feedback", False):
            return
        if len(self.buffer) < self.batch_size:
            self.pending = self.executor.submit(self._draw, self.batch_size - len(self.buffer))

    def observe(self, rows: list[dict[str, Any]], group_rewards: list[float]) -> None:
        if hasattr(self.sampler, "observe"):
            self._settle()  # no draw may race the update
            self.sampler.observe(rows, group_rewards)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position plus the rows drawn ahead and not yet used (as row indices)."""
        self._settle()  # a draw in flight belongs to the state
        index = {id(row): i for i, row in enumerate(self.sampler.rows)}
        return {"sampler": self.sampler.state_dict(), "buffer": [index[id(row)] for row, _ in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._settle()
        self.sampler.load_state_dict(state["sampler"])
        rows = [self.sampler.rows[i] for i in state["buffer"]]
        self.buffer = deque((row, self._encode(row)) for row in rows)

    def close(self) -> None:
        if self.executor is not None:
            self._settle()
            self.executor.shutdown(wait=True)
