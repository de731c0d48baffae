"""Held-out evaluation: greedy completions, scored by the task.

Reports accuracy (fraction judged correct), answer rate (fraction with a
parseable answer), with tools the tool-call rate (completions that called a
tool) and calls per completion, the mean total reward under the run's reward functions
and each function's mean over the samples it applied to (rewards/<name>), on the first `num_examples` held-out rows, plus whatever the
task's own `metrics` function adds (chess: format rate, FEN exact match,
mean similarity). Greedy decoding makes the numbers a property of the
weights, not of a sampling seed. The questions go through the engine in
chunks of `batch_size` (eval.batch_size, 16 by default), and the progress
count moves after each chunk.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..rewards import RewardFunction, score_rewards
from ..rollout import Engine, SamplingParams
from ..tasks import Task
from ..ticker import Ticker
from ..rewards.batch import reward_inputs
from ..rollout.prompts import encode_prompt
from ..rollout.stops import apply_stop_strings


def evaluate(
    task: Task,
    engine: Engine,
    tokenizer,
    reward_functions: list[RewardFunction],
    num_examples: int,
    max_new_tokens: int,
    batch_size: int,
    template_kwargs: dict | None = None,
    reward_kwargs: dict | None = None,
    stop_strings: list[str] | None = None,
    agent: Any = None,
    progress: Callable[[int, int], None] | None = None,
    description: str = "evaluating",
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Returns (metrics, samples); samples hold each question and completion.

    template_kwargs: generation.chat_template_kwargs; reward_kwargs: TRL's trainer_state, log_metric,
    log_extra; stop_strings: generation.stop_strings, cut as in training; agent: the run's tool loop
    (agent/loop.py), which then generates each completion, tool calls and all; progress: called
    with (questions done, questions in all) after each batch; without it, a ticker (ticker.py) named
    `description` shows that count on stderr in the process's progress mode, so no caller's eval
    (hasten eval, rft test, the API's, the bench's scorer) sits silent.
    """
    if progress is None:
        with Ticker(description, total=min(num_examples, len(task.eval_rows)), unit="question") as tick:
            return evaluate(task, engine, tokenizer, reward_functions, num_examples, max_new_tokens, batch_size,
                            template_kwargs, reward_kwargs, stop_strings, agent, tick.set)
    rows = task.eval_rows[:num_examples]
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    parsed = correct = judged = 0
    reward_total = 0.0
    samples = []
    texts: list[str] = []  # every completion, for the task's own metrics
    tool_calls = [0, 0]  # with an agent: tool calls in all, completions with at least one
    per_function: dict[str, list] = {}  # reward name -> [sum of its scores, samples it applied to]
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        if agent is not None:
            inputs = agent.generate(engine, batch, 1, greedy, seed=0).inputs
            calls = [tool_calls_in(messages) for messages in inputs.completions]
            tool_calls = [tool_calls[0] + sum(calls), tool_calls[1] + sum(count > 0 for count in calls)]
        else:
            prompts = [encode_prompt(tokenizer, r["prompt"], **(template_kwargs or {})) for r in batch]
            rollout = apply_stop_strings(engine.generate(prompts, 1, greedy, seed=0), tokenizer, stop_strings or [],
                                         tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
            inputs = reward_inputs(tokenizer, batch, rollout)
        if reward_functions:
            scores = score_rewards(
                reward_functions, inputs.prompts, inputs.completions, inputs.columns, inputs.completion_ids,
                reward_kwargs,
            )
            reward_total += float(torch.nan_to_num(scores.total).sum())
            for column, name in enumerate(scores.names):
                values = scores.per_function[:, column]  # (N,) NaN where the function did not apply
                applied = ~torch.isnan(values)
                sums, counts = per_function.setdefault(name, [0.0, 0])
                per_function[name] = [sums + float(values[applied].sum()), counts + int(applied.sum())]
        texts += inputs.texts
        for row, text in zip(batch, inputs.texts):
            verdict = task.check(text, row)
            if verdict is not None:
                judged += 1
                parsed += verdict.parsed
                correct += verdict.correct
            samples.append({"question": row.get("question", row["prompt"]), "completion": text,
                            "correct": None if verdict is None else verdict.correct})
        if progress is not None:
            progress(len(samples), len(rows))
    metrics: dict[str, float] = {"num_examples": len(rows)}
    if judged:
        metrics["accuracy"] = correct / judged
        metrics["answer_rate"] = parsed / judged
    if agent is not None and rows:
        metrics["tools/call_rate"] = tool_calls[1] / len(rows)  # completions that called a tool
        metrics["tools/call_frequency"] = tool_calls[0] / len(rows)  # calls per completion, as in training
    if reward_functions and rows:
        metrics["reward_mean"] = reward_total / len(rows)
        metrics.update({f"rewards/{name}": total / count for name, (total, count) in per_function.items() if count})
    if task.metrics is not None:
        metrics.update(task.metrics(texts, rows))
    if task.evaluate_more is not None:
        metrics.update(task.evaluate_more(engine, tokenizer, rows, samples, max_new_tokens, batch_size))
    return metrics, samples


def tool_calls_in(messages: list[dict[str, Any]]) -> int:
    """Tool calls (well-formed or not) in one completion's messages (TRL's layout, agent/loop.py)."""
    return sum(len(message.get("tool_calls") or []) for message in messages if message["role"] == "assistant")
