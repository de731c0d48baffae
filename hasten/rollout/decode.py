"""The bookkeeping both engines' decode loops share: output buffers, seeded
draws, live rows and the finished-row test.

An engine owns its forward and its cache; `DecodeState` owns everything
else about a decode loop, so the two engines cannot drift apart in what
they record or in which random number a row gets:

    state = DecodeState(num_rows, steps, pad_token_id, eos_ids, seed, rows, sampling, prompt_ids, prompt_mask)
    decode(state, logits, sampling, keep_rows=cache_keep, forward=one_step)  # the one loop: decode() below
    return state.rollout(prompt_ids, prompt_mask, num_generations, sampling)

The loop keeps a count on the progress board (ticker.tally: token t of T,
rows still going) for the views to read; keeping it is an int store per step.

The speculative engine (speculative.py) keeps its own loop on purpose: each of its steps drafts and
verifies up to k+1 tokens per row, so its step is not this one-token step; it records through
DecodeState all the same.

One uniform is drawn per row per step for all rows (sampling.py), and a
finished row's draws are skipped, so compaction never changes which tokens
a row gets. The draws are those of a whole batch (`RowRange.total` rows, one
seed) of which this call samples rows first.. (a data-parallel rank's
share), so how a batch is split over processes cannot change a token either.

Every buffer lives on the model's device (eos_ids' device), and the draws
are made once, up front, on the CPU generator and moved there in one copy:
the only host sync per step is "did any row finish?". The CPU generator
fills `rand(steps, total)` with the same numbers as `steps` calls of
`rand(total)`, so this equals drawing step by step (the tokens of earlier
versions, bit for bit).
"""

from __future__ import annotations

import torch

from typing import Callable

from .. import ticker
from .sampling import sample_tokens
from .types import Rollout, RowRange, SamplingParams


class DecodeState:
    def __init__(self, num_rows: int, steps: int, pad_token_id: int, eos_ids: torch.Tensor, seed: int,
                 rows: RowRange | None = None, sampling: SamplingParams | None = None,
                 prompt_ids: torch.Tensor | None = None, prompt_mask: torch.Tensor | None = None):
        rows = rows or RowRange(0, num_rows)
        if rows.first + num_rows > rows.total:
            raise ValueError(f"{num_rows} rows from row {rows.first} do not fit a batch of {rows.total}")
        device = eos_ids.device
        self.num_rows, self.steps = num_rows, steps
        self.tokens = torch.full((num_rows, steps), pad_token_id, dtype=torch.long, device=device)  # (N, T)
        self.logprobs = torch.zeros((num_rows, steps), dtype=torch.float32, device=device)  # (N, T)
        self.mask = torch.zeros((num_rows, steps), dtype=torch.long, device=device)  # (N, T)
        self.ended = torch.zeros(num_rows, dtype=torch.bool, device=device)  # (N,) sampled an EOS
        self.live = torch.arange(num_rows, device=device)  # batch row -> output row
        generator = torch.Generator().manual_seed(seed)
        draws = torch.rand(steps, rows.total, generator=generator)  # (T, total) the whole batch's uniforms
        self.uniforms = draws[:, rows.first:rows.first + num_rows].to(device)  # (T, N) this call's rows
        self.eos_ids = eos_ids
        self.done = False
        # Repetition penalty only: which tokens each output row has seen (prompt, then its own samples),
        # made at the first step, when the vocabulary size is known.
        self.penalize = sampling is not None and sampling.repetition_penalty != 1.0
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.seen: torch.Tensor | None = None  # (N, V) bool

    def sample(self, logits: torch.Tensor, sampling: SamplingParams, step: int):
        """Sample the live rows' next tokens from logits (live, V) and record them.

        Returns (token (live,), keep): keep is None when no row finished, else
        the batch rows that go on (the engine compacts its cache to them).
        Sets `done` when the loop must stop (last step, or every row ended).
        """
        uniforms = self.uniforms[step]  # (N,) drawn for all rows
        if len(self.live) < self.num_rows:
            uniforms = uniforms[self.live]
        live = self.live
        seen = self._seen(logits)[live] if self.penalize else None  # (live, V) repetition penalty only
        token, token_logprob = sample_tokens(logits, sampling, uniforms, seen)  # (live,)
        if self.penalize:
            self.seen[live, token] = True
        self.tokens[live, step] = token
        self.logprobs[live, step] = token_logprob.float()
        self.mask[live, step] = 1
        finished = torch.isin(token, self.eos_ids)  # (live,)
        if step == self.steps - 1:
            self.ended[live] = finished
            self.done = True
            return token, None
        if not bool(finished.any()):  # the one host sync per step
            return token, None
        self.ended[live[finished]] = True
        keep = (~finished).nonzero().squeeze(-1)  # (live_after,)
        if keep.numel() == 0:
            self.done = True
            return token, None
        self.live = live[keep]
        return token[keep], keep

    def _seen(self, logits: torch.Tensor) -> torch.Tensor:
        if self.seen is None:
            if self.prompt_ids is None:
                raise ValueError("repetition_penalty needs the prompts (DecodeState(prompt_ids=...))")
            group = self.num_rows // self.prompt_ids.shape[0]
            ids = self.prompt_ids.repeat_interleave(group, dim=0).to(logits.device)  # (N, P)
            real = self.prompt_mask.repeat_interleave(group, dim=0).to(logits.device).bool()  # (N, P)
            counts = torch.zeros((self.num_rows, logits.shape[-1]), dtype=torch.long, device=logits.device)
            self.seen = counts.scatter_add_(1, ids, real.long()) > 0  # (N, V): padding adds 0
        return self.seen

    def rollout(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, num_generations: int,
                sampling: SamplingParams) -> Rollout:
        width = int(self.mask.sum(1).max())  # trim columns no row reached
        device = self.tokens.device
        return Rollout(
            prompt_ids=prompt_ids.to(device),
            prompt_mask=prompt_mask.to(device),
            completion_ids=self.tokens[:, :width],
            completion_mask=self.mask[:, :width],
            sampling_logprobs=self.logprobs[:, :width],
            ended_with_eos=self.ended,
            num_generations=num_generations,
            sampling=sampling,
        )


def decode(state: DecodeState, logits: torch.Tensor, sampling: SamplingParams,
           keep_rows: Callable[[torch.Tensor], None], forward: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """The decode loop every one-token-a-step engine runs; the engine brings its cache and forward.

    logits: (rows, V) after the prefill. keep_rows(keep): rows finished, compact the cache to the batch
    rows `keep`. forward(token (live,)) -> logits (live, V) for the next position.
    """
    count = ticker.tally("generating", state.steps, "token", rows=state.num_rows)  # the progress views read it
    for step in range(state.steps):
        count.done = step + 1  # O(1), no sync: what a 2-minute generate call shows while it runs
        token, keep = state.sample(logits, sampling, step)  # (live,)
        if state.done:
            break
        if keep is not None:  # rows finished: drop them from the running batch
            keep_rows(keep)
            count.live = len(keep)  # a shape, known on the host after the one sync per step
        logits = forward(token)
    count.finish()
