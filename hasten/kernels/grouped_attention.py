"""Attention that skips the masked-out blocks of a packed group (speed.grouped_attention).

The packed learning pass (packing.py) lays a group out as one row,

    [prompt][completion 1][completion 2] ... [completion G]

and hands attention a block mask: completion j sees the prompt and itself,
never another completion. A dense kernel still scores every (query, key)
pair of the row, L^2 of them, and the mask throws most away. For B1 (a
~50-token prompt, 8 completions of ~46 tokens, L ~ 420) under a sixth of
those pairs are allowed, and attention is a real share of the pass's time.

Here the same attention is computed on the allowed blocks only:
- the prompts, one padded batch of R rows: causal self-attention;
- the completions, one padded batch of C rows: each completion's queries
  against [its prompt's keys, its own keys (causal)].
With speed.shared_prefix the prompts' common prefix sits once, at the start
of row 0 (segment -2), and every row's prompt keys are that prefix's keys
followed by its own prompt's: the gathers read across rows.
Each batch is padded to its longest member, and members differ: an agentic
group's completions run 14 to 159 tokens, and with a shared prefix row 0
holds ~400 prompt queries where the others hold ~30. So each batch is sorted
longest first and cut into a few buckets, each padded to its own longest
(`_buckets`: the cut that scores the fewest (query, key) pairs, a call
counted as BUCKET_CALL_PAIRS of them), one `scaled_dot_product_attention`
call per bucket and layer; a prompt bucket whose rows start at key 0 (row 0,
or every row without a shared prefix) is plain causal attention and runs
under is_causal, where the CPU flash kernel skips the blocks past the
diagonal. The calls run in fp32 under
CPU autocast (kernels/precision.py's `attention`); queries, keys and values are
gathered into those batches and every packed position gathers its output
back, all under autograd, with gathers whose backward is index_add_ (`_Rows`:
autograd's own accumulating index_put is serial on the CPU). Every query sees exactly
the keys the block mask allows, so the result equals the dense masked
attention up to float rounding (tests/test_packing.py runs the packed pass
both ways against the plain padded pass).

How it plugs in: transformers looks attention up by name in
`AttentionInterface`; `grouped_attention(model, layout)` registers
"hasten_grouped", switches the model's config to it for the block, and the
layout travels to each layer as the `hasten_layout` keyword that
transformers passes through to attention functions. The native Llama
(models/llama.py) resolves the same name itself, without transformers.
Models that ignore AttentionInterface keep the dense masked path (packing.py
checks this).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .precision import attention

NAME = "hasten_grouped"


SHARED_SEGMENT = -2  # the prompts' common prefix (speed.shared_prefix): in the first row only, seen by every row
CAUSAL_FROM = 512  # completions padded to this many tokens or more take the causal form (_causal_completions)
# What one more attention call (its gathers, mask slice and kernel launch, forward and backward) is counted as,
# in scored (query, key) pairs: a rough figure, ~2 ms a call at ~60 ns a pair (torch.profiler on B7's learning
# pass, SmolLM2's 9 heads, 2 threads: 6.3 s of attention over 30 layers of ~3.5M pairs).
BUCKET_CALL_PAIRS = 32768
MAX_CUT_POINTS = 128  # _buckets considers at most this many cut points (its cost grows with their square)


@dataclass
class GroupedLayout:
    """Where each block's tokens sit in the packed rows (flat index = row * width + column)."""

    # Prompt queries, one entry per packed row, longest first (prompt_row: which row each entry is).
    prompt_index: torch.Tensor  # (R, Pq) flat positions of each entry's prompt queries, padded with 0
    prompt_valid: torch.Tensor  # (R, Pq) bool
    key_index: torch.Tensor  # (R, Pk) flat positions of the prompt keys each row sees (row order): shared prefix, own prompt
    key_valid: torch.Tensor  # (R, Pk) bool
    prompt_mask: torch.Tensor  # (R, 1, Pq, Pk) bool: causal over the valid prompt keys
    completion_index: torch.Tensor  # (C, T) flat positions of each completion's input tokens, padded
    completion_valid: torch.Tensor  # (C, T) bool
    completion_row: torch.Tensor  # (C,) the packed row (group) of each completion
    completion_mask: torch.Tensor  # (C, 1, T, Pk + T) bool: its row's prompt keys, then own tokens causally; causal form: empty
    output_source: torch.Tensor  # (R*L,) slot of [prompt outputs, completion outputs, zero] each position reads
    # The causal form (long completions, CAUSAL_FROM): completions [start, end) whose rows see `keys` prompt
    # keys, each run as one causal sequence [prompt keys, own tokens]; () = the masked form.
    causal_groups: tuple[tuple[int, int, int], ...] = ()
    prompt_row: torch.Tensor | None = None  # (R,) the packed row of each prompt entry (build_layout always sets it)
    # (start, end, width, first_row, causal): prompt entries [start, end) as one call of `width` queries; their rows
    # are first_row, first_row + 1, ... (-1: not consecutive); causal: they start at key 0 (queries = keys).
    prompt_buckets: tuple[tuple[int, int, int, int, bool], ...] = ()
    # (start, end, width): completions [start, end) (masked form: longest first) as one call of `width` queries.
    completion_buckets: tuple[tuple[int, int, int], ...] = ()

    def to(self, device) -> GroupedLayout:
        return GroupedLayout(*(getattr(self, f).to(device) if isinstance(getattr(self, f), torch.Tensor)
                               else getattr(self, f) for f in self.__dataclass_fields__))


def _buckets(widths: list[int], cost, call: int) -> list[tuple[int, int]]:
    """Cut `widths` (longest first) into consecutive buckets [start, end), each padded to its first (longest)
    member, minimizing the sum of cost(start, end) over buckets plus `call` a bucket. Exact (dynamic
    programming over the cut points); a bucket starts only where the width changes, and past MAX_CUT_POINTS
    such places only at every k-th of them (a coarser cut, still a valid one)."""
    count = len(widths)
    if count == 0:
        return []
    starts = [i for i in range(count) if i == 0 or widths[i] != widths[i - 1]]
    if len(starts) > MAX_CUT_POINTS:
        starts = starts[:: -(-len(starts) // MAX_CUT_POINTS)]
    best = {0: (0, -1)}  # end -> (cost of [0, end), start of its last bucket)
    for end in starts[1:] + [count]:
        best[end] = min((best[start][0] + cost(start, end) + call, start)
                        for start in starts if start < end)
    cuts, end = [], count
    while end > 0:
        start = best[end][1]
        cuts.append((start, end))
        end = start
    return cuts[::-1]


def build_layout(segments: torch.Tensor, causal_from: int | None = None,
                 bucket_pairs: int | None = None) -> GroupedLayout:
    """segments: (R, L) as in packing.block_mask: 0 = prompt, j > 0 = completion j, -1 = padding, and
    SHARED_SEGMENT (-2) = the prompts' common prefix, at the start of row 0 (kernels/shared_prefix.py).

    A row's prompt keys are the shared prefix's (row 0's) and then its own prompt's; its prompt queries
    are its own prompt tokens (row 0: the prefix's too), so the prefix is computed once.

    causal_from: completions padded to at least this many tokens take the causal form (see
    grouped_attention_forward); None = CAUSAL_FROM, 0 = always, a huge number = never.
    bucket_pairs: what one more attention call counts as, in scored (query, key) pairs (_buckets);
    None = BUCKET_CALL_PAIRS, a huge number = one call per batch (every member padded to the longest)."""
    call = BUCKET_CALL_PAIRS if bucket_pairs is None else bucket_pairs
    rows, width = segments.shape
    shared = (segments[0] == SHARED_SEGMENT).nonzero().flatten()  # flat positions of the prefix (row 0)
    queries, keys, offsets, completions, completion_rows = [], [], [], [], []
    for row in range(rows):
        base = row * width
        own = base + (segments[row] == 0).nonzero().flatten()
        keys.append(torch.cat([shared, own]))
        queries.append(keys[-1] if row == 0 else own)
        offsets.append(0 if row == 0 else shared.numel())  # key slot of the row's first query
        for segment in segments[row].unique().tolist():
            if segment > 0:  # a completion of one token has no input positions, hence no segment
                completions.append(base + (segments[row] == segment).nonzero().flatten())
                completion_rows.append(row)
    key_index, key_valid = _pad(keys)  # (R, Pk), row order: completions find their row's keys here
    key_counts = [int(k.numel()) for k in keys]
    key_length = key_index.shape[1]

    # Prompt entries longest first (stable), cut into buckets; a bucket of rows that start at key 0 is causal.
    prompt_order = sorted(range(rows), key=lambda row: -queries[row].numel())
    prompt_widths = [queries[row].numel() for row in prompt_order]
    starts_at_zero = [offsets[row] == 0 for row in prompt_order]

    def prompt_cost(start: int, end: int) -> int:
        width = prompt_widths[start]
        if all(starts_at_zero[start:end]):
            return (end - start) * width * (width + 1) // 2  # is_causal: the blocks past the diagonal are skipped
        return (end - start) * width * key_length

    prompt_buckets = []
    for start, end in _buckets(prompt_widths, prompt_cost, call):
        members = prompt_order[start:end]
        consecutive = members == list(range(members[0], members[0] + len(members)))
        prompt_buckets.append((start, end, max(prompt_widths[start], 1), members[0] if consecutive else -1,
                               all(starts_at_zero[start:end])))
    prompt_index, prompt_valid = _pad([queries[row] for row in prompt_order])  # (R, Pq)
    prompt_row = torch.tensor(prompt_order, dtype=torch.long)  # (R,)

    causal_groups: tuple[tuple[int, int, int], ...] = ()
    completion_buckets: list[tuple[int, int, int]] = []
    longest = max((c.numel() for c in completions), default=0)
    if completions and longest >= (CAUSAL_FROM if causal_from is None else causal_from):
        # Completions ordered by how many prompt keys their row sees (stable: a group's stay together), so
        # each count is one contiguous slice of the completion batch: one causal call per count.
        order = sorted(range(len(completions)), key=lambda i: key_counts[completion_rows[i]])
        completions = [completions[i] for i in order]
        completion_rows = [completion_rows[i] for i in order]
        groups: list[tuple[int, int, int]] = []
        for position, row in enumerate(completion_rows):
            if groups and groups[-1][2] == key_counts[row]:
                groups[-1] = (groups[-1][0], position + 1, key_counts[row])
            else:
                groups.append((position, position + 1, key_counts[row]))
        causal_groups = tuple(groups)
    elif completions:  # the masked form: longest first (stable), cut into buckets
        order = sorted(range(len(completions)), key=lambda i: -completions[i].numel())
        completions = [completions[i] for i in order]
        completion_rows = [completion_rows[i] for i in order]
        lengths = [c.numel() for c in completions]
        completion_buckets = [(start, end, lengths[start]) for start, end in _buckets(
            lengths, lambda start, end: (end - start) * lengths[start] * (key_length + lengths[start]), call)]
    completion_index, completion_valid = _pad(completions)  # (C, T)
    completion_row = torch.tensor(completion_rows, dtype=torch.long)  # (C,)

    query_length = prompt_index.shape[1]
    completion_length = completion_index.shape[1]
    query_slot = torch.arange(query_length)[None, :, None] + torch.tensor(
        [offsets[row] for row in prompt_order])[:, None, None]  # (R, Pq, 1)
    key_slot = torch.arange(key_length)[None, None, :]  # (1, 1, Pk)
    prompt_mask = (key_slot <= query_slot) & key_valid[prompt_row][:, None, :]  # (R, Pq, Pk)
    prompt_mask |= ~prompt_valid[:, :, None] & (key_slot == 0)  # padded queries see one real key: never NaN
    if causal_groups:  # no mask: _causal_completions runs each slice under is_causal
        completion_mask = torch.ones(0, 0, 0, dtype=torch.bool)
    else:
        causal_own = torch.ones(completion_length, completion_length, dtype=torch.bool).tril()
        own = causal_own & completion_valid[:, None, :]  # (C, T, T)
        sees_prompt = key_valid[completion_row][:, None, :].expand(-1, completion_length, -1)  # (C, T, Pk)
        completion_mask = torch.cat([sees_prompt, own], dim=2)  # (C, T, Pk + T)

    # Output slots: each bucket's outputs (members x width, member-major), prompts' then completions', then
    # one zero slot that padding positions read.
    def slots(shape: tuple[int, int], buckets, base: int) -> tuple[torch.Tensor, int]:
        slot = torch.zeros(shape, dtype=torch.long)
        for start, end, bucket_width in buckets:
            count = (end - start) * bucket_width
            slot[start:end, :bucket_width] = base + torch.arange(count).view(end - start, bucket_width)
            base += count
        return slot, base

    prompt_slot, used = slots(tuple(prompt_index.shape), [b[:3] for b in prompt_buckets], 0)
    completion_slot, used = slots(tuple(completion_index.shape), completion_buckets if not causal_groups
                                  else [(0, len(completions), completion_length)] if completions else [], used)
    output_source = torch.full((rows * width,), used, dtype=torch.long)
    output_source[prompt_index[prompt_valid]] = prompt_slot[prompt_valid]
    output_source[completion_index[completion_valid]] = completion_slot[completion_valid]
    return GroupedLayout(prompt_index, prompt_valid, key_index, key_valid, prompt_mask[:, None], completion_index,
                         completion_valid, completion_row, completion_mask[:, None], output_source, causal_groups,
                         prompt_row, tuple(prompt_buckets), tuple(completion_buckets))


def _pad(pieces: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max((p.numel() for p in pieces), default=0) or 1
    index = torch.zeros(len(pieces), length, dtype=torch.long)
    valid = torch.zeros(len(pieces), length, dtype=torch.bool)
    for i, piece in enumerate(pieces):
        index[i, : piece.numel()] = piece
        valid[i, : piece.numel()] = True
    return index, valid


class _Rows(torch.autograd.Function):
    """source[index] along dim 0 (index of any shape), with index_add_ as its backward.

    Autograd's backward of source[index] is an accumulating index_put, which
    torch 2.13 runs serially on the CPU, a visible part of a learning pass under
    torch.profiler. index_add_ does the same sum over the rows, vectorized.
    """

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.num_rows = source.shape[0]
        return source.index_select(0, index.reshape(-1)).view(*index.shape, *source.shape[1:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        rest = grad.shape[index.dim():]
        out = grad.new_zeros((ctx.num_rows, *rest))
        return out.index_add_(0, index.reshape(-1), grad.reshape(-1, *rest)), None


def take_rows(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """source[index] on dim 0, differentiable, with a fast CPU backward (_Rows)."""
    return _Rows.apply(source, index)


def grouped_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, hasten_layout: GroupedLayout | None = None,
                              **kwargs):
    """transformers' attention-function signature; query (B, H, L, D), key/value (B, Hkv, L, D)."""
    if hasten_layout is None:  # called outside a packed pass: the dense masked kernel
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layout = hasten_layout
    batch, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    flat_q = query.transpose(1, 2).reshape(batch * length, heads, dim)  # (B*L, H, D)
    flat_k = key.transpose(1, 2).reshape(batch * length, kv_heads, dim)  # (B*L, Hkv, D)
    flat_v = value.transpose(1, 2).reshape(batch * length, kv_heads, dim)
    gqa = heads != kv_heads

    def gather(flat, index):  # (n, l) positions -> (n, heads, l, D)
        return take_rows(flat, index).transpose(1, 2)

    prompt_k, prompt_v = gather(flat_k, layout.key_index), gather(flat_v, layout.key_index)  # (R, Hkv, Pk, D)
    pieces = []  # (slots, H, D) each, in output_source's slot order
    for start, end, width, first_row, causal in layout.prompt_buckets:
        if first_row >= 0:  # consecutive rows: a view of the keys, no copy
            k, v = prompt_k[first_row:first_row + end - start], prompt_v[first_row:first_row + end - start]
        else:
            k, v = take_rows(prompt_k, layout.prompt_row[start:end]), take_rows(prompt_v, layout.prompt_row[start:end])
        q = gather(flat_q, layout.prompt_index[start:end, :width])  # (n, H, width, D)
        if causal:  # these rows' queries are their keys, from key 0: plain causal attention over `width` keys
            out = attention(q, k[:, :, :width], v[:, :, :width], is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            out = attention(q, k, v, attn_mask=layout.prompt_mask[start:end, :, :width], scale=scaling,
                            enable_gqa=gqa)
        pieces.append(out.transpose(1, 2).reshape(-1, heads, dim))  # (n*width, H, D)
    if layout.causal_groups:
        own_q = gather(flat_q, layout.completion_index)  # (C, H, T, D)
        own_k = gather(flat_k, layout.completion_index)  # (C, Hkv, T, D)
        own_v = gather(flat_v, layout.completion_index)
        completion_out = _causal_completions(layout, own_q, own_k, own_v, prompt_k, prompt_v, scaling, gqa)
        pieces.append(completion_out.transpose(1, 2).reshape(-1, heads, dim))  # (C*T, H, D)
    for start, end, width in layout.completion_buckets:  # the masked form
        index, rows = layout.completion_index[start:end, :width], layout.completion_row[start:end]
        out = attention(
            gather(flat_q, index),  # (n, H, width, D)
            torch.cat([take_rows(prompt_k, rows), gather(flat_k, index)], dim=2),  # (n, Hkv, Pk + width, D)
            torch.cat([take_rows(prompt_v, rows), gather(flat_v, index)], dim=2),
            attn_mask=layout.completion_mask[start:end, :, :width, :prompt_k.shape[2] + width],
            scale=scaling, enable_gqa=gqa,
        )  # (n, H, width, D)
        pieces.append(out.transpose(1, 2).reshape(-1, heads, dim))
    dtype = pieces[0].dtype
    pieces = [piece.to(dtype) for piece in pieces]
    pieces.append(pieces[0].new_zeros(1, heads, dim))  # what padding positions read (never used downstream)
    # Every packed position reads its slot of [prompt outputs, completion outputs, zeros]: one gather.
    out = take_rows(torch.cat(pieces), layout.output_source)  # (B*L, H, D)
    return out.view(batch, length, heads, dim), None  # (B, L, H, D), as transformers' sdpa returns




def keep_out_of_graphs() -> None:
    """speed.compile compiles each decoder layer, and grouped_attention_forward runs inside one. Its loops walk
    the step's layout (the bucket tuples change every step), so a traced copy would be specialized to one
    step's buckets and Dynamo would recompile per step until its limit, then run the whole layer eager. Kept
    out of the graph on purpose: the layer's projections, norms and MLP compile around it, once. Done when
    compiling (kernels/compile.py), not at import: torch.compiler.disable imports Dynamo, seconds of startup
    a run that never compiles should not pay. Callers look the function up at each call (models/llama.py)."""
    global grouped_attention_forward
    if not getattr(grouped_attention_forward, "hasten_out_of_graphs", False):
        grouped_attention_forward = torch.compiler.disable(grouped_attention_forward)
        grouped_attention_forward.hasten_out_of_graphs = True

def _causal_completions(layout: GroupedLayout, own_q, own_k, own_v, prompt_k, prompt_v, scaling, gqa):
    """The completions' attention as causal sequences: per slice [start, end) whose rows see p prompt keys,
    keys [p prompt keys, own T] and queries [p zeros, own T] under is_causal, outputs of the last T kept.

    Own query t (slot p + t) then sees exactly what the masked form allows: the p prompt keys and own keys
    up to t; a padded own slot sits after every real one, so no real query sees it. With no mask the CPU
    kernel runs flash-style: key blocks past the diagonal are skipped and no (T, P + T) score or mask
    tensor is made, where the masked form scores every pair and reads a float mask of that size. The p
    zero queries cost p of the sequence's P + T rows; their outputs are dropped (no gradient)."""
    pieces = []
    for start, end, keys in layout.causal_groups:
        rows = layout.completion_row[start:end]
        q = own_q[start:end]
        q = torch.cat([q.new_zeros(q.shape[0], q.shape[1], keys, q.shape[3]), q], dim=2)  # (c, H, p + T, D)
        k = torch.cat([take_rows(prompt_k, rows)[:, :, :keys], own_k[start:end]], dim=2)  # (c, Hkv, p + T, D)
        v = torch.cat([take_rows(prompt_v, rows)[:, :, :keys], own_v[start:end]], dim=2)
        pieces.append(attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)[:, :, keys:])
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # (C, H, T, D)


def supported(model) -> bool:
    """True when the model picks attention by name from transformers' AttentionInterface."""
    config = getattr(model, "config", None)
    return config is not None and getattr(config, "_attn_implementation", None) in ("sdpa", "eager", NAME)


@contextlib.contextmanager
def grouped_attention(model):
    """Run the block with the model's attention switched to grouped_attention_forward."""
    if not getattr(model.config, "hasten_native", False):  # models/llama.py looks the name up itself
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, grouped_attention_forward)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
