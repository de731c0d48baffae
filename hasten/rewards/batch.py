"""What a generation round hands the rewards, and what comes back: one scored batch.

`reward_inputs` lays a Rollout out in TRL's reward-function layout (prompts,
completions in the prompt's style, the dataset's other columns, completion
ids), group-major. `ScoredBatch` is a round's rows, rollout, reward inputs
and scores together: what the trainer's step and dynamic sampling pass on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..rollout import Rollout
from .runner import RewardScores


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


@dataclass
class ScoredBatch:
    """One generation round: prompts, their rollout, reward inputs and scores (group-major)."""

    rows: list[dict[str, Any]]
    rollout: Rollout
    inputs: RewardInputs
    scores: RewardScores
    metrics: dict[str, float] = field(default_factory=dict)  # reward-runner metrics of this round

    @property
    def num_groups(self) -> int:
        return len(self.rows)
