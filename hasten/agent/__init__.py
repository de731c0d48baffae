"""Agentic GRPO: tools, environments and the multi-turn loop (docs/agentic.md).

`make_agent` gathers a run's tools (the task's, generation.tools' files, the
Python API's), its environment factory (the task's, task.environment's file,
the API's environment_factory) and the tool template, checks them all before
anything is written, and returns the Agent that train/trainer.py's
generate_and_score calls instead of one engine.generate, plus the reward
functions environments bring (get_reward). No tools and no environment: None,
and the run is the plain single-turn one, untouched. With
generation.tool_isolation=process it also forks the fork server its user
tools' calls will be forked from (agent/forkserver.py), here, before the
model loads, while the trainer is small; the Agent closes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import Config, ConfigError
from ..rewards.runner import RewardFunction
from .environments import Environments, load_environment
from .forkserver import ForkServer, start_fork_server
from .loop import Agent, AgentBatch, AgentSettings
from .template import HERMES_TEMPLATE, resolve_template
from .tools import Tool, ToolError, load_tool, make_tool, parse_tool_calls, unique_tools

__all__ = ["Agent", "AgentBatch", "AgentSettings", "Environments", "HERMES_TEMPLATE", "Tool", "ToolError",
           "AgentParts", "make_agent", "make_tool", "parse_tool_calls"]


@dataclass
class AgentParts:
    """A run's tools and environments, checked; `build(tokenizer, pad_token_id)` adds the template."""

    cfg: Config
    tools: list[Tool]
    environments: Environments | None
    fork_server: ForkServer | None = None  # tool_isolation=process: started here, before the model loads

    @property
    def reward_functions(self) -> list[RewardFunction]:
        """What the environments bring: one get_reward function per class that has one."""
        return self.environments.reward_functions() if self.environments is not None else []

    def build(self, tokenizer, pad_token_id: int, log: Callable[[str], None] = print) -> Agent:
        generation = self.cfg.generation
        template = resolve_template(tokenizer, generation.tool_template, generation.chat_template_kwargs, log)
        settings = AgentSettings(generation.max_tool_turns, generation.tool_timeout, tuple(generation.stop_strings),
                                 generation.tool_kv_cache, generation.tool_isolation)
        return Agent(tokenizer, template, self.tools, self.environments, settings, pad_token_id, self.fork_server)


def make_agent(cfg: Config, task: Any, tools: list[Callable] | None = None,
               environment: Any = None) -> AgentParts | None:
    """The run's tools and environments, checked (None: neither, a single-turn run)."""
    callables = list(getattr(task, "tools", None) or []) + list(tools or [])
    resolved = [make_tool(fn) for fn in callables] + [load_tool(spec) for spec in cfg.generation.tools]
    factory = environment if environment is not None else getattr(task, "environment", None)
    if factory is None and cfg.task.environment:
        factory = load_environment(cfg.task.environment)
    if not resolved and factory is None:
        return None
    environments = Environments(factory) if factory is not None else None
    _check_unique(resolved, environments)
    for name, rows in (("train", task.train_rows), ("eval", task.eval_rows)):
        # A task's or task.environment's rows are checked before the model loads; the Python API's
        # environment_factory meets an unknown name at batch time, as TRL (its trainer constructs, train raises)
        if environments is not None and environment is None:
            environments.check_rows(rows, f"task {task.name} {name}")
        for index, row in enumerate(rows):
            if not isinstance(row.get("prompt"), list):
                raise ConfigError(f"config error: tools and environments need chat prompts (a list of messages); "
                                  f"task {task.name} {name} row {index} has a {type(row.get('prompt')).__name__}")
    if cfg.algo.dynamic_sampling or cfg.algo.async_steps:
        raise ConfigError("config error: tools and environments do not run with algo.dynamic_sampling or "
                          "algo.async_steps yet; turn those off")
    choice = cfg.generation.tool_template  # a missing template file: one line now, before the model loads
    if choice not in ("auto", "hermes") and not Path(choice).is_file():
        raise ConfigError(f"config error: generation.tool_template: '{choice}' is not auto, hermes or a file")
    isolated = [tool for tool in resolved if not tool.in_trainer]
    server = start_fork_server(isolated) if cfg.generation.tool_isolation == "process" else None
    return AgentParts(cfg, resolved, environments, server)


def _check_unique(tools: list[Tool], environments: Environments | None) -> None:
    """Two tools of one prompt with the same name: a ToolError naming both (else one would shadow the other)."""
    seen = unique_tools(tools)
    for methods in (environments.schemas.values() if environments is not None else ()):
        for name, method in methods.items():  # an environment's methods join the run's tools in its prompts
            if name in seen:
                raise ToolError(f"tool error: two tools are named '{name}': {seen[name].origin} and the "
                                f"environment method {method.origin}; tool names must be unique")
