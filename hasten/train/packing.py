"""Shared-prefix packed learning pass (speed.packed_learning).

The plain pass (logprobs.py) runs every sample as prompt + completion, padded
to the longest: a group of G samples encodes its prompt G times, and padding
costs as much as real tokens. Here each group becomes one packed row:

    [prompt][completion 1][completion 2] ... [completion G]

with a block attention mask (the PrefixGrouper idea): prompt tokens attend
causally to the prompt; completion j attends to the whole prompt and
causally to itself, never to another completion. Positions restart after
the prompt for every completion, so each completion sees exactly the
positions and keys it saw when it was sampled. The result equals the plain
pass up to float rounding (tests/test_packing.py, 1e-4 in fp32).

More savings come with it:
- with grouped attention (speed.grouped_attention) the rows are not padded
  to the longest: all their real tokens run as one row (without_padding),
  and the prompts' common prefix is held once (speed.shared_prefix,
  kernels/shared_prefix.py);
- a completion's last token is only ever a target, never an input, so it is
  left out of the row;
- logits are computed only at positions that predict a completion token, in
  chunks of at most speed.logit_chunk_tokens rows of the (tokens x vocab)
  matrix (fewer for a large vocabulary, cut evenly: even_step),
  each chunk recomputed in backward (checkpointed) so the whole matrix never
  exists at once.

This path needs a model whose attention accepts a ready-made 4D boolean
mask, as transformers' decoders built on masking_utils do (Llama, Qwen,
Mistral, ...); for anything else set speed.packed_learning=false.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ..kernels import fast_linear
from ..kernels.grouped_attention import SHARED_SEGMENT, GroupedLayout, build_layout, grouped_attention, supported
from ..kernels.shared_prefix import common_prefix
from ..rollout import Rollout
from . import distributed
from .logprobs import TokenStats
from .microbatch import effective_logit_chunk

PAD_SEGMENT = -1


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (R, L) one row per group present in the chunk
    position_ids: torch.Tensor  # (R, L)
    source_row: torch.Tensor  # (M,) row of the position that predicts each completion token
    source_position: torch.Tensor  # (M,) its column
    targets: torch.Tensor  # (M,) the completion token predicted there
    sample: torch.Tensor  # (M,) chunk-local sample index of each target
    column: torch.Tensor  # (M,) its column in the completion tensors
    segments: torch.Tensor  # (R, L) 0 = prompt, j > 0 = completion j, -1 = padding, -2 = shared prefix (row 0)
    shared: int = 0  # tokens of the prompts' common prefix held once, in row 0 (speed.shared_prefix)


def block_mask(segments: torch.Tensor) -> torch.Tensor:
    """segments: (R, L), 0 = shared prompt, j > 0 = completion j, -1 = padding -> (R, 1, L, L).

    A shared prefix (-2, row 0) is part of row 0's prompt here; the other rows cannot see it through a
    per-row mask, so a pack with one runs grouped attention only (packed_logprobs)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L)
    query, key = segments[:, :, None], segments[:, None, :]  # (R, L, 1), (R, 1, L)
    prompt_key = (key == 0) | (key == SHARED_SEGMENT)
    allowed = causal & (prompt_key | (key == query)) & (query != PAD_SEGMENT) & (key != PAD_SEGMENT)
    allowed |= torch.eye(length, dtype=torch.bool)  # padding rows attend to themselves, never NaN
    return allowed[:, None]


def pack(rollout: Rollout, rows: torch.Tensor, share_prefix: bool = False) -> PackedBatch:
    """Pack the samples `rows` (indices into the rollout) into one row per prompt.

    share_prefix (speed.shared_prefix, grouped attention only): the prompts' common prefix is held once,
    at the start of row 0 (segment -2); the other rows start with the rest of their prompt, at the
    positions those tokens have after the prefix."""
    # Packing is host-side bookkeeping over small integer tensors: it reads CPU copies of a rollout
    # that may live on the GPU (no copies on a CPU run); packed_logprobs moves the result to the model.
    prompt_ids, prompt_mask = rollout.prompt_ids.cpu(), rollout.prompt_mask.cpu()
    completion_ids, lengths = rollout.completion_ids.cpu(), rollout.completion_mask.sum(dim=1).cpu()  # (N,)
    rows = rows.cpu()
    groups: dict[int, list[int]] = {}
    for local, sample in enumerate(rows.tolist()):
        groups.setdefault(sample // rollout.num_generations, []).append(local)
    prompts = {index: prompt_ids[index][prompt_mask[index].bool()] for index in groups}
    shared = common_prefix(list(prompts.values())) if share_prefix else 0
    sequences, positions, segments = [], [], []
    sources: list[tuple[int, int, int, int, int]] = []  # (row, position, target, sample, column)
    for row, (prompt_index, members) in enumerate(groups.items()):
        prompt = prompts[prompt_index]
        prompt_length = prompt.numel()
        start = 0 if row == 0 else shared  # rows after the first leave the shared prefix to row 0
        segment_ids = torch.zeros(prompt_length - start)
        segment_ids[: shared - start] = SHARED_SEGMENT  # row 0's first `shared` tokens (none elsewhere)
        pieces, position_pieces, segment_pieces = [prompt[start:]], [torch.arange(start, prompt_length)], [segment_ids]
        offset = prompt_length - start  # the row's column after its prompt tokens
        for segment, local in enumerate(members, start=1):
            sample = int(rows[local])
            length = int(lengths[sample])
            completion = completion_ids[sample, :length]
            inputs = completion[:-1]  # the last token is only a target
            pieces.append(inputs)
            position_pieces.append(torch.arange(prompt_length, prompt_length + inputs.numel()))
            segment_pieces.append(torch.full((inputs.numel(),), float(segment)))
            for column in range(length):
                position = prompt_length - start - 1 if column == 0 else offset + column - 1
                sources.append((row, position, int(completion[column]), local, column))
            offset += inputs.numel()
        sequences.append(torch.cat(pieces))
        positions.append(torch.cat(position_pieces))
        segments.append(torch.cat(segment_pieces).long())
    width = max(s.numel() for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    position_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    segment_ids = torch.full((len(sequences), width), PAD_SEGMENT, dtype=torch.long)
    for row, (ids, pos, seg) in enumerate(zip(sequences, positions, segments)):
        input_ids[row, : ids.numel()] = ids
        position_ids[row, : pos.numel()] = pos
        segment_ids[row, : seg.numel()] = seg
    source = torch.tensor(sources, dtype=torch.long).reshape(-1, 5)  # (M, 5)
    return PackedBatch(input_ids, position_ids, *source.unbind(dim=1), segment_ids, shared)


def without_padding(packed: PackedBatch, layout: GroupedLayout) -> tuple[PackedBatch, GroupedLayout]:
    """Grouped attention finds every block by index, so the rows need not be rows: the real tokens of all
    of them become one row of exactly that many tokens. The padding that evened the rows out (the longest
    group sets the width, and with a shared prefix row 0 is longer by it) is not computed at all."""
    rows, width = packed.segments.shape
    real = (packed.segments != PAD_SEGMENT).flatten()  # (R*L,)
    tokens = int(real.sum())
    compact = torch.zeros(rows * width, dtype=torch.long)  # padded flat position -> its place in the one row
    compact[real] = torch.arange(tokens)  # a padding slot maps to 0: the layout masks what it reads there
    layout = dataclasses.replace(
        layout, prompt_index=compact[layout.prompt_index], key_index=compact[layout.key_index],
        completion_index=compact[layout.completion_index], output_source=layout.output_source[real])
    source = compact[packed.source_row * width + packed.source_position]  # (M,)
    packed = dataclasses.replace(
        packed, input_ids=packed.input_ids.flatten()[real][None], position_ids=packed.position_ids.flatten()[real][None],
        source_row=torch.zeros_like(source), source_position=source)
    return packed, layout


def backbone_and_head(model):
    """(decoder stack, lm_head) of a causal LM, looking through a peft wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


ENTROPY_BLOCK_BYTES = 8 << 20  # consume mode's scratch for the entropy: (rows, V) fp32 blocks of about this size


class TargetLogSoftmax(torch.autograd.Function):
    """log softmax(logits / T)[target] and, optionally, the entropy, in few passes over (chunk, V).

    The plain formulation (logprobs.py) walks the (tokens x vocab) matrix about
    ten times between forward, entropy and backward (divide, logsumexp, its
    exp again in backward, gather's zero-filled gradient, ...). Here the
    softmax is formed once, in place in one (chunk, V) buffer, and kept for
    backward, where the gradient is one pass: (onehot(target) - softmax) * grad / T.
    The entropy comes from the same softmax and the shifted logits (H = log sum
    exp(z - max) - sum p * (z - max)), formed in row blocks of ENTROPY_BLOCK_BYTES.
    It is differentiated only when asked (entropy_grad: the entropy bonus,
    algo.entropy_coef): dH/dz = -p (log p + H), from p * (z - max), which the
    entropy's sum already formed and is then kept too.

    The buffer is a copy of the logits, or with consume=True (the packed pass,
    which owns its logits) the logits' own buffer, which then also becomes the
    gradient in backward: a chunk costs one (chunk, V) tensor, not two. consume
    returns the buffer as a third, non-differentiable output (autograd's rule
    for an input changed in place); its contents are undefined to the caller.
    The values are the same bit for bit either way (tested); a second backward
    through a consumed graph raises autograd's in-place error instead of reading
    the overwritten softmax. With entropy_grad, consume is ignored.
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, with_entropy: bool, entropy_grad: bool = False,
                consume: bool = False):
        entropy_grad = entropy_grad and with_entropy
        consume = consume and not entropy_grad
        full = logits.dtype in (torch.float32, torch.float64)
        own = consume and full
        # the buffer, overwritten from here on: the logits themselves, or their copy (fp32 for bf16 logits)
        scaled = logits if own else logits.clone() if full else logits.float()
        if temperature != 1.0:
            scaled.div_(temperature)
        logits_at_targets = scaled.gather(-1, targets[:, None]).squeeze(-1)  # (chunk,) before the shift
        peak = scaled.amax(dim=-1, keepdim=True)  # (chunk, 1)
        entropy = logits_at_targets.new_empty(0)
        weighted = None  # p * (z - peak), kept for the entropy's gradient
        if with_entropy:
            # H = log(total) - sum p * (z - peak), on the shifted logits and with sum's pairwise
            # reduction: `logsumexp - einsum(p, z)` cancels two ~20-nat numbers and its dot
            # accumulates 49k terms in a row, which was 2-5e-3 nats off in fp32 on SmolLM2's vocabulary.
            rows, vocab = scaled.shape
            total = scaled.new_empty(rows, 1)
            entropy = scaled.new_empty(rows)
            weighted = torch.empty_like(scaled) if entropy_grad else None
            step = max(1, ENTROPY_BLOCK_BYTES // (vocab * scaled.element_size()))
            for start in range(0, rows, step):
                block = slice(start, start + step)
                shifted = scaled[block].sub_(peak[block])  # (block, V) view
                probs = shifted.exp()
                total[block] = probs.sum(dim=-1, keepdim=True)
                probs.div_(total[block])
                products = shifted.mul_(probs)
                entropy[block] = total[block].log().squeeze(-1) - products.sum(dim=-1)
                if weighted is not None:
                    weighted[block] = products
                shifted.copy_(probs)
        else:
            scaled.sub_(peak).exp_()
            total = scaled.sum(dim=-1, keepdim=True)
            scaled.div_(total)
        probs = scaled  # the softmax
        logps = logits_at_targets - (peak + total.log()).squeeze(-1)
        ctx.temperature = temperature
        ctx.logits_dtype = logits.dtype
        ctx.entropy_grad = entropy_grad
        ctx.consume = consume
        if entropy_grad:
            ctx.save_for_backward(probs, targets, weighted, total.log().squeeze(-1) - entropy)
            return logps, entropy
        ctx.save_for_backward(probs, targets)
        ctx.mark_non_differentiable(entropy)
        if not consume:
            return logps, entropy
        ctx.set_materialize_grads(False)  # else backward gets a (chunk, V) tensor of zeros for the buffer
        buffer = logits if own else logits.new_empty(0)
        if own:
            ctx.mark_dirty(logits)
        ctx.mark_non_differentiable(buffer)
        return logps, entropy, buffer

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy, *unused):
        if ctx.entropy_grad:
            probs, targets, weighted, offset = ctx.saved_tensors  # offset = log(total) - H, (chunk,)
        else:
            probs, targets = ctx.saved_tensors
        if grad_logps is None:  # consume: nothing used the log-probs (gradients are not materialized there)
            return None, None, None, None, None, None
        # consume: the softmax is not read again, so the gradient takes its buffer
        grad = probs.mul_(-grad_logps[:, None]) if ctx.consume else probs * -grad_logps[:, None]  # (chunk, V)
        grad.scatter_add_(-1, targets[:, None], grad_logps[:, None])
        if ctx.entropy_grad and grad_entropy is not None:
            # dH/dz = -p (log p + H) = -(p (z - peak)) + p (log(total) - H)
            grad.add_((probs * offset[:, None] - weighted) * grad_entropy[:, None])
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


class _HeadAsItRan:
    """Calls `head` with its hooks and the forwards it and its submodules had when this was made.

    A kernel switch (kernels.fast_linear, kernels.recast_linear) routes a Linear by setting an instance
    `forward` and deletes it afterwards; a checkpointed chunk recomputed in backward must run through the
    same kernels, and through the modules' hooks (peft, test fixtures), so the instance forwards are put
    back for the call only. Submodules too: a peft-wrapped head (LoRA on lm_head, modules_to_save) holds
    the routed nn.Linear inside it.
    """

    def __init__(self, head):
        self.head = head
        self.forwards = [(module, vars(module).get("forward")) for module in head.modules()]

    def __call__(self, hidden):
        now = [(module, vars(module).get("forward")) for module, _ in self.forwards]
        if all(current is then for (_, current), (_, then) in zip(now, self.forwards)):
            return self.head(hidden)
        _set_forwards(self.forwards)
        try:
            return self.head(hidden)
        finally:
            _set_forwards(now)


def _set_forwards(forwards) -> None:
    """Give each module the instance forward listed (None: its class's own)."""
    for module, forward in forwards:
        if forward is None:
            vars(module).pop("forward", None)
        else:
            module.forward = forward


class HeadGradInPlace(torch.autograd.Function):
    """logits = head(hidden) for a plain fp32 nn.Linear head; backward adds the head's weight (and bias)
    gradient straight into their `.grad` instead of returning it to autograd.

    Autograd sums a parameter's gradients over its uses in one backward in a buffer of its own, then adds that
    to `.grad`: with the logits in chunks, a chunk's (V, H) weight gradient and the running sum lived beside
    `.grad` at the learning pass's peak (2 x 519 MiB at Qwen2.5-0.5B's vocabulary). Here each chunk's product
    is accumulated into `.grad` by one addmm: the same sum in another order, equal to fp32 rounding
    (tests/test_packing.py). The hidden state's gradient is the product the head's own kernel gives (oneDNN's
    where the head is routed there: onednn), so the body's gradients are autograd's bits. A tied embedding's
    own gradient still reaches `.grad` through autograd, in place. `head_call` runs the head as it runs now
    (its routed kernel, its fp32 forward). The learner's plain `.backward()` is assumed: a
    `torch.autograd.grad` or `backward(inputs=...)` through the packed pass would still write the head's `.grad`.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head_call, head: torch.nn.Linear, onednn: bool) -> torch.Tensor:
        ctx.save_for_backward(hidden)
        ctx.head, ctx.onednn = head, onednn
        return head_call(hidden)  # (chunk, V) fp32

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        head = ctx.head
        flat = hidden.reshape(-1, hidden.shape[-1]).float()  # (chunk, H)
        grad = grad.reshape(-1, grad.shape[-1]).contiguous()  # (chunk, V)
        with torch.no_grad():
            if head.weight.grad is None:
                head.weight.grad = grad.t().mm(flat)
            else:
                head.weight.grad.addmm_(grad.t(), flat)
            if head.bias is not None and head.bias.requires_grad:
                if head.bias.grad is None:
                    head.bias.grad = grad.sum(0)
                else:
                    head.bias.grad.add_(grad.sum(0))
            if ctx.onednn:  # OneDNNLinear's input gradient, the same kernel on the same operands
                grad_hidden = fast_linear._onednn(grad, fast_linear._transposed(head.weight))
            else:
                grad_hidden = grad.mm(head.weight)
        return grad_hidden.view(hidden.shape).to(hidden.dtype), None, None, None


def head_grad_in_place(head: torch.nn.Module, hidden: torch.Tensor) -> bool:
    """Whether the packed pass's head runs through HeadGradInPlace: a plain nn.Linear with an fp32 weight that
    learns, fp32 logits (no autocast, or precision.fp32_head's forward), a hidden state with a gradient, no
    module hooks (they would run without autograd) and no gradient hooks on its weight or bias (autograd
    would not call them: the Function writes `.grad` itself), one process (DDP and FSDP reduce gradients from
    autograd's hooks; sharded parameters) and not under torch.compile."""
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    if type(head) is not torch.nn.Linear:
        return False
    fp32_logits = (not torch.is_autocast_enabled(hidden.device.type)
                   or getattr(vars(head).get("forward"), "fp32_logits", False))
    hooks = (head._forward_hooks, head._forward_pre_hooks, head._backward_hooks, head._backward_pre_hooks)
    gradient_hooks = [getattr(parameter, name, None) for parameter in (weight, bias) if parameter is not None
                      for name in ("_backward_hooks", "_post_accumulate_grad_hooks")]
    return (torch.is_grad_enabled() and hidden.requires_grad
            and weight.requires_grad and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and fp32_logits and not any(hooks)
            and not any(gradient_hooks) and distributed.world_size() == 1
            and type(weight) is torch.nn.Parameter and not torch.compiler.is_compiling())


def head_on_onednn(head: torch.nn.Module) -> bool:
    """Whether the head's forward now runs oneDNN's product: routed by kernels.fast_linear, or precision.fp32_head's
    forward with its oneDNN route."""
    forward = vars(head).get("forward")
    routed = isinstance(forward, functools.partial) and forward.func is fast_linear._forward
    return routed or bool(getattr(forward, "onednn", False))


def even_step(count: int, cap: int) -> int:
    """Chunk length for `count` targets in chunks of at most `cap` (0: one chunk): as few chunks as the cap
    allows, cut evenly. The largest chunk's (chunk, vocabulary) buffer sets the head's share of the learning
    pass's peak: at Qwen2.5's 883-token cap a 1,024-target micro-batch is two chunks of 512, not 883 + 141."""
    if cap <= 0 or count <= cap:
        return max(count, 1)
    return -(-count // -(-count // cap))


def _chunk_logprobs(head, hidden, targets, temperature: float, with_entropy: bool, entropy_grad: bool = False,
                    in_place: tuple[torch.nn.Linear, bool] | None = None):
    """(log-prob of each target (chunk,), entropy (chunk,) or an empty tensor).

    The head's output is this call's own, so its buffer becomes the softmax (TargetLogSoftmax's consume), unless
    the head returned a view, which autograd does not let a Function change in place (same values either way).
    in_place: (the head module, whether it runs on oneDNN): HeadGradInPlace accumulates its weight gradient into
    .grad (head_grad_in_place)."""
    logits = head(hidden) if in_place is None else HeadGradInPlace.apply(hidden, head, *in_place)
    return TargetLogSoftmax.apply(logits, targets, temperature, with_entropy, entropy_grad, not logits._is_view())[:2]


def packed_logprobs(
    model,
    rollout: Rollout,
    rows: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    grouped: bool = False,
    shared_prefix: bool = False,
    entropy_grad: bool = False,
) -> TokenStats:
    """Same result as logprobs.completion_logprobs on the same samples, from a packed pass.

    entropy_grad: the entropy has a gradient (the entropy bonus); else it is detached.

    grouped (speed.grouped_attention): attention on the allowed blocks only
    (grouped_attention.py) instead of the dense kernel under the block mask.
    shared_prefix (speed.shared_prefix, with grouped attention only): the prompts' common prefix once.
    """
    backbone, head = backbone_and_head(model)
    grouped = grouped and supported(backbone)
    packed = pack(rollout, rows, share_prefix=shared_prefix and grouped)
    device = head.weight.device
    extra, attention = {}, contextlib.nullcontext()
    if grouped:
        packed, layout = without_padding(packed, build_layout(packed.segments))
        extra["hasten_layout"] = layout.to(device)
        attention = grouped_attention(backbone)
        # grouped attention ignores the mask: a placeholder of the right shape, which every model path
        # takes as is (a 4D mask), so no (L, L) block mask is built for nothing
        tokens = packed.input_ids.shape[1]
        mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(1, 1, tokens, tokens)
    else:
        mask = block_mask(packed.segments).to(device)  # (R, 1, L, L)
    with attention:
        hidden = backbone(
            input_ids=packed.input_ids.to(device),
            attention_mask=mask,
            position_ids=packed.position_ids.to(device),
            **extra,
        ).last_hidden_state  # (R, L, H); grouped: (1, tokens, H)
    hidden = hidden[packed.source_row.to(device), packed.source_position.to(device)]  # (M, H)
    targets = packed.targets.to(device)
    chunk_tokens = effective_logit_chunk(chunk_tokens, head.weight.shape[0])  # bounded in bytes for large vocabularies
    step = even_step(hidden.shape[0], chunk_tokens)
    # One chunk holds everything: nothing to save by recomputing it in backward.
    recompute = torch.is_grad_enabled() and step < hidden.shape[0]
    # The head as it runs now: backward recomputes a chunk after a kernel switch that routes it
    # (kernels.fast_linear) may have been undone, and checkpoint rejects a recompute that saves other tensors.
    head_forward = _HeadAsItRan(head)
    # decided once: a recomputed chunk must take the same path as its forward did
    in_place = (head, head_on_onednn(head)) if head_grad_in_place(head, hidden) else None
    pieces, entropies = [], []
    for start in range(0, hidden.shape[0], step):
        args = (head_forward, hidden[start:start + step], targets[start:start + step], temperature, with_entropy,
                entropy_grad, in_place)
        if recompute:
            logps, entropy = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logps, entropy = _chunk_logprobs(*args)
        pieces.append(logps)
        entropies.append(entropy)
    flat = torch.cat(pieces)  # (M,)
    shape = (rows.numel(), rollout.completion_ids.shape[1])
    index = (packed.sample.to(device), packed.column.to(device))
    logps = torch.zeros(shape, device=device, dtype=flat.dtype).index_put(index, flat)  # (n, T)
    entropy = None
    if with_entropy:
        flat_entropy = torch.cat(entropies)  # (M,)
        entropy = torch.zeros(shape, device=device, dtype=flat_entropy.dtype).index_put(index, flat_entropy)
    return TokenStats(logps=logps, entropy=entropy)

# speed.min_pack_ratio: the packed pass puts each group in one row; rows of very different lengths pad to
# the longest. Below the ratio of real tokens to row slots the plain padded pass runs that chunk instead.
def pack_ratio(rollout: Rollout, rows: torch.Tensor) -> float:
    """Real tokens / slots of the packed batch for samples `rows` (one row per group, as packing.py)."""
    lengths = rollout.completion_mask.sum(dim=1).tolist()  # (N,): one transfer each, not one per sample
    prompts = rollout.prompt_mask.sum(dim=1).tolist()  # (B,)
    row_lengths: dict[int, int] = {}
    for sample in rows.tolist():
        group = sample // rollout.num_generations
        # the prompt once, then each completion without its last token (only a target)
        row_lengths.setdefault(group, prompts[group])
        row_lengths[group] += max(lengths[sample] - 1, 0)
    if not row_lengths:
        return 1.0
    return sum(row_lengths.values()) / (len(row_lengths) * max(row_lengths.values()))
