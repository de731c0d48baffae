"""Multi-turn sampling that keeps each conversation's K/V between turns (agent/loop.py's fast path).

A tool loop alternates model turns with tool results. Re-running
`engine.generate(prompt + everything so far)` for every turn prefills the
whole conversation again; this keeps it instead:

    cache = ConversationCache(lean_engine, capacity)
    turn0 = cache.start(prompts, num_generations, sampling, seed, rows)   # each prompt prefilled once (group)
    turn  = cache.extend(conversation_rows, new_tokens, sampling, seed)   # only the tool turn is prefilled

Each prompt's K/V are stored once, for its whole group; each conversation owns
a dense K/V slab for what came after the prompt (layers x (kv, capacity, head_dim)),
and a turn writes its tokens after what the conversation holds. Attention reads
the prompt part through a (prompt, generation) grid, as the lean engine's
GroupCache does: one matmul per prompt serves all of its rows, so the prompt's
K/V are read once per group and step rather than once per row (agentic prompts
carry the tool schemas: hundreds of tokens). The forward is the lean engine's
own (`LeanEngine._layers`, `_logits`: the same fused weights, RoPE and
precision), the decode loop and the draws are rollout/decode.py's, seeded as
`engine.generate` would be for the same call, so the tokens are those of
re-prefilling (tests/test_agent_cache.py and test_agent_learning.py check
tokens and log-probs against it).

A decode step's attention runs speed.decode_attention's fused kernel where the engine has it on
(kernels/decode_attention.py: each row's own length and slab row passed to it), else `_attend`.

A row that finishes its turn leaves the running batch at once, as in the lean engine: later steps feed
only the rows still sampling, each reading and writing its own slab row by index, so nothing is copied
to compact the cache (an agentic group's turns end 14 to 159 tokens apart).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import decode_attention
from .decode import DecodeState, decode
from .engine import left_pad
from .types import Rollout, RowRange, SamplingParams


class ConversationCache:
    def __init__(self, engine, capacity: int):
        self.engine = engine
        self.capacity = capacity  # the longest conversation: prompt + the whole completion budget
        self.prompt_keys: list[torch.Tensor] = []  # per layer (B, kv, P, head_dim): each prompt once
        self.prompt_values: list[torch.Tensor] = []
        self.prompt_lengths = torch.zeros(0, dtype=torch.long)  # (B,)
        self.prompt_bias = torch.zeros(0)  # (B, 1, 1, P): 0 on a prompt's tokens, -inf on its right padding
        self.num_generations = 1
        self.keys: list[torch.Tensor] = []  # per layer (N, kv, own capacity, head_dim): after the prompt
        self.values: list[torch.Tensor] = []
        self.own = torch.zeros(0, dtype=torch.long)  # (N,) tokens each conversation holds after its prompt

    @property
    def lengths(self) -> torch.Tensor:
        """(N,) tokens each conversation's cache holds, its prompt included."""
        return self.prompt_lengths.repeat_interleave(self.num_generations) + self.own

    @torch.no_grad()
    def start(self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
              rows: RowRange | None = None) -> Rollout:
        """Turn 0: prefill each prompt once into the group's store, decode its num_generations rows."""
        engine = self.engine
        engine.ready_for(sampling)
        prompt_ids, prompt_mask = left_pad(prompts, engine.pad_token_id)  # (B, P)
        weight = engine.base.model.embed_tokens.weight
        device = weight.device
        count = len(prompts) * num_generations
        self.num_generations = num_generations
        self.prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        own_capacity = max(1, self.capacity - int(self.prompt_lengths.min()))
        shape = (count, engine.num_kv_heads, own_capacity, engine.head_dim)
        self.keys = [weight.new_zeros(shape) for _ in engine.layers]
        self.values = [weight.new_zeros(shape) for _ in engine.layers]
        self.own = torch.zeros(count, dtype=torch.long, device=device)
        logits = self._prefill_prompts(prompts).repeat_interleave(num_generations, dim=0)  # (B*G, V)
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
        device = self.own.device
        rows = torch.tensor(conversations, dtype=torch.long, device=device)
        prompt_lengths = self.prompt_lengths[rows // self.num_generations]
        held = [min(int(length), count) for length, count in zip(self.lengths[rows], kept)]
        self.own[rows] = torch.tensor(held, device=device) - prompt_lengths
        feeds = [context[start:] for context, start in zip(contexts, held)]
        new_ids, _ = _right_pad(feeds, engine.pad_token_id)
        logits = self._prefill(rows, new_ids.to(device), torch.tensor([len(f) for f in feeds], device=device))
        prompt_ids, prompt_mask = left_pad(contexts, engine.pad_token_id)
        return self._decode(rows, logits, sampling, seed, None, prompt_ids, prompt_mask, 1)

    def _prefill_prompts(self, prompts: list[list[int]]) -> torch.Tensor:
        """Each prompt once (right-padded, positions from 0) into the prompt store; logits (B, V) of its last."""
        engine = self.engine
        new_ids, mask = _right_pad(prompts, engine.pad_token_id)  # (B, P)
        device = self.own.device
        new_ids, real = new_ids.to(device), mask.to(device).bool()
        width = new_ids.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        # A padding query sees itself too, so no row of the mask is empty (no NaN in its output).
        allowed = (causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)  # (B, P, P)
        weight = engine.base.model.embed_tokens.weight
        self.prompt_bias = torch.zeros(real.shape, dtype=weight.dtype, device=device).masked_fill(
            ~real, float("-inf"))[:, None, None]  # (B, 1, 1, P)
        self.prompt_keys, self.prompt_values = [], []

        def attend(layer, query, key, value):
            self.prompt_keys.append(key.contiguous())
            self.prompt_values.append(value.contiguous())
            attended = F.scaled_dot_product_attention(query, key, value, allowed[:, None], enable_gqa=True)
            return attended.transpose(1, 2).flatten(2)  # (B, P, heads * head_dim)

        cos, signed_sin = engine._rope_table(self.capacity, device)
        positions = torch.arange(width, device=device).expand(len(prompts), -1)  # (B, P)
        hidden = engine._layers(F.embedding(new_ids, weight), cos[positions][:, None], signed_sin[positions][:, None],
                                attend)  # (B, P, H)
        return engine._logits(hidden[torch.arange(len(prompts), device=device), self.prompt_lengths - 1])

    def _attend(self, layer: int, rows: torch.Tensor, query: torch.Tensor, own_allowed: torch.Tensor,
                full: bool) -> torch.Tensor:
        """Attention of `rows`' queries (R, heads, M, head_dim) to their prompt (shared by the group, through
        the grid) and their own tokens (own_allowed (R, M, span) says which) -> (R, M, heads * head_dim)."""
        engine = self.engine
        count, heads, width, head_dim = query.shape
        kv_heads, generations = engine.num_kv_heads, self.num_generations
        prompt_keys, prompt_values = self.prompt_keys[layer], self.prompt_values[layer]  # (B, kv, P, head_dim)
        prompts, prompt_width = prompt_keys.shape[0], prompt_keys.shape[2]
        group = heads // kv_heads
        # The heads sharing a KV head become that head's queries, so K/V are never repeated.
        query = (query * engine.scale).reshape(count, kv_heads, group * width, head_dim)  # (R, kv, g*M, head_dim)
        grid = query if full else query.new_zeros((prompts * generations,) + query.shape[1:]).index_copy_(0, rows, query)
        grid = grid.view(prompts, generations, kv_heads, -1, head_dim).transpose(1, 2)
        grid = grid.reshape(prompts, kv_heads, -1, head_dim)  # (B, kv, G*g*M, head_dim)
        prompt_scores = torch.matmul(grid, prompt_keys.transpose(-1, -2)) + self.prompt_bias  # (B, kv, G*g*M, P)
        prompt_scores = prompt_scores.view(prompts, kv_heads, generations, -1, prompt_width).transpose(1, 2)
        prompt_scores = prompt_scores.reshape(prompts * generations, kv_heads, -1, prompt_width)
        if not full:
            prompt_scores = prompt_scores.index_select(0, rows)  # (R, kv, g*M, P)
        span = own_allowed.shape[-1]
        own_keys, own_values = _slab(self.keys[layer], rows, span, full), _slab(self.values[layer], rows, span, full)
        own_scores = torch.matmul(query, own_keys.transpose(-1, -2))  # (R, kv, g*M, span)
        own_bias = torch.zeros(own_allowed.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~own_allowed, float("-inf"))  # (R, M, span)
        own_scores = (own_scores.view(count, kv_heads, group, width, span) + own_bias[:, None, None]).view_as(own_scores)
        probs = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1)  # (R, kv, g*M, P + span)
        prompt_probs = probs[..., :prompt_width]
        if not full:
            prompt_probs = prompt_probs.new_zeros((prompts * generations,) + prompt_probs.shape[1:]).index_copy_(
                0, rows, prompt_probs)
        prompt_probs = prompt_probs.reshape(prompts, generations, kv_heads, -1, prompt_width).transpose(1, 2)
        prompt_probs = prompt_probs.reshape(prompts, kv_heads, -1, prompt_width)  # (B, kv, G*g*M, P)
        from_prompt = torch.matmul(prompt_probs, prompt_values).view(prompts, kv_heads, generations, -1, head_dim)
        from_prompt = from_prompt.transpose(1, 2).reshape(prompts * generations, kv_heads, -1, head_dim)
        if not full:
            from_prompt = from_prompt.index_select(0, rows)
        attended = from_prompt + torch.matmul(probs[..., prompt_width:], own_values)  # (R, kv, g*M, head_dim)
        attended = attended.reshape(count, heads, width, head_dim)
        return attended.transpose(1, 2).flatten(2)  # (R, M, heads * head_dim)

    def _prefill(self, rows: torch.Tensor, new_ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Feed new_ids (R, M) (right-padded, counts (R,) real) after rows' cached tokens; logits (R, V) of
        each row's last real token."""
        engine = self.engine
        starts = self.own[rows]  # (R,) own tokens held
        width = new_ids.shape[1]
        offsets = torch.arange(width, device=new_ids.device)
        own_positions = starts[:, None] + offsets  # (R, M)
        span = int((starts + counts).max())
        keys_at = torch.arange(span, device=new_ids.device)
        # A new token sees the row's held tokens and the new ones up to itself (padding: the same, harmless).
        own_allowed = keys_at[None, None] <= own_positions[:, :, None]  # (R, M, span)
        cos, signed_sin = engine._rope_table(self.capacity, new_ids.device)
        positions = (self.prompt_lengths[rows // self.num_generations][:, None] + own_positions).clamp(
            max=self.capacity - 1)  # (R, M) in the whole conversation
        full = _every_row(rows, len(self.own))

        def attend(layer, query, key, value):
            keys, values = self.keys[layer], self.values[layer]
            for index in range(len(rows)):  # write the real new tokens after what each row holds
                count, start = int(counts[index]), int(starts[index])
                keys[rows[index], :, start:start + count] = key[index, :, :count]
                values[rows[index], :, start:start + count] = value[index, :, :count]
            return self._attend(layer, rows, query, own_allowed, full)

        embedding = engine.base.model.embed_tokens.weight
        hidden = engine._layers(F.embedding(new_ids, embedding), cos[positions][:, None],
                                signed_sin[positions][:, None], attend)  # (R, M, H)
        self.own[rows] = starts + counts
        last = hidden[torch.arange(len(rows), device=hidden.device), counts - 1]  # (R, H)
        return engine._logits(last)

    def _decode(self, rows: torch.Tensor, logits: torch.Tensor, sampling: SamplingParams, seed: int,
                row_range: RowRange | None, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                num_generations: int) -> Rollout:
        """rollout/decode.py's loop over `rows`; each step feeds only the rows still sampling."""
        engine = self.engine
        device = logits.device
        count = len(rows)
        steps = sampling.max_new_tokens
        longest = int(self.lengths[rows].max())
        if longest + steps > self.capacity:  # the caller sized it: a bug, not user input
            raise ValueError(f"a conversation of {longest} tokens + {steps} new ones does "
                             f"not fit the cache's {self.capacity} positions")
        state = DecodeState(count, steps, engine.pad_token_id, engine.eos_token_ids.to(device), seed, row_range,
                            sampling, prompt_ids, prompt_mask)
        live = torch.arange(count, device=device)  # batch rows still sampling
        full = _every_row(rows, len(self.own))
        cos, signed_sin = engine._rope_table(self.capacity, device)
        embedding = engine.base.model.embed_tokens.weight
        prompt_lengths = self.prompt_lengths[rows // self.num_generations]  # (count,)
        fused = bool(getattr(engine, "decode_attention", False))  # speed.decode_attention, resolved
        prompt_of_row = rows // self.num_generations
        bias_rows = self.prompt_bias.view(self.prompt_bias.shape[0], -1)  # (B, P)

        def keep_rows(keep: torch.Tensor) -> None:
            nonlocal live
            live = live[keep]

        def forward(token: torch.Tensor) -> torch.Tensor:
            # Only the rows still sampling run: a finished row's slab is left as it is (nothing copied), and
            # the others read and write their own slab rows by index.
            live_rows = rows[live]  # (live,) their cache rows
            own_positions = self.own[live_rows]  # (live,) where each row's token goes after its prompt
            positions = prompt_lengths[live] + own_positions
            span = int(own_positions.max()) + 1
            own_allowed = (torch.arange(span, device=device)[None] <= own_positions[:, None])[:, None]  # (live, 1, span)
            own_lengths = own_positions + 1  # the same, as lengths: the fused kernel's form
            live_prompts = prompt_of_row[live]
            every = full and len(live) == count  # every cache row, in order: _attend reads the slabs as views

            def attend(layer, query, key, value):
                keys, values = self.keys[layer], self.values[layer]
                keys[live_rows, :, own_positions] = key[:, :, 0]
                values[live_rows, :, own_positions] = value[:, :, 0]
                if fused:  # each row attends to its first own_positions + 1 own tokens, as own_allowed says
                    attended = decode_attention.attend(query, engine.scale, self.prompt_keys[layer],
                                                       self.prompt_values[layer], bias_rows, live_prompts, keys,
                                                       values, span, live_rows, own_lengths)
                    if attended is not None:
                        return attended
                return self._attend(layer, live_rows, query, own_allowed, every)

            hidden = engine._layers(F.embedding(token, embedding)[:, None], cos[positions][:, None, None],
                                    signed_sin[positions][:, None, None], attend)  # (live, 1, H)
            self.own[live_rows] += 1
            return engine._logits(hidden[:, -1])  # (live, V)

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
