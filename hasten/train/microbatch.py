"""Micro-batches by token budget (speed.token_budget).

The learner splits a generation batch into train.gradient_accumulation_steps
chunks of whole samples; with a token budget each chunk is split further so
that no micro-batch holds more than `budget` tokens of model input. The
budget bounds peak activation memory by what it actually depends on, the
tokens in one forward, rather than by a sample count that is too small for
short completions and too large for long ones. The default, `auto`
(resolve_budget), is the largest budget whose activations, estimated from the
model's shape, stay under a quarter of the device's memory, and on a CPU at
most AUTO_CPU_TOKENS (2048): a batch that fits runs whole, a long-completion
batch is split instead of filling the memory (docs/scaling.md has what it saved
on B8). The CPU cap is measured, not assumed (docs/scaling.md): on B8's
SmolLM2-135M x 256 cell, micro-batches of 2048 tokens ran the learning pass
faster than the larger ones a quarter of 24 GiB allows, at less peak memory
(a micro-batch's activations stay nearer the caches). 0 is off (the baseline
profile).

Tokens are counted as the forward will see them:
- packed pass (speed.packed_learning): each group's prompt once, plus each
  completion's length - 1 (its last token is only a target);
- padded pass: samples x (longest prompt + longest completion) in the piece.

Samples stay in rollout order, so a group's completions stay together and
its prompt is encoded once per micro-batch. A chunk is cut into as few
micro-batches as the budget allows, and evenly (micro_batches): the peak is
the largest one's. A single sample over the budget
gets a micro-batch of its own rather than an error: the budget is a memory
target, not a correctness condition. The losses are scaled by the whole
batch's token and sequence counts (algo/losses.py), so grpo, dr_grpo, dapo
and gspo give the same gradient however the batch is split; bnpo
normalizes per micro-batch, as TRL's does per device batch.
"""

from __future__ import annotations

import torch

from ..device import machine_bytes  # the machine's (or GPU's) memory, in device.py for the engine too
from ..rollout import Rollout

AUTO_SHARE = 0.25  # speed.token_budget=auto: the activations' share of the machine's memory
AUTO_ROOM = 0.3  # ... and at most this share of what the step's static memory leaves free
AUTO_FLOOR = 1024  # ... and never a budget below this many tokens (matmuls too small to be fast)
AUTO_CPU_TOKENS = 2048  # ... and on a CPU at most this many: larger micro-batches ran slower there (above)
RUNTIME_BYTES = 1 << 29  # the interpreter, torch and its libraries (bench/cost.py's RUNTIME_BYTES)
LOGIT_CHUNK_BYTES = 512 << 20  # one (chunk, vocabulary) fp32 tensor of the packed pass's logits at most
# Bytes per parameter of the lean engine's sampling copy (speed.engine_weights=copy) by generation.precision.
# int8: one byte for the projections and the head, down_proj in bf16 (fp32 without native bf16): under 2 at
# every supported shape (down_proj is ~20% of the parameters), so 2 bounds it.
# auto: counted as fp32 wherever it is read before the engine factory resolved it (the larger copy: a safe bound)
COPY_BYTES = {"fp32": 4, "bf16": 2, "int8": 2, "auto": 4}
MOMENT_BYTES = {"fp32": 8, "bf16": 4}  # AdamW's exp_avg + exp_avg_sq per trained parameter (train.optimizer_moments)


def effective_logit_chunk(setting: int, vocab: int) -> int:
    """speed.logit_chunk_tokens as the packed pass runs it: never a (chunk, vocab) fp32 tensor over
    LOGIT_CHUNK_BYTES (2048 tokens for SmolLM2's 49k vocabulary; 883 for Qwen2.5's 152k); 0 = at once."""
    if setting <= 0:
        return 0
    return max(1, min(setting, LOGIT_CHUNK_BYTES // (4 * vocab)))


def activation_bytes_per_token(model_config, checkpointing: bool) -> int:
    """fp32 bytes the learning pass keeps for backward per input token (bench/cost.py's estimate):
    per layer ~10 hidden-wide tensors, 4 intermediate-wide (3 on the native model, whose SiluMul keeps one
    fewer: an upper bound for either implementation), k and v; with activation checkpointing each
    layer's input, plus one layer's full set while it is recomputed."""
    hidden, layers = model_config.hidden_size, model_config.num_hidden_layers
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    kv_width = getattr(model_config, "num_key_value_heads", None) or heads
    per_layer = (10 * hidden + 4 * model_config.intermediate_size + 2 * kv_width * head_dim) * 4
    return layers * hidden * 4 + per_layer if checkpointing else layers * per_layer


def parameter_count(model_config) -> int:
    """A Llama-family decoder's parameters from its config: embedding (and an untied head), per layer q/k/v/o
    (with biases where the family has them: Qwen2's q/k/v, Llama's attention_bias on all four), the gated MLP
    and two norms."""
    hidden, layers, vocab = model_config.hidden_size, model_config.num_hidden_layers, model_config.vocab_size
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    kv_width = (getattr(model_config, "num_key_value_heads", None) or heads) * head_dim
    qwen2 = getattr(model_config, "model_type", "") == "qwen2"  # biases on q, k and v only
    biases = getattr(model_config, "attention_bias", qwen2)
    attention = hidden * (2 * heads * head_dim + 2 * kv_width) + (
        heads * head_dim + 2 * kv_width + (0 if qwen2 else hidden) if biases else 0)  # Llama's: o_proj's too
    per_layer = attention + 3 * hidden * model_config.intermediate_size + 2 * hidden
    head = 0 if getattr(model_config, "tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + head + layers * per_layer + hidden


def static_bytes(model_config, lora: bool, logit_chunk: int, copy_bytes: int = COPY_BYTES["fp32"],
                 moment_bytes: int = MOMENT_BYTES["fp32"]) -> int:
    """Bytes a GRPO step holds whatever its micro-batches: the fp32 weights and the lean engine's copy of
    them (copy_bytes per parameter: COPY_BYTES by sampling precision where speed.engine_weights resolves to
    copy, 0 under shared); for a full fine-tune their fp32 gradient and AdamW's two moments (moment_bytes
    per parameter: MOMENT_BYTES; LoRA's adapters: a few MB); a logit chunk's backward: the one buffer that
    holds its logits, softmax and gradient in turn (packing.py's TargetLogSoftmax, consume), the gradient's
    transposed copy for the head's weight gradient where oneDNN cannot read the view
    (fast_linear.reads_transposed; kept as a margin where it can), the head's weight gradient and a
    head-sized transient; the runtime."""
    count = parameter_count(model_config)
    vocab = model_config.vocab_size
    chunk = effective_logit_chunk(logit_chunk, vocab)
    logits = 2 * chunk * vocab * 4 + 2 * vocab * model_config.hidden_size * 4 if chunk else 0
    per_parameter = 4 + copy_bytes + (0 if lora else 4 + moment_bytes)
    return count * per_parameter + logits + RUNTIME_BYTES


def resolve_budget(setting: int | str, model_config, checkpointing: bool, total_bytes: int | None = None,
                   device: str = "cpu", lora: bool = False, logit_chunk: int = 0,
                   copy_bytes: int = COPY_BYTES["fp32"], moment_bytes: int = MOMENT_BYTES["fp32"]) -> int:
    """speed.token_budget as tokens: a number as given; auto from the model's shape and the memory of
    `device` (total_bytes: instead of it): activations under a quarter of it and, on a CPU, at most
    AUTO_CPU_TOKENS tokens (at least AUTO_FLOOR tokens), and under 0.3 of what the step's static memory
    (static_bytes: weights, their copy, gradient and moments, logits) leaves, which is the smaller from
    ~0.5B parameters on in 24 GiB."""
    if setting != "auto":
        return int(setting)
    total = machine_bytes(device) if total_bytes is None else total_bytes
    per_token = activation_bytes_per_token(model_config, checkpointing)
    room = int(AUTO_ROOM * max(total - static_bytes(model_config, lora, logit_chunk, copy_bytes,
                                                            moment_bytes), 0)) // per_token
    share = int(AUTO_SHARE * total) // per_token
    if torch.device(device).type == "cpu":
        share = min(share, AUTO_CPU_TOKENS)
    return max(1, min(room, max(AUTO_FLOOR, share)))  # the floor never overrides what memory allows


def micro_batches(rollout: Rollout, accumulation_steps: int, budget: int, packed: bool) -> list[torch.Tensor]:
    """Sample indices of each micro-batch, in order; every sample appears exactly once.

    Each accumulation chunk gets as few micro-batches as the budget allows, cut evenly: the greedy cut at the
    budget fixes their number, and the smallest cap that still needs no more of them cuts the chunk (a binary
    search; the greedy cut is the fewest pieces for a cap, because a run of samples never counts fewer tokens
    when it grows). The largest micro-batch, which sets the peak memory, is then as small as that number
    allows: at a 2048 budget a batch of 32 x 64-token completions (~2,550 tokens) is two of ~1,275, not
    1,946 + 600."""
    chunks = list(torch.arange(rollout.num_samples).tensor_split(accumulation_steps))
    if budget <= 0:
        return chunks
    prompt_lengths = rollout.prompt_mask.sum(dim=1).tolist()  # (B,)
    completion_lengths = rollout.completion_mask.sum(dim=1).tolist()  # (N,)
    group_size = rollout.num_generations

    def cut(samples: list[int], cap: int) -> list[list[int]]:
        """The greedy cut at `cap`, each piece's count (_tokens's rule) kept as it grows: O(samples)."""
        pieces: list[list[int]] = []
        current: list[int] = []
        groups: set[int] = set()
        tokens = longest_prompt = longest_completion = 0  # packed: the running count; padded: the widths

        def grown(sample: int) -> int:
            """The current piece's count with `sample` added."""
            group = sample // group_size
            if packed:  # a completion's last token is only a target
                prompt = 0 if group in groups else prompt_lengths[group]
                return tokens + prompt + max(completion_lengths[sample] - 1, 0)
            width = max(longest_prompt, prompt_lengths[group]) + max(longest_completion, completion_lengths[sample])
            return (len(current) + 1) * width

        for sample in samples:
            count = grown(sample)
            if current and count > cap:
                pieces.append(current)
                current, groups = [], set()
                tokens = longest_prompt = longest_completion = 0
                count = grown(sample)
            current.append(sample)
            groups.add(sample // group_size)
            tokens = count
            longest_prompt = max(longest_prompt, prompt_lengths[sample // group_size])
            longest_completion = max(longest_completion, completion_lengths[sample])
        if current:
            pieces.append(current)
        return pieces

    pieces: list[torch.Tensor] = []
    for chunk in chunks:
        samples = chunk.tolist()
        best = cut(samples, budget)
        low, high = 0, budget  # a cap of `high` needs len(best) pieces; find the smallest that does
        while len(best) > 1 and high - low > 1:
            middle = (low + high) // 2
            trial = cut(samples, middle)
            if len(trial) <= len(best):
                high, best = middle, trial
            else:
                low = middle
        pieces.extend(torch.tensor(piece) for piece in best)
    return pieces


def _tokens(samples: list[int], prompt_lengths: list[int], completion_lengths: list[int], group_size: int,
            packed: bool) -> int:
    groups = {sample // group_size for sample in samples}
    if packed:
        return sum(prompt_lengths[g] for g in groups) + sum(max(completion_lengths[s] - 1, 0) for s in samples)
    width = max(prompt_lengths[s // group_size] for s in samples) + max(completion_lengths[s] for s in samples)
    return len(samples) * width


def count_tokens(rollout: Rollout, samples: torch.Tensor, packed: bool) -> int:
    """Model-input tokens of one micro-batch, counted as micro_batches counts them."""
    return _tokens(samples.tolist(), rollout.prompt_mask.sum(dim=1).tolist(),
                   rollout.completion_mask.sum(dim=1).tolist(), rollout.num_generations, packed)
