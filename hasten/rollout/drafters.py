"""Drafters for speculative decoding (speculative.py): who proposes the k tokens the policy verifies.

- `NgramDrafter` (speed.speculative=ngram): prompt lookup. For each row, the
  most recent earlier occurrence of its last n tokens (n = ngram_size down to
  1) in prompt + completion so far; the k tokens that followed it are the
  drafts (extended periodically when fewer than k follow). No match: the last
  token repeated, a cheap guess that is simply rejected more often. Its q is a
  point mass on each draft, so verification accepts with probability p(x).
  No forward at all: it wins where completions copy from the prompt or repeat.
- `ModelDrafter` (speed.speculative=draft): a draft model with the policy's
  tokenizer, run through the lean engine's forward with its own ragged
  cache: k sequential draft steps per verify. Its tokens are sampled from
  q = its processed distribution (same temperature / top-k / top-p / min-p)
  with each position's "draft" uniform. After verification its cache is
  rolled back by length alone: the next round re-feeds the last two committed
  tokens (the second may be the verifier's residual or bonus token, which the
  draft never saw), so its K/V past the accepted run are overwritten.
  `layers:N` is a self-draft: the policy's first N decoder layers, its final
  norm and lm_head, sharing the policy's prepared weights (no copy) and, since
  those layers see the same prompt, the policy's prompt K/V of those layers.

Left out: a self-draft that also shares the policy's own-token K/V (it would
skip the re-feed); tree drafts; a draft for the repetition penalty.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
import torch.nn.functional as F

from .speculative import RaggedCache, Sequences, inverse_cdf, processed_probs
from .types import SamplingParams


class Drafter(Protocol):
    def start(self, engine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
              policy_cache: RaggedCache, capacity: int, sampling: SamplingParams) -> None:
        """A new generate call: the policy's prompts are prefilled into policy_cache."""

    def propose(self, sequences: Sequences, uniforms: torch.Tensor, k: int,
                sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts (live, k), q (live, k, V) or None = a point mass on each draft); uniforms (live, k)."""

    def keep(self, keep: torch.Tensor) -> None:
        """Finished rows left the batch: keep (live_after,) batch indices."""

    def finish(self) -> None:
        """The generate call ended (or raised): drop what it held, so the engine's released weights go."""


class NgramDrafter:
    """Prompt lookup: propose what followed the most recent earlier occurrence of the row's last n tokens."""

    def __init__(self, max_ngram: int):
        if max_ngram < 1:
            raise ValueError(f"ngram_size must be >= 1 (got {max_ngram})")
        self.max_ngram = max_ngram

    def start(self, *args) -> None:
        pass

    def keep(self, keep: torch.Tensor) -> None:
        pass

    def finish(self) -> None:
        pass

    def propose(self, sequences, uniforms, k, sampling):
        context, length = sequences.context, sequences.length  # (N, W) -1 past each row's length; (N,)
        rows, width = context.shape
        device = context.device
        last = context.gather(1, length[:, None] - 1)  # (N, 1)
        drafts = last.expand(rows, k).clone()  # no match anywhere: repeat the last token
        found = torch.zeros(rows, dtype=torch.bool, device=device)
        for n in range(self.max_ngram, 0, -1):  # the longest suffix that occurred before wins
            if width < n + 1:
                continue
            suffix = context.gather(1, (length[:, None] - n + torch.arange(n, device=device)).clamp(min=0))  # (N, n)
            windows = context.unfold(1, n, 1)  # (N, W - n + 1, n)
            starts = torch.arange(windows.shape[1], device=device)
            # an earlier window (one token at least follows it) equal to the suffix; -1 padding never matches
            match = (windows == suffix[:, None, :]).all(dim=-1) & (starts + n < length[:, None])
            best = torch.where(match, starts, -1).max(dim=-1).values  # (N,) the most recent
            use = (best >= 0) & (length > n) & ~found
            follow = best + n  # the first token after the match
            period = (length - follow).clamp(min=1)  # tokens after it so far; repeat them if fewer than k
            index = follow[:, None] + torch.arange(k, device=device) % period[:, None]  # (N, k)
            proposed = context.gather(1, index.clamp(0, width - 1))
            drafts = torch.where(use[:, None], proposed, drafts)
            found |= use
        return drafts, None


class ModelDrafter:
    """A draft model (a LeanEngine over it) or the policy's first `layers` layers; its own ragged cache."""

    def __init__(self, draft_engine=None, layers: int | None = None):
        if (draft_engine is None) == (layers is None):
            raise ValueError("ModelDrafter takes a draft engine or a layer count, one of them")
        self.draft_engine, self.layers = draft_engine, layers
        self.draft = draft_engine
        self.cache: RaggedCache | None = None
        self.rounds = 0

    def start(self, engine, prompt_ids, prompt_mask, num_generations, policy_cache, capacity, sampling):
        device = prompt_mask.device if policy_cache is None else policy_cache.prompt_bias.device
        prompt_mask = prompt_mask.to(device)
        if self.layers is not None:
            if not 1 <= self.layers <= len(engine.layers):
                raise ValueError(f"speculative draft layers:{self.layers}: the policy has {len(engine.layers)} layers")
            self.draft = copy.copy(engine)  # shares everything: the prepared matrices, norm, lm_head
            self.draft.layers = engine.layers[: self.layers]  # synced by the policy engine this generate
        else:
            self.draft.sync_weights()
        self.cache = RaggedCache(self.draft, prompt_mask, num_generations, capacity)
        self.cos, self.signed_sin = self.draft._rope_table(prompt_mask.shape[1] + capacity + 1, device)
        if self.layers is not None:  # the same first layers on the same prompt: the policy's K/V are the draft's
            self.cache.prompt = policy_cache.prompt[: self.layers]
        else:
            positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
            embedding = self.draft.base.model.embed_tokens.weight
            self.draft._layers(F.embedding(prompt_ids.to(device), embedding), self.cos[positions][:, None],
                               self.signed_sin[positions][:, None], self.cache.attend_prompt)
        self.rounds = 0

    def keep(self, keep: torch.Tensor) -> None:
        self.cache.keep(keep)

    def finish(self) -> None:
        """Drop the call's cache and, drafting with the policy's first layers, the shallow copy of the policy's
        engine: it holds that generate's prepared matrices, which the trainer releases for the learning pass."""
        self.cache = None
        if self.layers is not None:
            self.draft = None

    def propose(self, sequences, uniforms, k, sampling):
        draft, cache = self.draft, self.cache
        device = sequences.context.device
        embedding = draft.base.model.embed_tokens.weight
        held = sequences.committed - 1  # (live,) own K/V the policy holds
        # Round 1 feeds the first token; later rounds the last two committed (the draft never saw the second).
        span = 1 if self.rounds == 0 else 2
        start = held - (span - 1)  # (live,) first draft slot fed
        feed = sequences.context.gather(1, sequences.length[:, None] - span + torch.arange(span, device=device))
        drafts, probs = [], []
        for step in range(k):
            cache.lengths, cache.max_length = start, int(start.max())
            position = sequences.prompt_length[:, None] + start[:, None] + torch.arange(span, device=device)
            hidden = draft._layers(F.embedding(feed, embedding), self.cos[position][:, None],  # (live, span, H)
                                   self.signed_sin[position][:, None], cache.attend_step)
            logits = draft._logits(hidden[:, -1])  # (live, V)
            if sampling.greedy:
                token = logits.argmax(dim=-1)
            else:
                q = processed_probs(logits, sampling)  # (live, V)
                token = inverse_cdf(q, uniforms[:, step])
                probs.append(q)
            drafts.append(token)
            start, span, feed = start + span, 1, token[:, None]
        self.rounds += 1
        return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if probs else None)


def parse_draft(text: str) -> int | None:
    """`layers:N` -> N (a self-draft); anything else -> None (a model name or path)."""
    if not text.startswith("layers:"):
        return None
    count = text.split(":", 1)[1]
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"speed.draft_model layers:N needs a whole number N >= 1 (got {text!r})")
    return int(count)
