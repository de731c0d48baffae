"""Speculative decoding in the lean engine, distribution-exact (speed.speculative = ngram | draft).

A drafter (drafters.py: prompt lookup, or a draft model) proposes k tokens
per row; the policy checks all of them in ONE forward of k + 1 query
positions per row (the row's last committed token, then its k drafts), and
exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023) keeps
the policy's sampling distribution:

- p_i = the policy's processed distribution at draft i: softmax(filter(logits / T))
  with sampling.py's top-k, top-p and min-p, exactly what sample_tokens samples;
  q_i = the drafter's, processed the same way (a point mass for prompt lookup).
- draft i is accepted with probability min(1, p_i(x) / q_i(x)); at the first
  rejection the row takes a token from normalize(max(0, p_i - q_i)) and stops;
  if all k are accepted it takes a bonus token from p_{k+1}. So every verify
  forward commits between 1 and k + 1 tokens per row.
- greedy: a draft is accepted while it equals argmax p_i; the first mismatch
  takes argmax p_i. The output is the plain lean engine's greedy output (equal
  on the tiny test model; on a large vocabulary two forwards of different
  shapes can round a near-tie differently, as LeanEngine's docstring says of
  KVCacheEngine).

Randomness. Three uniforms are drawn per (output position, batch row) up
front from the seed: draft (a draft model samples its token there), accept
(the min(1, p/q) test) and resample (the residual or bonus token, and the
first token, sampled from the prefill's logits). They are drawn for the
whole batch (`RowRange.total` rows), so a split over ranks or the compaction
of finished rows cannot change a token, and a row's token depends only on
(seed, row, position, the committed prefix).

Why reusing a position's uniforms is exact. A verify round that starts with
n committed tokens reads the uniforms of positions n..n+k; it commits
positions n..n+a. Whether it stopped at a, and what it committed, depends
only on the uniforms of positions <= n+a (the accept tests at n..n+a, the
drafts at n..n+a, the resample uniform at n+a). Uniforms of positions > n+a
were at most used to draw drafts that were then discarded, and a discarded
draft never influences a committed token. So when the next round starts at
n+a+1, the uniforms of every position >= n+a+1 are still independent of the
committed prefix: each position's token is drawn by one standard speculative
step (or a plain sample from p) with fresh uniforms, and each such step
samples p exactly (Leviathan et al., Theorem 1). Discarded draft K/V never
matter either: a row's own K/V past its committed length is overwritten by
the next forward before any query attends to it (the per-row length mask).

Recorded log-probs are log_softmax(policy logits / T) at the committed
token, from the verify forward: what the plain engine records and the
learner recomputes. Repetition penalty is refused by the config (speculative
with it would need a penalty per draft position; not built).

Cache: the lean engine's `GroupCache` (prompt K/V once per group) with
ragged rows (`RaggedCache`): each row has its own committed length, so a
verify forward writes its k + 1 K/V at per-row offsets and attends to its
own K/V through a per-row length mask, causal among the new tokens. Rows
that end (EOS, or max_new_tokens) are compacted out, as in LeanEngine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import ticker
from .decode import DecodeState
from .engine import left_pad
from .group_cache import GroupCache, take_rows
from .sampling import filter_logits, sample_tokens
from .types import Rollout, RowRange, SamplingParams

DRAFT, ACCEPT, RESAMPLE = 0, 1, 2  # the three uniforms of an (output position, row)


class RaggedCache(GroupCache):
    """GroupCache whose rows have their own lengths: per-row write offsets and a per-row length mask.

    `lengths` (live,) says how many own K/V each row holds before this forward;
    `max_length` is their maximum, on the host (how much of the own cache to read).
    """

    def __init__(self, engine, prompt_mask, num_generations, capacity):
        super().__init__(engine, prompt_mask, num_generations, capacity + 1)  # (N, kv, capacity, head_dim) each
        # Zeros, not empty: a row reads (masked) slots past its own length, and 0 x NaN garbage would be NaN.
        self.own = [(keys.zero_(), values.zero_()) for keys, values in self.own]
        self.lengths = torch.zeros(self.num_prompts * num_generations, dtype=torch.long, device=prompt_mask.device)
        self.max_length = 0
        self.written = 0  # own slots any row may have written: what compaction copies

    def attend_written(self, layer, query):
        raise NotImplementedError("RaggedCache's rows have lengths of their own: attend_step writes and attends")

    def attend_step(self, layer, query, key, value):
        """query (N, heads, S, head_dim), key/value (N, kv, S, head_dim) -> (N, S, heads * head_dim)."""
        rows, kv_heads, span, head_dim = key.shape
        own_keys, own_values = self.own[layer]
        offsets = torch.arange(span, device=key.device)
        slots = self.lengths[:, None] + offsets  # (N, S) where each new K/V goes
        row_index = torch.arange(rows, device=key.device)[:, None]  # (N, 1)
        own_keys[row_index, :, slots] = key.transpose(1, 2)  # (N, S, kv, head_dim) into (N, kv, capacity, head_dim)
        own_values[row_index, :, slots] = value.transpose(1, 2)
        width = self.written = self.max_length + span
        own_keys, own_values = own_keys[:, :, :width], own_values[:, :, :width]
        prompts, generations, prompt_width = self.num_prompts, self.num_generations, self.prompt_width
        group = query.shape[1] // kv_heads
        # (N, kv, group * S, head_dim): each KV head's queries, head-major then position, K/V never repeated
        query = query.reshape(rows, kv_heads, group * span, head_dim) * self.engine.scale
        queries = group * span
        grid = self._to_grid(query).view(prompts, generations, kv_heads, queries, head_dim)
        grid = grid.transpose(1, 2).reshape(prompts, kv_heads, generations * queries, head_dim)
        prompt_keys, prompt_values = self.prompt[layer]
        prompt_scores = torch.matmul(grid, prompt_keys.transpose(-1, -2)) + self.prompt_bias  # (B, kv, G*q, P)
        prompt_scores = prompt_scores.view(prompts, kv_heads, generations, queries, prompt_width).transpose(1, 2)
        prompt_scores = self._from_grid(prompt_scores.reshape(-1, kv_heads, queries, prompt_width))  # (N, kv, q, P)
        # own slot j is visible to new token i of a row iff j <= length + i: its past and causal among the new
        visible = torch.arange(width, device=key.device) <= slots[:, :, None]  # (N, S, width)
        visible = visible[:, None, None].expand(rows, 1, group, span, width).reshape(rows, 1, queries, width)
        own_scores = torch.matmul(query, own_keys.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(torch.cat([prompt_scores, own_scores], dim=-1), dim=-1)  # (N, kv, q, P + width)
        prompt_probs = self._to_grid(probs[..., :prompt_width]).view(prompts, generations, kv_heads, queries,
                                                                     prompt_width)
        prompt_probs = prompt_probs.transpose(1, 2).reshape(prompts, kv_heads, generations * queries, prompt_width)
        from_prompt = torch.matmul(prompt_probs, prompt_values).view(prompts, kv_heads, generations, queries, head_dim)
        from_prompt = self._from_grid(from_prompt.transpose(1, 2).reshape(-1, kv_heads, queries, head_dim))
        attended = from_prompt + torch.matmul(probs[..., prompt_width:], own_values)  # (N, kv, q, head_dim)
        attended = attended.view(rows, kv_heads, group, span, head_dim).permute(0, 3, 1, 2, 4)  # (N, S, kv, group, D)
        return attended.reshape(rows, span, -1)

    def keep(self, keep: torch.Tensor) -> None:
        """Drop finished rows: keep (live_after,) batch indices, ascending."""
        self.own = [(take_rows(keys, keep, self.written, zero=True), take_rows(values, keep, self.written, zero=True))
                    for keys, values in self.own]
        self.lengths = self.lengths[keep]
        self.rows = keep if self.rows is None else self.rows[keep]


@dataclass
class Sequences:
    """What the drafters read about the live rows: prompt + committed tokens, left-aligned.

    context (live, P + T + k + 1) holds each row's real prompt tokens then its
    committed completion, -1 after; length (live,) counts them; committed
    (live,) counts the completion alone; prompt_length (live,) the real prompt.
    """

    context: torch.Tensor
    length: torch.Tensor
    committed: torch.Tensor
    prompt_length: torch.Tensor

    def take(self, keep: torch.Tensor) -> None:
        self.context, self.length = self.context[keep], self.length[keep]
        self.committed, self.prompt_length = self.committed[keep], self.prompt_length[keep]


def processed_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """softmax(filter(logits / T)): the distribution sample_tokens samples from. logits (..., V)."""
    shape = logits.shape
    scaled = logits.float().reshape(-1, shape[-1]) / sampling.temperature
    return torch.softmax(filter_logits(scaled, sampling), dim=-1).view(shape)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probs (N, V) (any non-negative weights), by inverting the CDF at uniforms (N,).

    sample_tokens' rule: the target is scaled by the total, so rounding cannot overshoot,
    and a landing on a zero-weight token (a CDF tie) steps to the row's argmax.
    """
    cdf = probs.cumsum(dim=-1)  # (N, V)
    tokens = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:]).squeeze(-1).clamp_(max=probs.shape[-1] - 1)
    return torch.where(probs.gather(-1, tokens[:, None]).squeeze(-1) > 0, tokens, probs.argmax(-1))


def acceptance(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) at the drafted tokens (N, k); q(x) > 0 wherever x was drawn from q."""
    return (p_draft / q_draft.clamp(min=1e-30)).clamp(max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) up to normalization, rows (N, V); where it is all zero (p == q up to
    rounding, so a rejection had probability ~0), p itself."""
    rest = (p - q).clamp(min=0.0)
    return torch.where(rest.sum(-1, keepdim=True) > 0, rest, p)


def verify(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
           uniforms: torch.Tensor, sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling for one verify forward.

    logits: (N, k+1, V) the policy's, at the last committed token and each draft;
    drafts: (N, k); draft_probs: (N, k, V) the drafter's processed q, or None for a
    point mass on each draft (prompt lookup); uniforms: (N, k+1, 3) of the row's
    output positions n..n+k. Returns (tokens (N, k+1), accepted (N,)): the row
    commits tokens[:, :accepted + 1] (accepted drafts, then the residual or bonus token).
    """
    rows, span, _ = logits.shape
    k = span - 1
    row_index = torch.arange(rows, device=logits.device)
    if sampling.greedy:
        best = logits.argmax(dim=-1)  # (N, k+1)
        matched = drafts == best[:, :k]
        accepted = matched.long().cumprod(dim=-1).sum(dim=-1)  # (N,) leading matches
        return best, accepted
    p = processed_probs(logits, sampling)  # (N, k+1, V)
    p_draft = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)  # (N, k)
    q_draft = torch.ones_like(p_draft) if draft_probs is None else \
        draft_probs.gather(-1, drafts[..., None]).squeeze(-1)
    passed = uniforms[:, :k, ACCEPT] < acceptance(p_draft, q_draft)  # (N, k)
    accepted = passed.long().cumprod(dim=-1).sum(dim=-1)  # (N,)
    # The one token after the accepted run: from the residual at the first rejection, or the bonus from p_{k+1}.
    target = p[row_index, accepted]  # (N, V)
    rejected = accepted < k
    stop = accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_stop = F.one_hot(drafts[row_index, stop], target.shape[-1]).to(target.dtype)
    else:
        q_stop = draft_probs[row_index, stop]  # (N, V)
    target = torch.where(rejected[:, None], residual(target, q_stop), target)
    last = inverse_cdf(target, uniforms[row_index, accepted, RESAMPLE])  # (N,)
    tokens = torch.cat([drafts, drafts.new_zeros(rows, 1)], dim=1)
    tokens[row_index, accepted] = last
    return tokens, accepted


class SpeculativeEngine:
    """LeanEngine's protocol, decoding with a drafter and one policy forward per k + 1 positions."""

    kind = "lean+speculative"

    def __init__(self, engine, drafter, num_draft_tokens: int):
        if num_draft_tokens < 1:
            raise ValueError(f"speculative decoding needs k >= 1 draft tokens (got {num_draft_tokens})")
        self.engine, self.drafter, self.k = engine, drafter, num_draft_tokens
        self.model, self.pad_token_id, self.eos_token_ids = engine.model, engine.pad_token_id, engine.eos_token_ids
        self.sample_precision = engine.sample_precision  # generation.precision, for the plan line

    def weights_changed(self) -> None:
        self.engine.weights_changed()

    def release_weights(self) -> None:
        self.engine.release_weights()

    def state_dict(self) -> dict:
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.load_state_dict(state)

    def sync_weights(self, force: bool = False) -> None:
        self.engine.sync_weights(force)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
                 rows: RowRange | None = None) -> Rollout:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if sampling.repetition_penalty != 1.0:
            raise ValueError("speculative decoding does not apply repetition_penalty; set it to 1 or speculative=off")
        engine, k = self.engine, self.k
        # generation.precision=bf16: the verify forward runs LeanEngine's bf16 matmuls as its own sampled
        # generate would, so the rollout is exact for that bf16 policy and its log-probs are that policy's.
        engine.ready_for(sampling)
        prompt_ids, prompt_mask = left_pad(prompts, engine.pad_token_id)  # (B, P)
        num_prompts, prompt_width = prompt_ids.shape
        num_rows, steps = num_prompts * num_generations, sampling.max_new_tokens
        embedding = engine.base.model.embed_tokens.weight
        device = embedding.device
        cos, signed_sin = engine._rope_table(prompt_width + steps + k + 1, device)  # (positions, head_dim)
        cache = RaggedCache(engine, prompt_mask.to(device), num_generations, steps + k)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0).to(device)  # (B, P)
        hidden = engine._layers(F.embedding(prompt_ids.to(device), embedding),  # (B, P, H)
                                cos[positions][:, None], signed_sin[positions][:, None], cache.attend_prompt)
        first_logits = engine._logits(hidden[:, -1]).repeat_interleave(num_generations, dim=0)  # (B*G, V)

        # The output buffers and the finished-row bookkeeping are DecodeState's; the draws are ours.
        state = DecodeState(num_rows, steps, engine.pad_token_id, engine.eos_token_ids.to(device), seed, rows)
        rows = rows or RowRange(0, num_rows)
        generator = torch.Generator().manual_seed(seed)
        draws = torch.rand(steps + k + 1, rows.total, 3, generator=generator)  # (T+k+1, total, 3) whole batch
        uniforms = draws[:, rows.first:rows.first + num_rows].transpose(0, 1).to(device)  # (N, T+k+1, 3)
        sequences = self._sequences(prompt_ids, prompt_mask, num_generations, steps + k + 1, device)
        self.drafter.start(engine, prompt_ids, prompt_mask, num_generations, cache, steps + k, sampling)
        try:
            token, logprob = sample_tokens(first_logits, sampling, uniforms[:, 0, RESAMPLE])  # (N,) position 0
            tokens = token[:, None]  # (N, 1)
            logprobs, counts = logprob[:, None], torch.ones(num_rows, dtype=torch.long, device=device)
            live = torch.arange(num_rows, device=device)  # batch row -> output row
            stats = {"rows": num_rows, "drafted": 0, "accepted": 0, "committed": 0, "row_forwards": 0, "forwards": 0}
            count = ticker.tally("generating", steps, "token", rows=num_rows)  # the progress views read it
            while True:
                keep = self._commit(state, sequences, live, tokens, logprobs, counts, steps)
                if keep is not None:
                    if keep.numel() == 0:
                        break
                    live = live[keep]
                    cache.keep(keep)
                    self.drafter.keep(keep)
                lengths = sequences.committed - 1  # (live,) own K/V held: all committed but the last
                cache.lengths, cache.max_length = lengths, int(lengths.max())
                count.done, count.live = min(cache.max_length + 1, steps), len(live)  # the longest row; no new sync
                window = sequences.committed[:, None] + torch.arange(k + 1, device=device)  # (live, k+1)
                row_uniforms = uniforms[live[:, None], window]
                drafts, draft_probs = self.drafter.propose(sequences, row_uniforms[:, :k, DRAFT], k,
                                                           sampling)  # (live, k)
                last = sequences.context.gather(1, sequences.length[:, None] - 1)  # (live, 1)
                feed = torch.cat([last, drafts], dim=1)  # (live, k+1)
                position = sequences.prompt_length[:, None] + lengths[:, None] + torch.arange(k + 1, device=device)
                hidden = engine._layers(F.embedding(feed, embedding),  # (live, k+1, H)
                                        cos[position][:, None], signed_sin[position][:, None], cache.attend_step)
                logits = engine._logits(hidden)  # (live, k+1, V)
                tokens, accepted = verify(logits, drafts, draft_probs, row_uniforms, sampling)
                tempered = logits.float() / (sampling.temperature if not sampling.greedy else 1.0)
                logprobs = torch.log_softmax(tempered, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)  # (live, k+1)
                counts = accepted + 1
                stats["drafted"] += k * len(live)
                stats["accepted"] += int(accepted.sum())
                stats["row_forwards"] += len(live)
                stats["forwards"] += 1
            count.finish()
        finally:
            self.drafter.finish()
        stats["committed"] = int(state.mask.sum())
        rollout = state.rollout(prompt_ids, prompt_mask, num_generations, sampling)
        rollout.stats = summary(stats)
        return rollout

    def _sequences(self, prompt_ids, prompt_mask, num_generations, extra, device) -> Sequences:
        lengths = prompt_mask.sum(-1).repeat_interleave(num_generations)  # (N,)
        width = prompt_ids.shape[1] + extra
        context = torch.full((len(lengths), width), -1, dtype=torch.long)
        ids = prompt_ids.repeat_interleave(num_generations, dim=0)
        for row, length in enumerate(lengths.tolist()):  # left-aligned: real tokens first
            context[row, :length] = ids[row, ids.shape[1] - length:]
        lengths = lengths.to(device)
        return Sequences(context.to(device), lengths.clone(), torch.zeros_like(lengths), lengths)

    def _commit(self, state, sequences, live, tokens, logprobs, counts, steps) -> torch.Tensor | None:
        """Write each live row's first counts (live,) of tokens (live, S) into the outputs and its context,
        cut at its first EOS and at max_new_tokens. Returns the rows that go on (None: all do)."""
        span = tokens.shape[1]
        offsets = torch.arange(span, device=tokens.device)
        slots = sequences.committed[:, None] + offsets  # (live, S) output positions
        valid = (offsets < counts[:, None]) & (slots < steps)
        is_eos = torch.isin(tokens, state.eos_ids) & valid
        valid &= (is_eos.long().cumsum(dim=1) - is_eos.long()) == 0  # nothing after the first EOS
        out_rows = live[:, None].expand_as(slots)[valid]
        state.tokens[out_rows, slots[valid]] = tokens[valid]
        state.logprobs[out_rows, slots[valid]] = logprobs[valid].float()
        state.mask[out_rows, slots[valid]] = 1
        row_index = torch.arange(len(live), device=tokens.device)[:, None].expand_as(slots)
        sequences.context[row_index[valid], (sequences.length[:, None] + offsets).expand_as(slots)[valid]] = \
            tokens[valid]
        written = valid.sum(dim=1)
        sequences.length += written
        sequences.committed += written
        ended = is_eos.any(dim=1)
        state.ended[live] = ended
        finished = ended | (sequences.committed >= steps)
        if not bool(finished.any()):  # the one host sync per verify forward
            return None
        keep = (~finished).nonzero().squeeze(-1)
        sequences.take(keep)
        return keep


def summary(stats: dict[str, int]) -> dict[str, float]:
    """spec/acceptance: accepted / drafted tokens; spec/tokens_per_forward: tokens a row gets per verify
    forward (the first token, from the prefill, not counted)."""
    after_first = stats["committed"] - stats["rows"]
    return {"spec/acceptance": stats["accepted"] / max(stats["drafted"], 1),
            "spec/tokens_per_forward": after_first / max(stats["row_forwards"], 1),
            "spec/forwards": float(stats["forwards"])}
