"""Curriculum (algo.curriculum, algo.curriculum_warmup_steps): easy prompts first.

For the first warmup_steps steps, prompts are drawn from the easiest part of
the training data, a pool that grows linearly from the easiest quarter to
all of it; after warmup the sampler is the plain seeded shuffle over all data
(the full mix). Difficulty comes from one of three strategies:

    length        characters of the prompt plus its answer/solution column
    complexity    control structures and operators (if/for/while/def/...,
                  + - * / = < >) and numbers in the prompt and answer
    success_rate  the mean reward of the prompt's past groups, highest first;
                  prompts not yet seen rank at the mean of those seen

length and complexity are fixed orders computed once; success_rate is
updated by `observe` after every step. This changes what is learned (the data
order), which is its point: on tasks with a wide difficulty range, easy
prompts give groups with mixed rewards (signal) early. It does not make a
step faster.
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from typing import Any, Callable

from .sampler import PromptSampler, as_random_state

_KEYWORDS = re.compile(r"\b(if|elif|else|for|while|try|except|with|def|class|lambda|return|yield|and|or|not)\b")
_OPERATORS = re.compile(r"[-+*/%^=<>]")
_NUMBERS = re.compile(r"\d+(?:\.\d+)?")
START_FRACTION = 0.25  # the pool starts as the easiest quarter of the data


def _text(row: dict[str, Any]) -> str:
    prompt = row["prompt"]
    if isinstance(prompt, list):  # chat messages: the last user turn is the question
        prompt = next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")
    extra = " ".join(str(row[key]) for key in ("answer", "solution") if row.get(key) is not None)
    return f"{prompt} {extra}"


def length_difficulty(row: dict[str, Any]) -> float:
    return float(len(_text(row)))


def complexity_difficulty(row: dict[str, Any]) -> float:
    text = _text(row)
    return float(2 * len(_KEYWORDS.findall(text)) + len(_OPERATORS.findall(text)) + len(_NUMBERS.findall(text)))


STATIC_DIFFICULTY: dict[str, Callable[[dict[str, Any]], float]] = {
    "length": length_difficulty,
    "complexity": complexity_difficulty,
}


class CurriculumSampler:
    """PromptSampler's interface (`next(count)`) plus `observe(rows, group_rewards)`."""

    def __init__(self, rows: list[dict[str, Any]], seed: int, strategy: str, warmup_steps: int, prompts_per_step: int):
        self.rows = rows
        self.full = PromptSampler(rows, seed)  # the full mix, after warmup
        self.random = random.Random(seed + 1)
        self.strategy = strategy
        # Warmup is counted in prompts drawn, so dynamic sampling's refills use it up at the rate they draw.
        self.warmup_prompts = warmup_steps * prompts_per_step
        self.drawn = 0
        self.recent: deque[int] = deque(maxlen=max(prompts_per_step - 1, 0))  # no repeats within a batch
        self.index = {id(row): i for i, row in enumerate(rows)}
        self.success: dict[int, tuple[float, int]] = {}  # row index -> (reward sum, groups)
        self.order: list[int] | None = None
        if strategy in STATIC_DIFFICULTY:
            difficulty = [STATIC_DIFFICULTY[strategy](row) for row in rows]
            self.order = sorted(range(len(rows)), key=lambda i: (difficulty[i], i))

    @property
    def warming_up(self) -> bool:
        return self.drawn < self.warmup_prompts

    @property
    def depends_on_feedback(self) -> bool:
        """True while the next draw depends on rewards not yet observed (prefetch must wait)."""
        return self.strategy == "success_rate" and self.warming_up

    def pool_size(self, count: int) -> int:
        """How many of the easiest rows the current draw may pick from."""
        fraction = START_FRACTION + (1 - START_FRACTION) * self.drawn / max(self.warmup_prompts, 1)
        return min(len(self.rows), max(count, math.ceil(len(self.rows) * fraction)))

    def easiest(self) -> list[int]:
        if self.order is not None:
            return self.order
        seen = [total / groups for total, groups in self.success.values()]
        prior = sum(seen) / len(seen) if seen else 0.0

        def rate(i: int) -> float:
            total, groups = self.success.get(i, (prior, 1))
            return total / groups

        return sorted(range(len(self.rows)), key=lambda i: (-rate(i), i))

    def next(self, count: int) -> list[dict[str, Any]]:
        """`count` rows, drawn one at a time so that the stream does not depend on how draws are batched
        (prefetching and refills ask for different counts); a row drawn within the last
        prompts_per_step - 1 draws is not drawn again while others are available."""
        picks = []
        ranked = self.easiest()  # fixed within a call: it changes only on observe()
        for _ in range(count):
            if not self.warming_up:
                picks += [self.index[id(row)] for row in self.full.next(1)]
                continue
            pool = [i for i in ranked[: self.pool_size(1)] if i not in self.recent] or ranked[: self.pool_size(1)]
            picks.append(pool[self.random.randrange(len(pool))])
            self.recent.append(picks[-1])
            self.drawn += 1
        return [self.rows[i] for i in picks]

    def observe(self, rows: list[dict[str, Any]], group_rewards: list[float]) -> None:
        """Record each prompt's group mean reward (success_rate reads it)."""
        for row, reward in zip(rows, group_rewards):
            index = self.index.get(id(row))
            if index is not None:
                total, groups = self.success.get(index, (0.0, 0))
                self.success[index] = (total + reward, groups + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"full": self.full.state_dict(), "random": self.random.getstate(), "drawn": self.drawn,
                "recent": list(self.recent), "success": {i: list(value) for i, value in self.success.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.full.load_state_dict(state["full"])
        self.random.setstate(as_random_state(state["random"]))
        self.drawn = int(state["drawn"])
        self.recent.clear()
        self.recent.extend(state["recent"])
        self.success = {int(i): (float(total), int(groups)) for i, (total, groups) in state["success"].items()}
