"""B7's two sides on one tool setup, and each side's record of the setup it actually used (bench/b7.py).

TRL's GRPOTrainer(tools=...) renders prompts with its tokenizer's chat template and reads tool calls with
the tokenizer's response template (transformers' parse_response). SmolLM2's own template has no tool
format, and TRL knows neither it nor hasten's HERMES_TEMPLATE, so the TRL process is handed:
- the exact template text hasten's run renders with (agent/template.py resolve_template, which
  generation.tool_template: auto resolves), set as its tokenizer's chat_template;
- when that text is HERMES_TEMPLATE, the response template TRL ships for Qwen2.5/Qwen3, the same
  `<tool_call>{json}</tool_call>` convention (trl.chat_template_utils.qwen3_template); any other template
  is left to TRL's own add_response_schema, as a TRL user's run would be;
- the same tool functions, imported by name (hasten's calculator), and max_tool_calling_iterations =
  generation.max_tool_turns.

Each side then writes down what its run used (AgentRecord): the template text, the tools' schemas as the
template shows them, the turn cap, the token ids of step 1's first prompt (hasten: what its tool loop
encoded; TRL: what its first generate() call received), the tool turn each side appends for one probe
result (hasten's ToolTemplate.tool_turn_ids, TRL's own _get_tool_suffix_ids) and how each side reads one
probe call (hasten's parse_tool_calls, TRL's parse_response). `differences` compares two records.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

PROBE_RESULT = "1998"  # the probe tool result both sides wrap in their tool turn


@dataclass
class AgentRecord:
    template: str  # the chat template text prompts and tool turns were rendered with
    tools: list[dict]  # the tools' JSON schemas, as the template receives them
    max_tool_turns: int  # tool rounds after the first turn
    first_prompt_ids: list[int] | None  # step 1's first prompt as the model saw it (None: nothing generated)
    tool_turn_ids: list[int]  # the tokens appended for the probe result
    parsed_calls: list[list[Any]]  # [name, arguments] of each call read from the probe call's text

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def differences(one: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The AgentRecord fields on which two records (as dicts) differ; [] when both sides used one setup."""
    return [field.name for field in dataclasses.fields(AgentRecord)
            if json.dumps(one.get(field.name), sort_keys=True) != json.dumps(other.get(field.name), sort_keys=True)]


def probe_call(schemas: list[dict]) -> tuple[str, dict[str, str], str]:
    """A well-formed call of the first tool (its first argument set to "2 * 3"): name, arguments, text."""
    function = schemas[0]["function"]
    names = list(function.get("parameters", {}).get("properties", {}))
    arguments = {names[0]: "2 * 3"} if names else {}
    text = "<tool_call>\n" + json.dumps({"name": function["name"], "arguments": arguments}) + "\n</tool_call>"
    return function["name"], arguments, text


# ------------------------------------------------------------------ hasten's side


class HastenAgentWatch:
    """Notes the first prompt hasten's tool loop encodes (session.agent's template, wrapped in place)."""

    def __init__(self, session):
        self.session = session
        self.first_prompt: list[int] | None = None
        template = session.agent.template
        encode = template.encode_prompt

        def encode_prompt(messages, tools):
            ids = encode(messages, tools)
            if self.first_prompt is None:
                self.first_prompt = list(ids)
            return ids

        template.encode_prompt = encode_prompt

    def record(self) -> AgentRecord:
        from ..agent import parse_tool_calls

        agent = self.session.agent
        schemas = [tool.schema for tool in agent.tools.values()]
        name, _, text = probe_call(schemas)
        return AgentRecord(agent.template.template, schemas, agent.settings.max_turns, self.first_prompt,
                           agent.template.tool_turn_ids([(name, PROBE_RESULT)]),
                           [[call.name, call.arguments] for call in parse_tool_calls(text)])


# ------------------------------------------------------------------ TRL's side


def trl_tool_arguments(spec: dict[str, Any]) -> dict[str, Any]:
    """GRPOTrainer's tools= and processing_class= for spec["agent"] (the template text, "module:function" tools):
    the tokenizer TRL would load itself (left padding and truncation), with hasten's template."""
    from transformers import AutoTokenizer

    from ..agent import HERMES_TEMPLATE
    from .peers import imported

    agent = spec["agent"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], truncation_side="left", padding_side="left")
    tokenizer.chat_template = agent["template"]
    parser = getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None)
    if parser is None and agent["template"] == HERMES_TEMPLATE:
        from trl.chat_template_utils import qwen3_template

        tokenizer.response_template = copy.deepcopy(qwen3_template)
    return {"processing_class": tokenizer, "tools": [imported(target) for target in agent["tools"]]}


class TrlAgentWatch:
    """Notes the first prompt TRL's model generates from (its generate(), wrapped in place) and the
    tool metrics TRL logged since the last step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.first_prompt: list[int] | None = None
        generate = trainer.model.generate

        def watched(*args, **kwargs):
            if self.first_prompt is None:
                ids = kwargs.get("input_ids", args[0] if args else None)  # (B, P) left-padded
                mask = kwargs.get("attention_mask")
                row = ids[0] if mask is None else ids[0][mask[0].bool()]
                self.first_prompt = row.tolist()
            return generate(*args, **kwargs)

        trainer.model.generate = watched
        self.seen = 0

    def step_metrics(self) -> dict[str, float]:
        """The mean of tools/call_frequency and tools/failure_frequency over the generation batches of the
        step just done (TRL appends one value per batch to its metrics; logging is off, so nothing clears them)."""
        metrics = self.trainer._metrics["train"]
        calls = metrics.get("tools/call_frequency", [])
        fresh, self.seen = calls[self.seen:], len(calls)
        if not fresh:
            return {}
        failures = metrics.get("tools/failure_frequency", [])[-len(fresh):]
        return {"tools/call_frequency": sum(fresh) / len(fresh),
                "tools/failure_frequency": sum(failures) / len(failures) if failures else 0.0}

    def record(self) -> AgentRecord:
        from transformers.utils import get_json_schema
        from trl.chat_template_utils import parse_response

        trainer = self.trainer
        tokenizer = trainer.processing_class
        schemas = [get_json_schema(tool) for tool in trainer.tools]  # what apply_chat_template renders
        name, _, text = probe_call(schemas)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        parsed = parse_response(tokenizer, ids, prefix=self.first_prompt, tools=trainer.tools)
        calls = [[call["function"]["name"], call["function"]["arguments"]] for call in parsed.get("tool_calls") or []]
        suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": name, "content": PROBE_RESULT}])
        return AgentRecord(trainer.chat_template or tokenizer.chat_template, schemas,
                           trainer.max_tool_calling_iterations, self.first_prompt, list(suffix), calls)
