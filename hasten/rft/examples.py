"""SFT examples, built one way for `hasten sft` and for the TRL-style SFTTrainer.

Every SFT example passes through (input_ids, labels): the token ids and,
per token, the token itself where it is a target or -100 where it is
context (transformers' convention, and TRL's prepared rows). `labelled_example`
is the one place those become an rft/batches.py Example, which the SFT loop
(rft/sft.py) trains on and the eval loss (batches.eval_loss) scores. A
prompt + completion pair (an RFT record's question and reasoning, or a TRL
prompt-completion row) is encoded by `completion_pair` alone, so the CLI
and the API cannot drift apart on what a prompt is or where EOS goes
(tests/test_sft_core.py trains both on the same data).
"""

from __future__ import annotations

from typing import Any

from ..rollout.prompts import encode_prompt
from .batches import IGNORE, Example


def completion_pair(tokenizer, prompt: str | list[dict], completion: str | list[dict], eos_id: int,
                    ) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a prompt and its completion: the prompt as the engine encodes it (a chat
    prompt through the chat template with the generation prompt), the completion's text (a message list
    contributes its contents, as TRL's) then EOS as the only targets (TRL's completion_only_loss)."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    text = completion if isinstance(completion, str) else "".join(message["content"] for message in completion)
    target = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
    return prompt_ids + target, [IGNORE] * len(prompt_ids) + target


def labelled_example(tokens: list[int], labels: list[int]) -> Example | None:
    """(input_ids, labels) as an Example: the context up to the first target (at least the first token, which
    nothing predicts), then the rest with a target_mask where context tokens follow; None without a target."""
    targets = [index for index, label in enumerate(labels) if label != IGNORE and index > 0]
    if not targets:
        return None
    first = targets[0]
    mask = tuple(int(label != IGNORE) for label in labels[first:])
    return Example(tokens[:first], tokens[first:], None if all(mask) else mask)


def record_examples(records: list[Any], prompt_format, tokenizer, eos_id: int) -> list[Example]:
    """`hasten sft`'s examples: each RFT record's question in the task's prompt format, its reasoning + EOS
    the targets (a record always has one: EOS)."""
    return [labelled_example(*completion_pair(tokenizer, prompt_format(record.question), record.reasoning, eos_id))
            for record in records]
