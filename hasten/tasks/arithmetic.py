"""Two-digit addition: the smallest task on which GRPO visibly learns.

Questions read exactly "What is a + b? Put the final number inside
<answer></answer>." with a and b in 10..99. That wording is a benchmark
workload shared with other trainers, so it must not drift. There is no system
prompt unless task.system_prompt sets one: the question already states the
format. With task.worked_example (the default) one solved question comes
first as a prior chat turn; without it the base SmolLM2-135M never uses the
answer tags (0/32 greedy) and GRPO has no signal to start from.

Answers are integers, so the rows carry tolerance 0 (exact match) instead of
the 5% that suits unit conversion; 5% of 150 would accept 143.
"""

from __future__ import annotations

import random
from typing import Any

from hasten.config import TaskConfig
from hasten.rewards.builtin import correctness_reward, format_reward
from hasten.rewards.runner import RewardFunction
from hasten.tasks import DESCRIPTIONS
from hasten.tasks.base import Task, chat_prompt, check_numeric_answer, generate_split

DESCRIPTION = DESCRIPTIONS["arithmetic"]  # one text, in the registry (listed without importing this)
SMALLEST, LARGEST = 10, 99
WORKED_EXAMPLE = ("What is 23 + 58? Put the final number inside <answer></answer>.",
                  "23 + 58 = 81.\n<answer>81</answer>")


def question_for(a: int, b: int) -> str:
    return f"What is {a} + {b}? Put the final number inside <answer></answer>."


def build_arithmetic(cfg: TaskConfig) -> Task:
    def sample(rng: random.Random) -> dict[str, Any]:
        a, b = rng.randint(SMALLEST, LARGEST), rng.randint(SMALLEST, LARGEST)
        question = question_for(a, b)
        return {
            "prompt": chat_prompt(question, cfg.system_prompt, (WORKED_EXAMPLE,) if cfg.worked_example else ()),
            "answer": float(a + b),
            "question": question,
            "tolerance": 0.0,
        }

    train_rows, eval_rows = generate_split(sample, cfg.num_train, cfg.num_eval, cfg.seed,
                                           exclude=[WORKED_EXAMPLE[0]])
    return Task(
        name="arithmetic",
        description=DESCRIPTION,
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_functions=[
            RewardFunction("format", format_reward, weight=0.25),
            RewardFunction("correct", correctness_reward, weight=1.0),
        ],
        check=check_numeric_answer,
    )
