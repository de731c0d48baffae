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

TRL's packing, as its prepare step leaves the dataset: packing_strategy="bfd" shows best-fit rows of
max_length with a seq_lengths column (hasten still trains every example on its own, the exact loss),
"wrapped" cuts the concatenated rows into max_length blocks, each then one example; eval sets follow
eval_packing (None: packing). dataset_kwargs={"skip_prepare_dataset": True} takes tokenized rows as
they are: no EOS, no truncation, no packing.
"""

from __future__ import annotations

from typing import Any

from ..rft.examples import completion_pair, labelled_example
from .grpo_config import APIError


def prepare(rows: list[dict[str, Any]], tokenizer, eos_id: int, args: Any, log, packing: bool = False,
            name: str = "train_dataset") -> tuple[list, Any]:
    """Rows -> (rft/batches.py Examples, TRL's prepared dataset), through input_ids and labels (-100 where a
    token is context). packing: TRL's packing of this dataset (args.packing, or eval_packing for an eval
    set): "bfd" keeps every example whole (hasten trains each on its own, the exact loss) and the prepared
    dataset is TRL's best-fit rows of max_length with their seq_lengths; "wrapped" concatenates the rows and
    cuts them into max_length blocks, each block one example (pretraining-style: a block starts mid-text).
    dataset_kwargs={"skip_prepare_dataset": True}: the rows already are input_ids (and labels), taken as
    they are: no EOS, no truncation, no packing, and the prepared dataset is the one given (None here)."""
    if packing and args.max_length is None:  # TRL's check, in its words
        raise APIError("SFTConfig: When packing is enabled, `max_length` can't be `None`.")
    skip = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset"))
    pairs = [(_ready if skip else _tokens_and_labels)(row, number, tokenizer, eos_id, args, name)
             for number, row in enumerate(rows, start=1)]
    wrapped = packing and not skip and args.packing_strategy == "wrapped"
    if wrapped:
        pairs = wrap(pairs, args.max_length)
    elif args.max_length is not None and not skip:  # keep_start; TRL's bfd truncates the same way
        pairs = [(tokens[:args.max_length], labels[:args.max_length]) for tokens, labels in pairs]
    examples, kept = [], []
    for tokens, labels in pairs:
        example = labelled_example(tokens, labels)
        if example is not None:
            examples.append(example)
            kept.append((tokens, labels))
    if len(kept) < len(pairs):
        log(f"SFTTrainer: {len(pairs) - len(kept)} examples left no target token within "
            f"max_length={args.max_length}; dropped")
    if not examples:
        raise APIError("SFTTrainer: no example has a target token")
    if skip:
        return examples, None
    return examples, prepared(best_fit_rows(kept, args.max_length) if packing and not wrapped
                              else [{"input_ids": tokens, "labels": labels} for tokens, labels in kept])


def _tokens_and_labels(row: dict[str, Any], number: int, tokenizer, eos_id: int, args: Any, name: str
                       ) -> tuple[list[int], list[int]]:
    """One row's input_ids and labels, by the first of its shapes that applies (the module docstring)."""
    row = _chatml(row)
    conversation = row.get("messages") if "messages" in row else (
        [*row["prompt"], *row["completion"]] if isinstance(row.get("prompt"), list)
        and isinstance(row.get("completion"), list) else None)
    if args.assistant_only_loss and "input_ids" not in row:
        if conversation is None:
            raise APIError(f"SFTTrainer: {name} row {number}: assistant_only_loss needs conversational "
                           "rows (messages, or prompt + completion message lists)")
        return _assistant_only(tokenizer, conversation, row.get("chat_template_kwargs") or {}, number)
    if "input_ids" in row:  # pretokenized, as TRL takes it: no EOS added
        tokens = list(row["input_ids"])
        return tokens, _given_labels(row, tokens, number)
    if "prompt" in row and "completion" in row:  # completion_only_loss, as `hasten sft` builds its records
        return completion_pair(tokenizer, row["prompt"], row["completion"], eos_id)
    if args.dataset_text_field in row or "messages" in row:
        text = row.get(args.dataset_text_field)
        if text is None:
            # a row's own chat_template_kwargs column, as TRL passes it to the template
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False,
                                                 **(row.get("chat_template_kwargs") or {}))
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
        return tokens, list(tokens)  # language modelling: every token (the first is never predicted)
    raise APIError(f"SFTTrainer: {name} row {number} has none of prompt+completion, "
                   f"'{args.dataset_text_field}' or 'messages' (columns: {', '.join(row)})")


def _ready(row: dict[str, Any], number: int, tokenizer, eos_id: int, args: Any, name: str
           ) -> tuple[list[int], list[int]]:
    """A skip_prepare_dataset row: its input_ids and its labels (all tokens without a labels column). Mask
    columns without labels would silently train on every token, so they are TRL's error instead."""
    if "input_ids" not in row:
        raise APIError(f"SFTTrainer: {name} row {number}: dataset_kwargs={{'skip_prepare_dataset': True}} takes "
                       f"tokenized rows (input_ids, labels); this one has {', '.join(row) or 'no columns'}")
    if row.get("labels") is None and ("completion_mask" in row or "assistant_masks" in row):
        raise APIError(f"SFTTrainer: {name} has mask columns but no 'labels', and "
                       "`skip_prepare_dataset=True` skips label building, so it would train on the full sequence. "
                       "Add a 'labels' column (-100 for non-loss tokens) or drop `skip_prepare_dataset`.")
    tokens = list(row["input_ids"])
    return tokens, (_given_labels(row, tokens, number) if row.get("labels") is not None else list(tokens))


MAP_BATCH = 1000  # datasets' map batch size: TRL packs each 1,000 rows on their own


def wrap(pairs: list[tuple[list[int], list[int]]], block: int) -> list[tuple[list[int], list[int]]]:
    """TRL's wrapped packing: each 1,000 rows' tokens (and labels) concatenated, then cut every `block`
    tokens; the last block of each 1,000 may be shorter."""
    blocks = []
    for start in range(0, len(pairs), MAP_BATCH):
        tokens = [token for pair in pairs[start:start + MAP_BATCH] for token in pair[0]]
        labels = [label for pair in pairs[start:start + MAP_BATCH] for label in pair[1]]
        blocks += [(tokens[cut:cut + block], labels[cut:cut + block]) for cut in range(0, len(tokens), block)]
    return blocks


def best_fit_rows(pairs: list[tuple[list[int], list[int]]], capacity: int) -> list[dict[str, list]]:
    """TRL's bfd packing of prepared rows, as trainer.train_dataset shows it: longest first (stable), each into
    the open row with the least room that fits it (the oldest of equals), else a new row; every row's
    seq_lengths lists its examples' lengths. Training does not read these rows: hasten packs examples itself
    with a block mask (rft/batches.py), so each sees only itself either way."""
    rows: list[dict[str, list]] = []
    for start in range(0, len(pairs), MAP_BATCH):
        chunk = [pair for pair in pairs[start:start + MAP_BATCH] if pair[0]]
        bins: list[list[int]] = []
        room: list[int] = []
        since: list[int] = []  # when each row reached its room: TRL takes the oldest of equal rooms
        for step, index in enumerate(sorted(range(len(chunk)), key=lambda i: -len(chunk[i][0]))):
            length = min(len(chunk[index][0]), capacity)
            fits = [slot for slot in range(len(bins)) if length <= room[slot] < capacity]
            if fits:
                slot = min(fits, key=lambda s: (room[s], since[s]))
            else:
                bins.append([])
                room.append(capacity)
                since.append(0)
                slot = len(bins) - 1
            bins[slot].append(index)
            room[slot] -= length
            since[slot] = step
        rows += [{"input_ids": [t for i in members for t in chunk[i][0]],
                  "labels": [label for i in members for label in chunk[i][1]],
                  "seq_lengths": [len(chunk[i][0]) for i in members]} for members in bins]
    return rows


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
            raise APIError(f"SFTTrainer: row {number}: assistant_only_loss cannot find an assistant "
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


def prepared(rows: list[dict[str, list]]) -> Any:
    """TRL's processed dataset: a datasets.Dataset of these rows (a list of dicts without datasets)."""
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
