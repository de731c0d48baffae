"""The shared-prefix packed learning pass equals the plain padded pass:
log-probs within 1e-4 (fp32), entropies, gradients, and the learner's loss."""

from __future__ import annotations


import pytest
import torch

from conftest import learner_step, rollout_of
from hasten.algo import group_advantages
from hasten.train.logprobs import completion_logprobs
from hasten.train.packing import block_mask, pack, packed_logprobs


def plain(model, rollout, rows, temperature=1.0, with_entropy=False):
    group = rows // rollout.num_generations
    return completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                               rollout.completion_ids[rows], rollout.completion_mask[rows],
                               temperature, with_entropy)


def test_block_mask_shape_of_attention():
    # prompt of 2, completion 1 of 2 tokens, completion 2 of 1 token, one pad
    segments = torch.tensor([[0, 0, 1, 1, 2, -1]])
    allowed = block_mask(segments)[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # completion 2 sees the prompt, not completion 1
        [0, 0, 0, 0, 0, 1],  # padding sees only itself
    ]


def test_pack_drops_last_tokens_and_restarts_positions(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=3)
    packed = pack(rollout, torch.arange(3))  # the first group only
    prompt_length = int(rollout.prompt_mask[0].sum())
    lengths = rollout.completion_lengths[:3].tolist()
    assert packed.input_ids.shape == (1, prompt_length + sum(lengths) - 3)
    assert packed.targets.numel() == sum(lengths)
    positions = packed.position_ids[0].tolist()
    assert positions[:prompt_length] == list(range(prompt_length))
    assert positions[prompt_length:prompt_length + lengths[0] - 1] == list(
        range(prompt_length, prompt_length + lengths[0] - 1))


@pytest.mark.parametrize("chunk_tokens", [0, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_packed_logprobs_and_entropy_equal_plain(short_model, tokenizer, chunk_tokens, temperature):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    rows = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        expected = plain(short_model, rollout, rows, temperature, with_entropy=True)
        packed = packed_logprobs(short_model, rollout, rows, temperature, True, chunk_tokens)
    assert (expected.logps - packed.logps)[mask].abs().max() < 1e-4
    assert (expected.entropy - packed.entropy)[mask].abs().max() < 1e-4
    assert packed.logps[~mask].eq(0).all()


def test_packed_gradients_equal_plain_on_a_subset(short_model, tokenizer):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    rows = torch.tensor([1, 2, 5, 9, 10])  # partial groups, out of group order
    weights = torch.randn(rollout.completion_ids[rows].shape)

    def gradients(function):
        short_model.zero_grad()
        logps = function().logps
        (logps * weights * rollout.completion_mask[rows]).sum().backward()
        return [p.grad.clone() for p in short_model.parameters()]

    expected = gradients(lambda: plain(short_model, rollout, rows))
    packed = gradients(lambda: packed_logprobs(short_model, rollout, rows, 1.0, False, 5))
    for a, b in zip(expected, packed):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo"])
def test_learner_gradients_are_the_same_with_and_without_packing(short_model, tokenizer, loss):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    advantages = group_advantages(torch.randn(rollout.num_samples), 4)
    def configure(packed):
        def apply(cfg):
            cfg.algo.loss = loss
            cfg.train.lr = 1e-2
            cfg.train.gradient_accumulation_steps = 2
            cfg.speed.packed_learning = packed
        return apply

    results = [learner_step(short_model, tokenizer, rollout, advantages, configure(p)) for p in (False, True)]
    (plain_metrics, plain_grads), (packed_metrics, packed_grads) = results
    assert plain_metrics["loss"] == pytest.approx(packed_metrics["loss"], abs=1e-5)
    assert plain_metrics["grad_norm"] == pytest.approx(packed_metrics["grad_norm"], rel=1e-4)
    assert len(plain_grads) == len(packed_grads) > 0
    for a, b in zip(plain_grads, packed_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.fixture(params=["masked", "causal"])
def completion_form(request, monkeypatch):
    """Both forms of the completions' grouped attention: the (T, P + T) mask, and the causal sequences
    [prompt keys, own tokens] that long completions take (CAUSAL_FROM)."""
    from hasten.kernels import grouped_attention

    monkeypatch.setattr(grouped_attention, "CAUSAL_FROM", 0 if request.param == "causal" else 10**9)
    return request.param


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_grouped_attention_equals_plain(short_model, tokenizer, temperature, completion_form):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    rows = torch.tensor([0, 1, 2, 3, 5, 6, 9, 10, 11])  # partial groups too
    mask = rollout.completion_mask[rows].bool()
    with torch.no_grad():
        expected = plain(short_model, rollout, rows, temperature, with_entropy=True)
        grouped = packed_logprobs(short_model, rollout, rows, temperature, True, 0, grouped=True)
    assert (expected.logps - grouped.logps)[mask].abs().max() < 1e-4
    assert (expected.entropy - grouped.entropy)[mask].abs().max() < 1e-4
    assert short_model.config._attn_implementation != "hasten_grouped"  # restored after the pass


def test_grouped_attention_gradients_equal_dense(short_model, tokenizer, completion_form):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    rows = torch.arange(rollout.num_samples)
    weights = torch.randn(rollout.completion_ids.shape)

    def gradients(grouped):
        short_model.zero_grad()
        logps = packed_logprobs(short_model, rollout, rows, 1.0, False, 0, grouped=grouped).logps
        (logps * weights * rollout.completion_mask).sum().backward()
        return [p.grad.clone() for p in short_model.parameters()]

    for a, b in zip(gradients(False), gradients(True)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_grouped_layout_blocks():
    from hasten.kernels.grouped_attention import build_layout

    # row 0: prompt of 2, completion 1 of 2 inputs, completion 2 of 1 input; row 1: prompt of 1, one completion
    segments = torch.tensor([[0, 0, 1, 1, 2], [0, 1, -1, -1, -1]])
    layout = build_layout(segments)
    assert layout.prompt_index.tolist() == [[0, 1], [5, 0]]
    assert layout.prompt_valid.tolist() == [[True, True], [True, False]]
    assert layout.completion_index.tolist() == [[2, 3], [4, 0], [6, 0]]
    assert layout.completion_row.tolist() == [0, 0, 1]
    # completion 2 of row 0: its one query sees both prompt keys and itself, not its padding
    assert layout.completion_mask[1, 0, 0].tolist() == [True, True, True, False]
    # the completion of row 1 sees only the one real prompt key
    assert layout.completion_mask[2, 0, 0].tolist() == [True, False, True, False]


def test_causal_form_groups_completions_by_prompt_keys():
    from hasten.kernels.grouped_attention import build_layout

    # row 0: prompt of 3, completions of 2 and 1 inputs; row 1: prompt of 1, a completion of 3; row 2: prompt of 3
    segments = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, -1, -1], [0, 0, 0, 1, -1, -1]])
    masked, causal = build_layout(segments, causal_from=10**9), build_layout(segments, causal_from=0)
    assert masked.causal_groups == () and masked.completion_mask.shape == (4, 1, 3, 6)
    assert causal.completion_mask.numel() == 0  # no (C, T, P + T) mask is built for the causal form
    # the row that sees 1 prompt key first, then both rows that see 3: one causal call per count
    assert causal.completion_row.tolist() == [1, 0, 0, 2]
    assert causal.causal_groups == ((0, 1, 1), (1, 4, 3))
    assert causal.completion_index.tolist() == [[7, 8, 9], [3, 4, 0], [5, 0, 0], [15, 0, 0]]
    # every real position still reads its own output: prompts first, then completions in the new order
    prompt_slots = causal.prompt_index.numel()
    assert causal.output_source[[7, 8, 9]].tolist() == [prompt_slots + i for i in range(3)]
    assert causal.output_source[[3, 4, 5, 15]].tolist() == [prompt_slots + i for i in (3, 4, 6, 9)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_causal_form_equals_masked_attention_with_gradients(dtype):
    """The two forms on one layout with random q/k/v (GQA, ragged prompts and completions): outputs and the
    gradients of q, k and v equal, at a length where the causal form is the one taken."""
    from hasten.kernels.grouped_attention import build_layout, grouped_attention_forward

    torch.manual_seed(0)
    segments = torch.full((3, 40), -1)
    for row, (prompt, lengths) in enumerate([(5, [12, 7, 1]), (2, [20]), (9, [3, 15, 4])]):
        segments[row, :prompt] = 0
        at = prompt
        for j, n in enumerate(lengths, start=1):
            segments[row, at:at + n] = j
            at += n
    heads, kv_heads, dim = 6, 2, 8
    query = torch.randn(3, heads, 40, dim, dtype=dtype, requires_grad=True)
    key = torch.randn(3, kv_heads, 40, dim, dtype=dtype, requires_grad=True)
    value = torch.randn(3, kv_heads, 40, dim, dtype=dtype, requires_grad=True)
    real = (segments >= 0).flatten()
    weights = torch.randn(3 * 40, heads, dim, dtype=dtype)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    results = []
    for causal_from in (10**9, 0):
        layout = build_layout(segments, causal_from=causal_from)
        assert bool(layout.causal_groups) == (causal_from == 0)
        out, _ = grouped_attention_forward(None, query, key, value, None, scaling=dim**-0.5, hasten_layout=layout)
        out = out.reshape(3 * 40, heads, dim)[real]
        grads = torch.autograd.grad((out * weights[real]).sum(), (query, key, value))
        results.append((out, grads))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.allclose(out_a, out_b, atol=tolerance)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, atol=tolerance)


def test_buckets_are_the_cheapest_cut():
    """_buckets against every way of cutting a few widths into consecutive buckets."""
    import itertools

    from hasten.kernels.grouped_attention import _buckets

    torch.manual_seed(0)
    for trial in range(40):
        widths = sorted(torch.randint(1, 60, (int(torch.randint(1, 8, ())),)).tolist(), reverse=True)
        keys, call = int(torch.randint(0, 100, ())), int(torch.randint(0, 3000, ()))

        def cost(start, end):
            return (end - start) * widths[start] * (keys + widths[start])

        def total(cuts):
            return sum(cost(start, end) + call for start, end in cuts)

        best = min(total(list(zip((0, *inner), (*inner, len(widths)))))
                   for size in range(len(widths)) for inner in itertools.combinations(range(1, len(widths)), size))
        cuts = _buckets(widths, cost, call)
        assert total(cuts) == best
        assert cuts[0][0] == 0 and cuts[-1][1] == len(widths)
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert _buckets([9, 9, 2, 2], lambda start, end: (end - start) * [9, 9, 2, 2][start] ** 2, 0) == [(0, 2), (2, 4)]
    assert _buckets([9, 9, 2, 2], lambda start, end: (end - start) * [9, 9, 2, 2][start] ** 2, 10**9) == [(0, 4)]
    # many distinct widths: a coarser but valid cut, at most MAX_CUT_POINTS buckets
    from hasten.kernels.grouped_attention import MAX_CUT_POINTS

    widths = list(range(1000, 0, -1))
    cuts = _buckets(widths, lambda start, end: (end - start) * widths[start] ** 2, 0)
    assert cuts[0][0] == 0 and cuts[-1][1] == 1000 and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert 1 < len(cuts) <= MAX_CUT_POINTS


def _ragged_segments(rows, shared=0):
    """(R, L) segments: per row a prompt and completions of varied lengths; row 0 starts with `shared` prefix tokens."""
    segments = torch.full((len(rows), 80), -1)
    for row, (prompt, lengths) in enumerate(rows):
        segments[row, :prompt] = 0
        if row == 0:
            segments[row, :shared] = -2
        at = prompt
        for j, n in enumerate(lengths, start=1):
            segments[row, at:at + n] = j
            at += n
    return segments


@pytest.mark.parametrize("shared", [0, 6])
def test_bucketed_grouped_attention_equals_one_call_and_the_dense_mask(shared):
    """Completions and prompts cut into buckets of their own widths (several prompt and completion buckets, a
    causal prompt bucket, a bucket of rows that are not consecutive) give what one padded call per batch gives,
    outputs and q/k/v gradients in float64, and both equal dense attention under the block mask with the prefix
    copied into every row."""
    from hasten.kernels.grouped_attention import build_layout, grouped_attention_forward

    torch.manual_seed(0)
    # row 2's prompt is longer than row 1's: the prompt entries are ordered 0, 2, 1 (row 0 holds the prefix)
    segments = _ragged_segments([(14, [30, 2, 3, 25]), (3, [1, 2, 28]), (9, [30, 29, 4, 1])], shared)
    rows, width = segments.shape
    heads, kv_heads, dim = 6, 2, 8
    query = torch.randn(rows, heads, width, dim, dtype=torch.float64, requires_grad=True)
    key = torch.randn(rows, kv_heads, width, dim, dtype=torch.float64, requires_grad=True)
    value = torch.randn(rows, kv_heads, width, dim, dtype=torch.float64, requires_grad=True)
    real = (segments != -1).flatten()
    weights = torch.randn(rows * width, heads, dim, dtype=torch.float64)

    def run(layout):
        out, _ = grouped_attention_forward(None, query, key, value, None, scaling=dim**-0.5, hasten_layout=layout)
        out = out.reshape(rows * width, heads, dim)[real]
        return out, torch.autograd.grad((out * weights[real]).sum(), (query, key, value))

    one, cut = build_layout(segments, bucket_pairs=10**12), build_layout(segments, bucket_pairs=0)
    assert len(one.prompt_buckets) == 1 and len(one.completion_buckets) == 1
    assert one.prompt_buckets[0][3] == -1  # rows 0, 2, 1: not consecutive, their keys are gathered
    assert len(cut.completion_buckets) >= 3 and len(cut.prompt_buckets) >= 2
    assert [b[2] for b in cut.completion_buckets] == sorted({b[2] for b in cut.completion_buckets}, reverse=True)
    assert cut.prompt_row.tolist() == [0, 2, 1]
    assert cut.prompt_buckets[0][4]  # row 0 starts at key 0: its bucket is causal
    assert any(b[4] == (shared == 0) for b in cut.prompt_buckets[1:])
    results = [run(one), run(cut)]
    # The dense reference: each row holds its own copy of the prefix (row 0's positions, gathered), and every
    # position attends to what the block mask allows in that row; outputs read back at the original positions.
    from hasten.train.packing import block_mask

    flat = torch.arange(rows * width).view(rows, width)
    copies = [flat[0][segments[0] != -1]] + [torch.cat([flat[0][:shared], flat[row][segments[row] != -1]])
                                              for row in range(1, rows)]
    wide = max(c.numel() for c in copies)
    source = torch.stack([torch.cat([c, c.new_zeros(wide - c.numel())]) for c in copies])  # (R, L2)
    dense_segments = torch.stack([torch.cat([segments.flatten()[c].clamp(min=0), torch.full((wide - c.numel(),), -1)])
                                  for c in copies])
    group = heads // kv_heads

    def unshared(tensor, repeat=1):  # (R, h, L, D) -> (R, h * repeat, L2, D), each row with the prefix copied in
        taken = tensor.transpose(1, 2).reshape(rows * width, tensor.shape[1], dim)[source]
        return taken.transpose(1, 2).repeat_interleave(repeat, 1)

    dense = torch.nn.functional.scaled_dot_product_attention(
        unshared(query), unshared(key, group), unshared(value, group), attn_mask=block_mask(dense_segments),
        scale=dim**-0.5).transpose(1, 2)  # (R, L2, H, D)
    back = torch.zeros(rows * width, heads, dim, dtype=torch.float64)
    for row, c in enumerate(copies):
        keep = slice(0, None) if row == 0 else slice(shared, None)
        back = back.index_put((c[keep],), dense[row, :c.numel()][keep])
    dense = back[real]
    results.append((dense, torch.autograd.grad((dense * weights[real]).sum(), (query, key, value))))
    (out_a, grads_a), *others = results
    for out_b, grads_b in others:
        assert torch.allclose(out_a, out_b, atol=1e-12)
        for a, b in zip(grads_a, grads_b):
            assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_target_log_softmax_matches_autograd_reference(temperature):
    from hasten.train.packing import TargetLogSoftmax

    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 5, 1])
    logps, entropy = TargetLogSoftmax.apply(logits, targets, temperature, True)
    reference = torch.log_softmax(logits / temperature, dim=-1)
    assert torch.allclose(logps, reference.gather(-1, targets[:, None]).squeeze(-1))
    assert torch.allclose(entropy, -(reference.exp() * reference).sum(-1))
    assert not entropy.requires_grad
    assert torch.autograd.gradcheck(lambda x: TargetLogSoftmax.apply(x, targets, temperature, False)[0], (logits,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_entropy_is_exact_on_a_large_vocabulary(temperature):
    """fp32 entropy over a 50k vocabulary within 1e-5 nats of float64 (the old
    `logsumexp - einsum(p, z)` was 2-5e-3 off here: cancellation plus a long dot)."""
    from hasten.train.packing import TargetLogSoftmax

    torch.manual_seed(0)
    logits = torch.randn(64, 50_000) * 4.0  # (chunk, V), a trained LM's logit scale
    logits[:, :8] += torch.linspace(4, 16, 64)[:, None]  # a few likely tokens: peaked and flat rows
    targets = torch.randint(0, 50_000, (64,))
    logps, entropy = TargetLogSoftmax.apply(logits, targets, temperature, True)
    reference = torch.log_softmax(logits.double() / temperature, dim=-1)  # (chunk, V) float64
    assert (entropy.double() - -(reference.exp() * reference).sum(-1)).abs().max() < 1e-5
    assert (logps.double() - reference.gather(-1, targets[:, None]).squeeze(-1)).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_consumed_logits_give_the_same_bits(temperature, with_entropy, dtype):
    """consume=True (the packed pass) overwrites the logits' buffer with the softmax and then the gradient:
    log-probs, entropy and the logits' gradient equal consume=False's bit for bit, across the entropy's row
    blocks (ENTROPY_BLOCK_BYTES is ~42 rows of a 50k vocabulary)."""
    from hasten.train.packing import TargetLogSoftmax

    torch.manual_seed(0)
    base = (torch.randn(100, 50_000) * 4).to(dtype)
    targets = torch.randint(0, 50_000, (100,))
    upstream = torch.randn(100)
    results = []
    for consume in (False, True):
        leaf = base.clone().requires_grad_(True)
        logits = leaf * 1  # a non-leaf, as the head's output is
        logps, entropy = TargetLogSoftmax.apply(logits, targets, temperature, with_entropy, False, consume)[:2]
        logps.backward(upstream)
        results.append((logps, entropy, leaf.grad))
    for plain, consumed in zip(*results):
        assert torch.equal(plain, consumed)


def test_consumed_logits_refuse_a_second_backward():
    """The softmax the gradient needs is gone after the first backward: autograd says so instead of reusing it."""
    from hasten.train.packing import TargetLogSoftmax

    logits = torch.randn(5, 7, requires_grad=True) * 1
    logps = TargetLogSoftmax.apply(logits, torch.zeros(5, dtype=torch.long), 1.0, True, False, True)[0]
    logps.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        logps.sum().backward()


def _fresh_outputs(wanted, found: list):
    """A dispatch mode (class) that appends to `found` each op whose output is a new tensor (no input's storage)
    that `wanted(tensor)` accepts: what a forward or backward allocates of a kind."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                      if isinstance(t, torch.Tensor)}
            found.extend(func for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                         and t.untyped_storage().data_ptr() not in inputs and wanted(t))
            return out

    return Count


def test_packed_head_holds_one_vocabulary_wide_tensor(monkeypatch):
    """A chunk's forward and backward through the head allocate one (chunk, V) tensor (the logits, which become
    the softmax and then the gradient), where the plain formulation allocated five (logits, shifted, softmax,
    a zero gradient for nothing, gradient). Counted with a dispatch mode over the allocating ops."""
    from hasten.train.packing import TargetLogSoftmax, _chunk_logprobs

    rows, vocab = 64, 4096
    monkeypatch.setattr("hasten.train.packing.ENTROPY_BLOCK_BYTES", 8 * vocab * 4)  # the entropy in 8-row blocks
    wide = []
    Count = _fresh_outputs(lambda tensor: tensor.untyped_storage().nbytes() >= rows * vocab * 4, wide)

    torch.manual_seed(0)
    head = torch.nn.Linear(32, vocab, bias=False)
    hidden = torch.randn(rows, 32, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    with Count():
        logps, _ = _chunk_logprobs(head, hidden, targets, 1.0, True)
        logps.sum().backward()
    assert len(wide) == 1, wide
    wide.clear()
    with Count():
        logps, _ = TargetLogSoftmax.apply(head(hidden), targets, 1.0, True)
        logps.sum().backward()
    assert len(wide) >= 3  # the plain formulation, for contrast


def _untied(model):
    """A copy of `model` whose LM head is its own parameter (the tiny model ties it to the embedding)."""
    import copy

    untied = copy.deepcopy(model)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    return untied


def _packed_gradients(model, rollout, weights, precision, in_place, monkeypatch, onednn=False):
    """Every parameter's gradient after a packed pass over the rollout in two micro-batches (the second one adds
    to gradients that exist), logits in chunks of 5 tokens; in_place False: the head's gradient through autograd.
    onednn: the learner's oneDNN routes (speed.fast_linear): fp32's linears, bf16_fp32head's head."""
    from hasten.kernels.fast_linear import onednn_linears
    from hasten.kernels.precision import fp32_head
    from hasten.train import packing

    if not in_place:
        monkeypatch.setattr(packing, "head_grad_in_place", lambda head, hidden: False)
    model.zero_grad(set_to_none=True)
    rows = torch.arange(rollout.num_samples)
    for half in (rows[::2], rows[1::2]):
        low = precision == "bf16_fp32head"
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low), onednn_linears(model, onednn), \
                fp32_head(model.lm_head, low, onednn=onednn):
            stats = packed_logprobs(model, rollout, half, 0.9, False, 5)
        (stats.logps * weights[half] * rollout.completion_mask[half]).sum().backward()
    monkeypatch.undo()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16_fp32head"])
def test_head_gradient_accumulated_in_place_equals_autograds(tokenizer, tied, precision, monkeypatch):
    """The chunked head's weight gradient added into .grad chunk by chunk (HeadGradInPlace) is autograd's sum in
    another order: every gradient equal to fp32 rounding, over two micro-batches, tied head or not, fp32 or the
    bf16 body with the fp32 head. And the in-place path did run, once per chunk."""
    from hasten.models.tiny import tiny_model
    from hasten.train import packing

    model = tiny_model(len(tokenizer))
    model = model if tied else _untied(model)
    rollout = rollout_of(model, tokenizer, num_generations=4)
    weights = torch.randn(rollout.completion_ids.shape)
    expected = _packed_gradients(model, rollout, weights, precision, False, monkeypatch)
    calls = []
    backward = packing.HeadGradInPlace.backward
    monkeypatch.setattr(packing.HeadGradInPlace, "backward",
                        staticmethod(lambda ctx, grad: (calls.append(grad.shape[0]), backward(ctx, grad))[1]))
    got = _packed_gradients(model, rollout, weights, precision, True, monkeypatch)
    assert sum(calls) == int(rollout.completion_mask.sum()) and max(calls) == 5  # every target, in chunks of 5
    assert expected.keys() == got.keys()
    for name in expected:
        scale = expected[name].abs().max()
        assert (expected[name] - got[name]).abs().max() <= 1e-5 * scale, name


@pytest.mark.parametrize("precision", ["fp32", "bf16_fp32head"])
def test_head_gradient_in_place_keeps_the_bodys_bits_on_a_onednn_head(tokenizer, precision, monkeypatch):
    """Where the head runs on oneDNN (speed.fast_linear: fp32's routed linears, bf16_fp32head's fp32 head), the
    hidden state's gradient is oneDNN's product as before, so every gradient but the head's own is autograd's
    bit for bit (a bf16 body would magnify an fp32 difference there to ~1e-2); the head's within fp32 rounding."""
    from conftest import head_dim_64_model

    from hasten.kernels import fast_linear
    from hasten.train import packing

    model = head_dim_64_model(len(tokenizer)).train()
    if not (fast_linear.available() and fast_linear.eligible(model.lm_head)):
        pytest.skip("no oneDNN linear on this build, or the head too narrow for it")
    rollout = rollout_of(model, tokenizer, num_generations=4)
    weights = torch.randn(rollout.completion_ids.shape)
    expected = _packed_gradients(model, rollout, weights, precision, False, monkeypatch, onednn=True)
    routed = []
    monkeypatch.setattr(packing, "head_on_onednn", lambda head, on=packing.head_on_onednn: routed.append(on(head))
                        or routed[-1])
    got = _packed_gradients(model, rollout, weights, precision, True, monkeypatch, onednn=True)
    assert routed == [True, True]  # one decision a micro-batch, each on oneDNN
    head = "lm_head.weight" if "lm_head.weight" in expected else "model.embed_tokens.weight"  # tied: one name
    for name in expected:
        if name == head:
            assert (expected[name] - got[name]).abs().max() <= 1e-5 * expected[name].abs().max()
        else:
            assert torch.equal(expected[name], got[name]), name


@pytest.mark.parametrize("tied", [True, False])
def test_head_gradient_in_place_allocates_no_head_sized_tensor(tokenizer, tied, monkeypatch):
    """The point of HeadGradInPlace: with the gradient there (a later micro-batch), the backward creates no
    (V, H) tensor for the head (autograd made one per chunk and a running sum); the embedding's own gradient is
    the one left. Counted with a dispatch mode over the ops' fresh outputs."""
    from hasten.models.tiny import tiny_model
    from hasten.train import packing

    model = tiny_model(len(tokenizer))
    model = model if tied else _untied(model)
    rollout = rollout_of(model, tokenizer, num_generations=4)
    rows = torch.arange(rollout.num_samples)
    shape = tuple(model.lm_head.weight.shape)
    fresh = []
    Count = _fresh_outputs(lambda tensor: tuple(tensor.shape) == shape, fresh)

    def head_sized(in_place: bool) -> int:
        if not in_place:
            monkeypatch.setattr(packing, "head_grad_in_place", lambda head, hidden: False)
        for parameter in model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        logps = packed_logprobs(model, rollout, rows, 1.0, False, 5).logps
        fresh.clear()
        with Count():
            (logps * rollout.completion_mask).sum().backward()
        monkeypatch.undo()
        return len(fresh)

    assert head_sized(True) == 1  # the embedding's dense gradient (tied: added into the head's .grad in place)
    assert head_sized(False) >= 3  # and a chunk's product, and autograd's running sum of them


def test_head_gradient_in_place_only_where_it_is_the_same_gradient(tokenizer, monkeypatch):
    """HeadGradInPlace takes a plain fp32 Linear head whose logits are fp32 and whose gradient autograd would
    otherwise sum alone; every other head keeps autograd's path."""
    from conftest import peft_head_model

    from hasten.kernels.precision import fp32_head
    from hasten.models.tiny import tiny_model
    from hasten.train.packing import head_grad_in_place

    model = tiny_model(len(tokenizer))
    head = model.lm_head
    hidden = torch.randn(3, head.in_features, requires_grad=True)
    assert head_grad_in_place(head, hidden)
    assert not head_grad_in_place(head, hidden.detach())  # nothing would call its backward
    with torch.no_grad():
        assert not head_grad_in_place(head, hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not head_grad_in_place(head, hidden)  # plain bf16: autocast's bf16 logits and their bf16 sum
        with fp32_head(head, True):
            assert head_grad_in_place(head, hidden)  # bf16_fp32head: fp32 logits
    handle = head.register_forward_hook(lambda module, args, out: out)
    assert not head_grad_in_place(head, hidden)  # a hook would run outside autograd
    handle.remove()
    for register in (head.weight.register_hook, head.weight.register_post_accumulate_grad_hook):
        handle = register(lambda *args: None)
        assert not head_grad_in_place(head, hidden)  # autograd would not call it (e.g. a hook masking rows)
        handle.remove()
    assert head_grad_in_place(head, hidden)
    head.weight.requires_grad_(False)
    assert not head_grad_in_place(head, hidden)  # frozen (LoRA's base)
    head.weight.requires_grad_(True)
    monkeypatch.setattr("hasten.train.distributed.world_size", lambda: 2)
    assert not head_grad_in_place(head, hidden)  # DDP and FSDP reduce from autograd's hooks
    monkeypatch.undo()
    for wrap in ("lora", "modules_to_save"):
        wrapped = peft_head_model(model, wrap)
        assert not head_grad_in_place(wrapped.get_base_model().lm_head, hidden)
