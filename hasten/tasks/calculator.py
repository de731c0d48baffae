"""calculator: 3-4 digit products the model cannot do in its head, with a calculator tool.

Questions read "What is 347 x 5821? Use the calculator tool, then put the
final number inside <answer></answer>." (a in 100..999, b in 1000..9999).
SmolLM2-135M gets these right ~never unaided, so accuracy measures whether
the model learned to call the tool and copy its result: that is the point of
the task (docs/agentic.md). The tool is agent/builtin_tools.py's
`calculator`, shown to the model through the tool template (HERMES_TEMPLATE
for the default model).

With task.worked_example (the default) the prompt opens with one solved
question as a whole tool conversation (assistant tool call, tool result,
assistant answer), so the base model sees the format once; without it, it
has to discover the tool from the schema alone.

The base model still never calls the tool (docs/agentic.md), so the task
also gives `demonstrate(row)`: that same solved conversation for any row,
the tool's result computed by the real tool. `hasten sft --sft.source=task`
fine-tunes on these for the training rows (configs/agent-sft.yaml), the warm
start GRPO then improves on.
"""

from __future__ import annotations

import random
import re
from typing import Any

from hasten.agent.builtin_tools import calculator
from hasten.config import TaskConfig
from hasten.rewards.builtin import correctness_reward, format_reward
from hasten.rewards.runner import RewardFunction
from hasten.tasks.base import Task, check_numeric_answer, generate_split

DESCRIPTION = "3-4 digit products ('What is 347 x 5821?') with a calculator tool (multi-turn)"
SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool for arithmetic."


def question_for(a: int, b: int) -> str:
    return f"What is {a} x {b}? Use the calculator tool, then put the final number inside <answer></answer>."


QUESTION = re.compile(r"What is (\d+) x (\d+)\?")


def solution(a: int, b: int) -> list[dict[str, Any]]:
    """The assistant's side of a solved question: call the tool, read its (real) result, answer with it."""
    expression = f"{a} * {b}"
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    result = calculator(expression)
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": result},
            {"role": "assistant", "content": f"{a} x {b} = {result}.\n<answer>{result}</answer>"}]


def worked_example() -> list[dict[str, Any]]:
    """One solved question, as the tool conversation the model should reproduce."""
    return [{"role": "user", "content": question_for(218, 4073)}, *solution(218, 4073)]


def demonstrate(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's correct tool conversation (Task.demonstrate): the completion SFT trains on."""
    found = QUESTION.match(row["question"])
    if found is None:
        raise ValueError(f"not a calculator question: {row['question']!r:.80}")
    return solution(int(found.group(1)), int(found.group(2)))


def build_calculator(cfg: TaskConfig) -> Task:
    system = cfg.system_prompt if cfg.system_prompt is not None else SYSTEM_PROMPT
    example = worked_example() if cfg.worked_example else []

    def sample(rng: random.Random) -> dict[str, Any]:
        a, b = rng.randint(100, 999), rng.randint(1000, 9999)
        question = question_for(a, b)
        prompt = [{"role": "system", "content": system}, *example, {"role": "user", "content": question}]
        return {"prompt": prompt, "answer": float(a * b), "question": question, "tolerance": 0.0}

    train_rows, eval_rows = generate_split(sample, cfg.num_train, cfg.num_eval, cfg.seed,
                                           exclude=[question_for(218, 4073)])
    return Task(
        name="calculator",
        description=DESCRIPTION,
        train_rows=train_rows,
        eval_rows=eval_rows,
        reward_functions=[
            RewardFunction("format", format_reward, weight=0.25),
            RewardFunction("correct", correctness_reward, weight=1.0),
        ],
        check=check_numeric_answer,
        tools=[calculator],
        demonstrate=demonstrate,
    )
