"""Multi-turn sampling that keeps each conversation's K/V between turns (agent/loop.py's fast path).

A tool loop alternates model turns with tool results. Re-running
`engine.generate(prompt + everything so far)` for every turn prefills the
whole conversation again; this keeps it instead:

    cache = ConversationCache(lean_engine, capacity)
    turn0 = cache.start(prompts, num_generations, sampling, seed, rows)   # each prompt prefilled once (group)
    turn  = cache.extend(conversation_rows, new_tokens, sampling, seed)   # only the tool turn is prefilled

Each conversation owns a dense K/V slab (layers x (kv, capacity, head_dim));
a turn writes its tokens after what the conversation holds. The forward is
the lean engine's own (`LeanEngine._layers`, `_logits`: the same fused
weights, RoPE and precision), the decode loop and the draws are
rollout/decode.py's, seeded as `engine.generate` would be for the same
call, so the tokens are those of re-prefilling (tests/test_agent_learning.py
checks tokens and log-probs against it).

What it does not do, on purpose: rows that finished a turn stay in the
batch (their writes are masked), so the cache is never copied to compact
it; the group's prompt is stored once per rollout (copied after one
prefill per prompt) rather than shared at decode time as GroupCache does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode import DecodeState, decode
from .engine import left_pad
from .types import Rollout, RowRange, SamplingParams


class ConversationCache:
    def __init__(self, engine, capacity: int):
        self.engine = engine
        self.capacity = capacity  # the longest conversation: prompt + the whole completion budget
        self.keys: list[torch.Tensor] = []  # per layer (N, kv, capacity, head_dim)
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long)  # (N,) tokens each conversation's cache holds

    @torch.no_grad()
    def start(self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
              rows: RowRange | None = None) -> Rollout:
        """Turn 0: prefill each prompt once, give its K/V to its num_generations rows, decode."""
        engine = self.engine
        engine.ready_for(sampling)
        prompt_ids, prompt_mask = left_pad(prompts, engine.pad_token_id)  # (B, P)
        device = engine.base.model.embed_tokens.weight.device
        count = len(prompts) * num_generations
        shape = (count, engine.num_kv_heads, self.capacity, engine.head_dim)
        weight = engine.base.model.embed_tokens.weight
        self.keys = [weight.new_zeros(shape) for _ in engine.layers]
        self.values = [weight.new_zeros(shape) for _ in engine.layers]
        self.lengths = torch.zeros(count, dtype=torch.long, device=device)
        lengths = [len(p) for p in prompts]
        new_ids, _ = _right_pad(prompts, engine.pad_token_id)
        logits = self._prefill(torch.arange(len(prompts), device=device) * num_generations,
                               new_ids.to(device), torch.tensor(lengths, device=device))  # (B, V)
        for offset in range(1, num_generations):  # the group's other rows: copies of the prompt's K/V
            for keys, values in zip(self.keys, self.values):
                keys[offset::num_generations] = keys[0::num_generations]
                values[offset::num_generations] = values[0::num_generations]
            self.lengths[offset::num_generations] = self.lengths[0::num_generations]
        logits = logits.repeat_interleave(num_generations, dim=0)  # (B*G, V)
        return self._decode(torch.arange(count, device=device), logits, sampling, seed, rows, prompt_ids,
                            prompt_mask, num_generations)

    @torch.no_grad()
    def extend(self, conversations: list[int], contexts: list[list[int]], kept: list[int],
               sampling: SamplingParams, seed: int) -> Rollout:
        """A later turn for `conversations` (row indices of start's batch) whose whole conversation so far
        is `contexts` (prompt, turns, the new tool turn): prefill what the cache does not hold, decode.

        kept[i]: how many leading tokens of contexts[i] are the prompt and what the model sampled (the rest
        is the tool turn). The cache holds the prompt and every sampled token but the last (never fed);
        the loop may have kept fewer (cut at a stop string), so the two agree on min(held, kept) tokens
        and the feed starts there: nothing is prefilled twice.
        """
        engine = self.engine
        engine.ready_for(sampling)
        device = self.lengths.device
        rows = torch.tensor(conversations, dtype=torch.long, device=device)
        held = [min(int(self.lengths[row]), count) for row, count in zip(conversations, kept)]
        self.lengths[rows] = torch.tensor(held, device=device)
        feeds = [context[start:] for context, start in zip(contexts, held)]
        new_ids, _ = _right_pad(feeds, engine.pad_token_id)
        logits = self._prefill(rows, new_ids.to(device), torch.tensor([len(f) for f in feeds], device=device))
        prompt_ids, prompt_mask = left_pad(contexts, engine.pad_token_id)
        return self._decode(rows, logits, sampling, seed, None, prompt_ids, prompt_mask, 1)

    def _prefill(self, rows: torch.Tensor, new_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Feed new_ids (R, M) (right-padded, counts (R,) real) after rows' cached tokens; logits (R, V) of
        each row's last real token."""
        engine = self.engine
        starts = self.lengths[rows]  # (R,)
        width = new_ids.shape[1]
        offsets = torch.arange(width, device=new_ids.device)
        positions = starts[:, None] + offsets  # (R, M)
        span = int((starts + counts).max())
        keys_at = torch.arange(span, device=new_ids.device)
        # A new token sees the row's cached tokens and the new ones up to itself; padding sees itself.
        allowed = (keys_at[None, None] < starts[:, None, None]) | (
            (keys_at[None, None] >= starts[:, None, None]) & (keys_at[None, None] <= positions[:, :, None]))
        allowed = allowed | (keys_at[None, None] == positions[:, :, None])  # (R, M, span)
        cos, signed_sin = engine._rope_table(self.capacity, new_ids.device)
        positions = positions.clamp(max=self.capacity - 1)
        full = _every_row(rows, len(self.lengths))

        def attend(layer, query, key, value):
            keys, values = self.keys[layer], self.values[layer]
            for index in range(len(rows)):  # write the real new tokens after what each row holds
                count, start = int(counts[index]), int(starts[index])
                keys[rows[index], :, start:start + count] = key[index, :, :count]
                values[rows[index], :, start:start + count] = value[index, :, :count]
            attended = F.scaled_dot_product_attention(query, _slab(keys, rows, span, full), _slab(values, rows, span, full),
                                                      allowed[:, None], enable_gqa=True)
            return attended.transpose(1, 2).flatten(2)  # (R, M, heads * head_dim)

        embedding = engine.base.model.embed_tokens.weight
        hidden = engine._layers(F.embedding(new_ids, embedding), cos[positions][:, None],
                                signed_sin[positions][:, None], attend)  # (R, M, H)
        self.lengths[rows] = starts + counts
        last = hidden[torch.arange(len(rows), device=hidden.device), counts - 1]  # (R, H)
        return engine._logits(last)

    def _decode(self, rows: torch.Tensor, logits: torch.Tensor, sampling: SamplingParams, seed: int,
                row_range: RowRange | None, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                num_generations: int) -> Rollout:
        """rollout/decode.py's loop over `rows`; every row is fed each step, only live rows write."""
        engine = self.engine
        device = logits.device
        count = len(rows)
        steps = sampling.max_new_tokens
        if int(self.lengths[rows].max()) + steps > self.capacity:  # the caller sized it: a bug, not user input
            raise ValueError(f"a conversation of {int(self.lengths[rows].max())} tokens + {steps} new ones does "
                             f"not fit the cache's {self.capacity} positions")
        state = DecodeState(count, steps, engine.pad_token_id, engine.eos_token_ids.to(device), seed, row_range,
                            sampling, prompt_ids, prompt_mask)
        live = torch.arange(count, device=device)  # batch rows still sampling
        full = _every_row(rows, len(self.lengths))
        tokens = torch.full((count,), engine.pad_token_id, dtype=torch.long, device=device)
        cos, signed_sin = engine._rope_table(self.capacity, device)
        embedding = engine.base.model.embed_tokens.weight

        def keep_rows(keep: torch.Tensor) -> None:
            nonlocal live
            live = live[keep]

        def forward(token: torch.Tensor) -> torch.Tensor:
            tokens[live] = token
            positions = self.lengths[rows]  # (count,) where each row's token goes
            writing = torch.zeros(count, dtype=torch.bool, device=device)
            writing[live] = True
            span = int(positions.max()) + 1
            allowed = torch.arange(span, device=device)[None] <= positions[:, None]  # (count, span)

            def attend(layer, query, key, value):
                keys, values = self.keys[layer], self.values[layer]
                target = rows[writing]
                keys[target, :, positions[writing]] = key[writing, :, 0]
                values[target, :, positions[writing]] = value[writing, :, 0]
                attended = F.scaled_dot_product_attention(query, _slab(keys, rows, span, full), _slab(values, rows, span, full),
                                                          allowed[:, None, None], enable_gqa=True)
                return attended.transpose(1, 2).flatten(2)  # (count, 1, heads * head_dim)

            hidden = engine._layers(F.embedding(tokens, embedding)[:, None], cos[positions][:, None, None],
                                    signed_sin[positions][:, None, None], attend)  # (count, 1, H)
            self.lengths[rows[writing]] += 1
            return engine._logits(hidden[live, -1])  # (live, V)

        decode(state, logits, sampling, keep_rows, forward)  # a row's last sampled token is never fed
        return state.rollout(prompt_ids, prompt_mask, num_generations, sampling)


def _every_row(rows: torch.Tensor, count: int) -> bool:
    return len(rows) == count and bool((rows == torch.arange(count, device=rows.device)).all())


def _slab(cache: torch.Tensor, rows: torch.Tensor, span: int, full: bool) -> torch.Tensor:
    """cache[rows, :, :span]: a view when `rows` is every row in order (full: turn 0, or every rollout
    continuing), a gathered copy otherwise."""
    return cache[:, :, :span] if full else cache[rows, :, :span]


def _right_pad(sequences: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in sequences))
    ids = torch.tensor([s + [pad_token_id] * (width - len(s)) for s in sequences], dtype=torch.long)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.long)
    return ids, mask
