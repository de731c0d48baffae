"""SFT rows as TRL prepares them: each row becomes input_ids and labels (-100 where a token is context).

The labels come, in this order, from a "labels" column as given, a pretokenized completion_mask /
assistant_masks column, assistant_only_loss (each assistant message's content and the EOS after it,
found by character offsets in the chat template's text: TRL instead swaps in training templates with
`{% generation %}` marks), the completion of a prompt + completion row (completion_only_loss), or every
token (text, messages, plain input_ids). Rows are cut to max_length first (keep_start) and a row left
without a target is dropped. The result is kept twice: as rft/batches.py Examples, which hasten's SFT
loop trains on, and as TRL's prepared dataset (trainer.train_dataset). A prompt + completion row and
the (input_ids, labels) -> Example step are rft/examples.py's, the same code `hasten sft` builds its
records with; this module only reads TRL's dataset shapes.
"""

from __future__ import annotations

from typing import Any

from ..rft.examples import completion_pair, labelled_example
from .grpo_config import APIError


def to_examples(rows: list[dict[str, Any]], tokenizer, eos_id: int, args: Any, log,
                kept: list | None = None) -> list:
    """Rows -> rft/batches.py Examples, through TRL's prepared form: input_ids and labels (-100 where a
    token is context, not a target). The labels come from a "labels" column as given, a pretokenized
    completion_mask / assistant_masks column (1 = target), the completion of a prompt + completion row,
    or every token (text / messages / plain input_ids); EOS ends every text, as TRL appends it. Sequences
    are cut to max_length (keep_start); one left with no target is dropped, with a log line.
    kept: a list that gets each kept example's (input_ids, labels), TRL's prepared row."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples, dropped = [], 0
    for number, row in enumerate(rows, start=1):
        row = _chatml(row)
        conversation = row.get("messages") if "messages" in row else (
            [*row["prompt"], *row["completion"]] if isinstance(row.get("prompt"), list)
            and isinstance(row.get("completion"), list) else None)
        if args.assistant_only_loss and "input_ids" not in row:
            if conversation is None:
                raise APIError(f"SFTTrainer: train_dataset row {number}: assistant_only_loss needs conversational "
                               "rows (messages, or prompt + completion message lists)")
            tokens, labels = _assistant_only(tokenizer, conversation, row.get("chat_template_kwargs") or {}, number)
        elif "input_ids" in row:  # pretokenized, as TRL takes it: no EOS added
            tokens = list(row["input_ids"])
            labels = _given_labels(row, tokens, number)
        elif "prompt" in row and "completion" in row:  # completion_only_loss, as `hasten sft` builds its records
            tokens, labels = completion_pair(tokenizer, row["prompt"], row["completion"], eos_id)
        elif args.dataset_text_field in row or "messages" in row:
            text = row.get(args.dataset_text_field)
            if text is None:
                # a row's own chat_template_kwargs column, as TRL passes it to the template
                text = tokenizer.apply_chat_template(row["messages"], tokenize=False,
                                                     **(row.get("chat_template_kwargs") or {}))
            tokens = ids(text) + [eos_id]
            labels = list(tokens)  # language modelling: every token (the first is never predicted)
        else:
            raise APIError(f"SFTTrainer: train_dataset row {number} has none of prompt+completion, "
                           f"'{args.dataset_text_field}' or 'messages' (columns: {', '.join(row)})")
        if args.max_length is not None:
            tokens, labels = tokens[:args.max_length], labels[:args.max_length]
        example = labelled_example(tokens, labels)
        if example is None:
            dropped += 1
            continue
        examples.append(example)
        if kept is not None:
            kept.append((tokens, labels))
    if dropped:
        log(f"SFTTrainer: {dropped} examples left no target token within max_length={args.max_length}; dropped")
    if not examples:
        raise APIError("SFTTrainer: no example has a target token")
    return examples


def _assistant_only(tokenizer, messages: list[dict], template_kwargs: dict, number: int
                    ) -> tuple[list[int], list[int]]:
    """TRL's assistant_only_loss without its `{% generation %}` training templates: the targets are each
    assistant message's content as the chat template places it in the whole conversation, and the
    end-of-turn token right after it (EOS), found by character offsets; everything else is context.
    A message whose content the template does not reproduce verbatim is one error."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    tokens, offsets = _with_offsets(tokenizer, text)
    spans, cursor = [], 0
    for message in messages:
        content = message.get("content")
        if message.get("role") != "assistant" or not isinstance(content, str) or not content:
            continue
        start = text.find(content, cursor)
        if start < 0:
            raise APIError(f"SFTTrainer: train_dataset row {number}: assistant_only_loss cannot find an assistant "
                           "message's content in the chat template's text; give assistant_masks instead")
        end = start + len(content)
        if tokenizer.eos_token and text.startswith(tokenizer.eos_token, end):
            end += len(tokenizer.eos_token)  # the turn's end is learned too, as in TRL's templates
        spans.append((start, end))
        cursor = end
    labels = [token if any(first < stop and last > begin for begin, stop in spans) else -100
              for token, (first, last) in zip(tokens, offsets)]
    return tokens, labels


def _with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """The text's ids and each one's character span: the tokenizer's offsets where it has them, else the
    growth of the decoded prefix (hasten's byte tokenizer, whose decode gives the text back)."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(span) for span in encoded["offset_mapping"]]
    except (TypeError, NotImplementedError, ValueError):
        tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ends = [len(tokenizer.decode(tokens[:count + 1])) for count in range(len(tokens))]
        return tokens, list(zip([0, *ends[:-1]], ends))


def _given_labels(row: dict[str, Any], tokens: list[int], number: int) -> list[int]:
    """A pretokenized row's labels: its own "labels", else its completion_mask / assistant_masks, else all."""
    if row.get("labels") is not None:
        labels = list(row["labels"])
        if len(labels) != len(tokens) or any(label not in (-100, token) for label, token in zip(labels, tokens)):
            raise APIError(f"SFTTrainer: train_dataset row {number}: labels must be input_ids with -100 where a "
                           "token is not a target (hasten trains next-token targets only)")
        return labels
    for column in ("completion_mask", "assistant_masks"):
        if row.get(column) is not None:
            mask = list(row[column])
            if len(mask) != len(tokens):
                raise APIError(f"SFTTrainer: train_dataset row {number}: {column} has {len(mask)} entries for "
                               f"{len(tokens)} input_ids")
            return [token if keep else -100 for token, keep in zip(tokens, mask)]
    return list(tokens)


def prepared(kept: list[tuple[list[int], list[int]]]) -> Any:
    """TRL's processed dataset: a datasets.Dataset of input_ids and labels (a list of dicts without datasets)."""
    rows = [{"input_ids": tokens, "labels": labels} for tokens, labels in kept]
    try:
        from datasets import Dataset
    except ImportError:
        return rows
    return Dataset.from_list(rows)


_ROLES = {"human": "user", "gpt": "assistant"}


def _chatml(row: dict[str, Any]) -> dict[str, Any]:
    """A ShareGPT-style row ("conversations" of {"from", "value"}) as a "messages" row, as TRL converts it."""
    if "conversations" not in row or "messages" in row:
        return row
    messages = [{"role": _ROLES.get(m.get("from"), m.get("from")), "content": m.get("value")}
                for m in row["conversations"]]
    return {**{k: v for k, v in row.items() if k != "conversations"}, "messages": messages}
