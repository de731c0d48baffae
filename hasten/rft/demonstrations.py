"""sft.source=task: SFT examples from a task's own correct tool conversations, the agentic warm start.

SmolLM2-135M-Instruct never calls a tool (docs/agentic.md), so GRPO on a
tool task has no successful rollout to reinforce. A task that knows its
answers can write the conversation it wants instead (`Task.demonstrate`:
the calculator task calls its tool and answers with the real result). This
module turns the task's training rows into SFT examples:

    rows       task.train_rows only, minus any whose question is a held-out one (eval never leaks)
    messages   the row's prompt (as GRPO sends it) + task.demonstrate(row)
    ids        agent/demonstrations.py on the run's tool template and tool schemas, exactly the
               tokens the tool loop builds; tool-result tokens are context, not targets

`hasten sft` also writes them to its run directory as demonstrations.jsonl
(TRL's conversational prompt-completion rows), so what was trained on can
be read. The template and the schemas come from the same place as in `hasten train`
(agent.make_agent, generation.tool_template), so the SFT checkpoint has
learned the very prompt and call format GRPO samples from. Keep task.* the
same in both stages (configs/agent-sft.yaml and configs/agent-demo.yaml
agree): the held-out rows are drawn first from task.seed, task.num_eval.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..agent import make_agent
from ..agent.demonstrations import encode_conversation
from ..agent.template import resolve_template
from ..config import Config, ConfigError
from ..tasks import Task
from .batches import Example
from .prompts import question_of


def check_demonstrations(task: Task) -> None:
    """sft.source=task needs a task that writes demonstrations; one line before any model loads."""
    if task.demonstrate is None:
        raise ConfigError(f"config error: sft.source=task needs a task with demonstrations (calculator has "
                          f"them); task {task.name} has none, so train on records (sft.source=records, rft.data)")


def demonstration_rows(task: Task, count: int = 0) -> list[dict[str, Any]]:
    """The first `count` training rows (0: all) whose question is not a held-out one."""
    held_out = {question_of(row) for row in task.eval_rows}
    rows = [row for row in task.train_rows if question_of(row) not in held_out]
    return rows[:count] if count else rows


def demonstrations(task: Task, count: int = 0) -> list[dict[str, Any]]:
    """TRL's conversational prompt-completion rows: {"prompt": messages, "completion": messages}."""
    check_demonstrations(task)
    return [{"prompt": row["prompt"], "completion": task.demonstrate(row)}
            for row in demonstration_rows(task, count)]


def demonstration_examples(cfg: Config, task: Task, tokenizer) -> list[Example]:
    """The task's demonstrations (sft.max_examples of them; 0: every training row) as SFT examples.

    Each assistant turn ends with the tokenizer's EOS, the end-of-turn text the template renders and the
    tool loop parses a turn at (agent/loop.py)."""
    parts = make_agent(cfg, task)
    if parts is None or parts.environments is not None:
        raise ConfigError(f"config error: sft.source=task needs a tool task without an environment; task "
                          f"{task.name} has {'no tools' if parts is None else 'an environment'}")
    template = resolve_template(tokenizer, cfg.generation.tool_template, cfg.generation.chat_template_kwargs)
    schemas = [tool.schema for tool in parts.tools]
    if tokenizer.eos_token_id is None:
        raise ConfigError("config error: sft.source=task needs a tokenizer with an EOS token to end each turn")
    examples = []
    for row in demonstrations(task, cfg.sft.max_examples):
        encoded = encode_conversation(template, row["prompt"], row["completion"], schemas,
                                       tokenizer.eos_token_id)
        examples.append(Example(encoded.prompt_ids, encoded.completion_ids, encoded.target_mask))
    return examples


DEMONSTRATIONS_FILE = "demonstrations.jsonl"


def save_demonstrations(path: Path, task: Task, count: int = 0) -> Path:
    """The rows demonstration_examples trains on, one JSON object a line (the run directory's copy)."""
    lines = [json.dumps(row, ensure_ascii=False) for row in demonstrations(task, count)]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
