"""guess: a number-guessing game, the multi-turn environment with feedback.

The environment (TRL's environment_factory contract, agent/environments.py)
holds a secret number in [low, high] taken from the row; its one tool,
`guess(number)`, answers "higher", "lower" or "correct". The reward is the
environment's own (get_reward): 1 for finding the number, less the more
guesses it took (0.1 per extra guess, at least 0.2), 0 for not finding it. Binary search needs
ceil(log2(100)) = 7 guesses for 1..100, so generation.max_tool_turns should
be at least 7 (the task's default is 8).

Rows carry their own secret, so reset(**row) depends on the row only and a
resumed run replays the same games (docs/agentic.md on environment state).
"""

from __future__ import annotations

import random
from typing import Any

from hasten.config import TaskConfig
from hasten.tasks.base import Task, Verdict, generate_split

DESCRIPTION = "guess a number in 1..100 from higher/lower replies (an environment with a guess tool)"
LOW, HIGH = 1, 100


class GuessingGame:
    """One game: reset(**row) takes the row's secret; guess() is the tool; get_reward() scores the game."""

    def __init__(self):
        self.secret, self.guesses, self.found = 0, 0, False

    def reset(self, secret: int = 50, **row: Any) -> str | None:
        self.secret, self.guesses, self.found = int(secret), 0, False
        return None  # the question is in the row's prompt already

    def guess(self, number: int) -> str:
        """Guess the secret number; the reply says whether it is higher, lower or correct.

        Args:
            number: Your guess, an integer between 1 and 100.
        """
        if self.found:
            return f"correct: the number is {self.secret} (already found)"
        self.guesses += 1
        if number == self.secret:
            self.found = True
            return f"correct: the number is {self.secret}"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        if not self.found:
            return 0.0
        return max(0.2, 1.0 - 0.1 * (self.guesses - 1))


def question() -> str:
    return (f"I am thinking of a number between {LOW} and {HIGH}. Find it with the guess tool: each reply says "
            "higher, lower or correct. When you have found it, put it inside <answer></answer>.")


def check_found(text: str, row: dict[str, Any]) -> Verdict:
    """Held-out accuracy: the game's reply "correct: the number is N" appears in the conversation."""
    found = f"correct: the number is {int(row['secret'])}" in text
    return Verdict(parsed="correct: the number is" in text or "<answer>" in text, correct=found)


def build_guess(cfg: TaskConfig) -> Task:
    def sample(rng: random.Random) -> dict[str, Any]:
        secret = rng.randint(LOW, HIGH)
        messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        return {"prompt": messages + [{"role": "user", "content": question()}], "secret": secret,
                "question": f"{question()} (secret {secret})"}

    train_rows, eval_rows = generate_split(sample, cfg.num_train, cfg.num_eval, cfg.seed)
    return Task(name="guess", description=DESCRIPTION, train_rows=train_rows, eval_rows=eval_rows,
                reward_functions=[], check=check_found, environment=GuessingGame)
