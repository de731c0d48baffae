"""Reward functions: TRL-compatible loading and scoring, and the built-in rewards.

`score_rewards` is the one entry point the trainer needs; `load_reward` turns a
"path/to/file.py:function" spec from the config into a `RewardFunction`.
"""

from hasten.rewards.builtin import (
    completion_text,
    correctness_reward,
    extract_answer,
    format_reward,
    parse_number,
)
from hasten.rewards.runner import RewardError, RewardFunction, RewardScores, load_reward, score_rewards

__all__ = [
    "RewardError",
    "RewardFunction",
    "RewardScores",
    "completion_text",
    "correctness_reward",
    "extract_answer",
    "format_reward",
    "load_reward",
    "parse_number",
    "score_rewards",
]
