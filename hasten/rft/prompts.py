"""From an RFT question to the prompt the model sees, and loading a model for generation.

RFT records hold bare questions; the model must see them in the same prompt
format at training and test time, or SFT teaches one format and the test
asks in another. `prompt_for` therefore takes the format from the task:
a question that is one of the task's rows gets that row's prompt exactly;
any other question (a teacher's file, a hand-written record) gets a task
row's prompt with the question put in place of that row's question (the last
user message of a chat prompt, or the question text inside a string prompt).
So `task.worked_example` and `task.system_prompt` apply to SFT as they do to
evaluation.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from ..tasks import Task, TaskError


def question_of(row: dict[str, Any]) -> str:
    """A row's question: its "question" column, else its prompt text (last user message)."""
    if isinstance(row.get("question"), str):
        return row["question"]
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return prompt
    users = [message["content"] for message in prompt if message.get("role") == "user"]
    if not users:
        raise TaskError("rft error: a task row has neither a question column nor a user message")
    return users[-1]


class PromptFormat:
    """question -> prompt (a string or chat messages) in the task's own format."""

    def __init__(self, task: Task):
        rows = task.train_rows + task.eval_rows
        if not rows:
            raise TaskError(f"rft error: task '{task.name}' has no rows to take a prompt format from")
        self.known = {question_of(row): row["prompt"] for row in rows}
        self.template = rows[0]

    def __call__(self, question: str) -> str | list[dict[str, str]]:
        if question in self.known:
            return self.known[question]
        prompt, asked = self.template["prompt"], question_of(self.template)
        if isinstance(prompt, str):
            if asked not in prompt:
                raise TaskError("rft error: cannot place new questions in this task's string prompts")
            return prompt.replace(asked, question)
        messages = copy.deepcopy(prompt)
        last_user = max(i for i, message in enumerate(messages) if message.get("role") == "user")
        messages[last_user]["content"] = question
        return messages


def load_generator(cfg, log: Callable[[str], None]):
    """(policy, engine) for sampling only: LoRA adapters are merged so the lean engine can run them.

    Merging adds the adapter product into the base weights once (a few ms per
    layer); generation then costs what the base model costs, where the peft
    wrapper would force the slower transformers-forward engine.
    """
    import dataclasses

    from ..device import configure_device, resolve_device
    from ..models import load_policy
    from ..kernels.runtime import configure_threads, keep_freed_memory
    from ..rollout.factory import make_engine

    configure_threads(cfg.train.num_threads)
    if cfg.speed.keep_freed_memory:
        keep_freed_memory()
    device = resolve_device(cfg.model.device)
    configure_device(device)
    policy = load_policy(dataclasses.replace(cfg.model, lora=False), log)
    policy.model.to(device)
    if hasattr(policy.model, "merge_and_unload"):
        policy.model = policy.model.merge_and_unload()
        log("LoRA adapters merged into the base weights for generation")
    if cfg.generation.precision == "auto":  # bf16 sampling is measured with GRPO's importance correction only
        cfg.generation.precision = "fp32"
    return policy, make_engine(cfg, policy, log)
