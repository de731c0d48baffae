"""Between text and token ids: prompt encoding, prompt sampling, reward inputs.

Rows follow TRL's dataset conventions: "prompt" is either a string
(standard) or a list of chat messages (conversational). Conversational
prompts go through the tokenizer's chat template with the generation prompt
appended; standard ones are tokenized as they are. Reward functions receive
completions in the matching form, as TRL passes them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ..rollout import Rollout


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PromptSampler:
    """Endless seeded stream of rows: a fresh shuffle every epoch over the data."""

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("the task has no training rows")
        self.rows = rows
        self.random = random.Random(seed)
        self.order: list[int] = []

    def next(self, count: int) -> list[dict]:
        batch = []
        while len(batch) < count:
            if not self.order:
                self.order = list(range(len(self.rows)))
                self.random.shuffle(self.order)
            batch.append(self.rows[self.order.pop()])
        return batch


@dataclass
class RewardInputs:
    """Per-sample lists in TRL's reward-function layout (group-major)."""

    prompts: list[Any]
    completions: list[Any]
    texts: list[str]  # plain completion text, whatever the prompt style
    columns: dict[str, list]
    completion_ids: list[list[int]]


def reward_inputs(tokenizer, rows: list[dict], rollout: Rollout) -> RewardInputs:
    group = rollout.num_generations
    completion_ids = rollout.completion_token_lists()
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    sample_rows = [row for row in rows for _ in range(group)]
    completions = [
        [{"role": "assistant", "content": text}] if isinstance(row["prompt"], list) else text
        for row, text in zip(sample_rows, texts)
    ]
    keys = sorted({key for row in rows for key in row if key != "prompt"})
    columns = {key: [row.get(key) for row in sample_rows] for key in keys}
    return RewardInputs(
        prompts=[row["prompt"] for row in sample_rows],
        completions=completions,
        texts=texts,
        columns=columns,
        completion_ids=completion_ids,
    )
