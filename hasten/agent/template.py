"""The chat template a tool-using run renders with: tool schemas in, tool turns out.

The default model (SmolLM2) speaks ChatML but its template has no tool
format, so hasten ships one: HERMES_TEMPLATE, the Hermes/Qwen2.5 convention
on ChatML. Tools are listed as JSON schemas inside <tools></tools> in the
system turn; the assistant calls them as `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`; results come back in a user turn as
`<tool_response>...</tool_response>`. generation.tool_template picks it:

    auto    the tokenizer's own template when it renders tools, else HERMES_TEMPLATE
            for a ChatML tokenizer (<|im_start|>), else a one-line error. An own template
            that is not prefix-preserving (Qwen3's drops earlier turns' <think> blocks, so a
            tool turn changes what came before) is swapped, as TRL 1.16 swaps it, for TRL's
            training version where hasten bundles one (templates/: TRL's
            qwen3_training.jinja, Apache-2.0), said in one line; else tool turns are an error
    hermes  HERMES_TEMPLATE
    a path  a .jinja file (transformers' template variables: messages, tools,
            add_generation_prompt, the special tokens)

Templates render in models/tokenizer.py's sandboxed jinja environment (compile_template) (the
one transformers uses), so HF and native tokenizers get the same text, and
the text is then tokenized without special tokens added, as encode_prompt does.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError
from ..models.tokenizer import compile_template

HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'user' or (message['role'] == 'assistant' and not message.get('tool_calls')) %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call.get('function') else call %}
{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}
{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# sha256 of a model family's own chat template -> TRL 1.16's prefix-preserving training version, bundled
TRAINING_TEMPLATES = {
    "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8": "qwen3_training.jinja",  # Qwen3's own
}

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


class ToolTemplate:
    """A tool-capable chat template bound to a tokenizer: prompts with tools, and tool turns as token ids."""

    def __init__(self, tokenizer, template: str, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.kwargs = dict(template_kwargs or {})
        self.eos_text = getattr(tokenizer, "eos_token", None)

    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        special = {name: getattr(self.tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token")}
        special = {name: value for name, value in special.items() if isinstance(value, str)}
        return compile_template(self.template).render(messages=messages, tools=tools or None, documents=None,
                                                      add_generation_prompt=add_generation_prompt,
                                                      **special, **self.kwargs)

    def encode_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        return self.text_ids(self.render(messages, tools, add_generation_prompt=True))

    def tool_turn_ids(self, results: list[tuple[str, str]]) -> list[int]:
        """The tokens between an assistant turn's end-of-turn token and the next assistant turn's first token.

        As TRL's _get_tool_suffix_ids: rendered after a dummy assistant turn that called the tool, cut at
        that turn's last EOS (the model stops there; the template's newline after it is part of the suffix).
        """
        prefix, full = self._around_tool_turn(results)
        if not full.startswith(prefix):
            raise ConfigError("config error: the tool template renders a conversation whose start changes when a "
                              "tool turn is added; generation.tool_template needs a prefix-preserving template")
        return self.text_ids(full[len(prefix):])

    def preserves_prefix(self) -> bool:
        """Does adding a tool turn leave the text before it unchanged? (TRL's is_chat_template_prefix_preserving)"""
        prefix, full = self._around_tool_turn([("tool", "dummy")])
        return full.startswith(prefix)

    def _around_tool_turn(self, results: list[tuple[str, str]]) -> tuple[str, str]:
        """(a dummy assistant turn that called the tool, cut at its last EOS; the same with the results after it)."""
        name = results[0][0] if results else "tool"
        before = [{"role": "user", "content": "dummy"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {}}}]}]
        tool_messages = [{"role": "tool", "name": tool, "content": content} for tool, content in results]
        prefix = self.render(before, None, add_generation_prompt=False)
        full = self.render(before + tool_messages, None, add_generation_prompt=True)
        if self.eos_text and self.eos_text in prefix:
            prefix = prefix[:prefix.rindex(self.eos_text) + len(self.eos_text)]
        return prefix, full

    def text_ids(self, text: str) -> list[int]:
        """Text as ids, no special tokens added (as encode_prompt tokenizes a rendered prompt)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def renders_tools(tokenizer, template: str | None) -> bool:
    """Does `template` show the model a tool's schema and a tool's result? (TRL's supports_tool_calling, in text.)"""
    if not template:
        return False
    conversation = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "probe_tool", "arguments": {}}}]},
                    {"role": "tool", "name": "probe_tool", "content": "probe-result-7"}]
    try:
        text = ToolTemplate(tokenizer, template).render(conversation, [_PROBE_TOOL], add_generation_prompt=True)
    except Exception:  # a template that raises on tool messages does not support them
        return False
    return "probe-result-7" in text and text.count("probe_tool") >= 2


def resolve_template(tokenizer, choice: str, template_kwargs: dict | None = None,
                     log: Callable[[str], None] = print) -> ToolTemplate:
    """generation.tool_template -> the ToolTemplate a tool-using run renders with (see the module docstring)."""
    if choice == "hermes":
        return ToolTemplate(tokenizer, HERMES_TEMPLATE, template_kwargs)
    if choice != "auto":
        path = Path(choice)
        if not path.is_file():
            raise ConfigError(f"config error: generation.tool_template: '{choice}' is not auto, hermes or a file")
        template = path.read_text()
        if not renders_tools(tokenizer, template):
            raise ConfigError(f"config error: generation.tool_template: {choice} does not render tools and tool "
                              "results (it needs `tools` and messages with role 'tool')")
        return ToolTemplate(tokenizer, template, template_kwargs)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, str) and renders_tools(tokenizer, own):
        template = ToolTemplate(tokenizer, own, template_kwargs)
        training = TRAINING_TEMPLATES.get(hashlib.sha256(own.encode()).hexdigest())
        if training is not None and not template.preserves_prefix():
            log(f"generation.tool_template=auto: the model's chat template changes earlier turns when a tool turn "
                f"is added; tool turns render with TRL's {training} (hasten/agent/templates/), as TRL does")
            return ToolTemplate(tokenizer, (Path(__file__).parent / "templates" / training).read_text(),
                                template_kwargs)
        return template
    if isinstance(own, str) and "<|im_start|>" in own:
        return ToolTemplate(tokenizer, HERMES_TEMPLATE, template_kwargs)
    raise ConfigError("config error: the model's chat template has no tool format and is not ChatML; set "
                      "generation.tool_template to a .jinja file that renders tools (docs/agentic.md)")


def tool_call_message(content: str, calls: list[Any]) -> dict:
    """An assistant message in TRL's layout for the reward functions' `completions`."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in calls]
    return message

