"""Prompt text -> token ids, as the engines consume them.

Rows follow TRL's dataset conventions: "prompt" is either a string
(standard) or a list of chat messages (conversational). Conversational
prompts go through the tokenizer's chat template with the generation prompt
appended (and any generation.chat_template_kwargs, e.g. enable_thinking=False,
as template variables); standard ones are tokenized as they are.
"""

from __future__ import annotations


def encode_prompt(tokenizer, prompt: str | list[dict], **template_kwargs) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
