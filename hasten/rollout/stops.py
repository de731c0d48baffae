"""Stop strings (generation.stop_strings, TRL's generation_kwargs["stop_strings"]).

A completion ends right after the first token at which its text contains one
of the stop strings; the stop string itself is kept, as transformers'
StopStringCriteria keeps it. The engines work on token ids only and know no
text (STYLE.md 9), so the cut is made here, on the finished rollout, before
rewards see it: the tokens up to the cut were sampled exactly as they would
have been with an early stop, and the ones after it are dropped (masked,
padded) as if never sampled. What this costs is the wasted decode steps of
rows that ran past their stop string, not any change in what is learned.
"""

from __future__ import annotations

import dataclasses

from .types import Rollout


def stop_length(tokenizer, ids: list[int], stops: list[str]) -> int | None:
    """The fewest leading tokens of `ids` whose text contains a stop string; None if none does."""
    def hit(length: int) -> bool:
        text = tokenizer.decode(ids[:length], skip_special_tokens=True)
        return any(stop in text for stop in stops)

    if not ids or not hit(len(ids)):
        return None
    low, high = 1, len(ids)  # containment only grows with the prefix: binary search the first hit
    while low < high:
        middle = (low + high) // 2
        if hit(middle):
            high = middle
        else:
            low = middle + 1
    return low


def apply_stop_strings(rollout: Rollout, tokenizer, stops: list[str], pad_token_id: int) -> Rollout:
    """The rollout with every completion cut after its first stop string (counted as ended, like EOS)."""
    if not stops:
        return rollout
    ids, mask = rollout.completion_ids.clone(), rollout.completion_mask.clone()  # (N, T)
    logprobs, ended = rollout.sampling_logprobs.clone(), rollout.ended_with_eos.clone()
    for row, tokens in enumerate(rollout.completion_token_lists()):
        length = stop_length(tokenizer, tokens, stops)
        if length is None or length == len(tokens) and bool(ended[row]):
            continue
        ids[row, length:] = pad_token_id
        mask[row, length:] = 0
        logprobs[row, length:] = 0.0
        ended[row] = True
    return dataclasses.replace(rollout, completion_ids=ids, completion_mask=mask, sampling_logprobs=logprobs,
                               ended_with_eos=ended)
