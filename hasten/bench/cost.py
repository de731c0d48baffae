"""The cost model: FLOPs and bytes per token of each phase, from a model's shape.

docs/cost-model.md states these formulas; this module is them, and `hasten
bench` divides by them (report.py's fractions of the hardware limit), so the
docs and the figures cannot drift apart. Why a model and not a profile: it
says what the work *must* cost on any machine, so a measured phase reads as a
fraction of its floor, and the same formulas predict other hardware (an H100,
eight) without running there.

Counts, per token (N_body = every weight applied at every position: all but
the input embedding, a lookup, and the LM head; N_head = the LM head,
applied where logits are needed; d_attn = heads x head_dim):
- forward matmuls: 2 N_body (+ 2 N_head where a logit is needed);
- attention at context c (scores and the weighted sum): 4 layers d_attn c;
- learning (forward + backward): 3x the forward with a full fine-tune
  (backward = gradients of activations + of weights), 2x with LoRA (no
  weight gradients of the frozen base; the adapters are < 1% and left out);
- decode step over R rows at context c: every weight read once (shared by the
  rows), plus each row's KV cache: 2 layers kv_heads head_dim c elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
# The KV cache's bytes per element when a phase runs in `precision`: int8 sampling keeps its cache fp32.
KV_BYTES = {**BYTES, "int8": 4}


@dataclass(frozen=True)
class Shape:
    """What the cost depends on, read from a transformers-style config."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    attention_bias: bool = False  # q, k, v biases (Qwen2)

    @classmethod
    def from_config(cls, config: Any) -> Shape:
        heads = config.num_attention_heads
        return cls(hidden=config.hidden_size, layers=config.num_hidden_layers, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   intermediate=config.intermediate_size, vocab=config.vocab_size,
                   attention_bias=bool(getattr(config, "attention_bias", getattr(config, "model_type", "") == "qwen2")))

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def body(self) -> int:
        """N_body: per layer q, k, v, o, gate, up, down (+ q/k/v biases) and two norms; the final norm."""
        attention = self.hidden * (2 * self.attention_width + 2 * self.kv_width)
        bias = (self.attention_width + 2 * self.kv_width) if self.attention_bias else 0
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + bias + mlp + 2 * self.hidden) + self.hidden

    @property
    def head(self) -> int:
        """N_head: the LM head (tied to the embedding or not, it is applied once per logit)."""
        return self.vocab * self.hidden

    def parameters(self, tied: bool = True) -> int:
        """All parameters: body, head, and the input embedding unless it is the head's own weight."""
        return self.body + self.head + (0 if tied else self.vocab * self.hidden)


# ------------------------------------------------------------------ FLOPs


def attention_flops(shape: Shape, context: float) -> float:
    """Forward attention of one token over `context` earlier positions: QK^T and the weighted sum of V."""
    return 4.0 * shape.layers * shape.attention_width * context


def forward_flops(shape: Shape, tokens: float, logits: float, mean_context: float = 0.0) -> float:
    """A forward over `tokens` positions, `logits` of which go through the LM head."""
    return 2.0 * shape.body * tokens + 2.0 * shape.head * logits + tokens * attention_flops(shape, mean_context)


def generation_flops(shape: Shape, prompt_tokens: float, generated_tokens: float, mean_context: float = 0.0) -> float:
    """Prefill every prompt once (no logits but the last: left out) and decode every generated token."""
    return forward_flops(shape, prompt_tokens + generated_tokens, generated_tokens, mean_context)


def learning_multiplier(lora: bool) -> float:
    """Forward + backward in units of the forward: 3 (full fine-tune: 6N per token), 2 with LoRA (4N)."""
    return 2.0 if lora else 3.0


def learning_flops(shape: Shape, prompt_tokens: float, completion_tokens: float, lora: bool = False,
                   mean_context: float = 0.0) -> float:
    """Forward + backward over prompts (once per group, no logits) and completions (a logit each)."""
    forward = forward_flops(shape, prompt_tokens + completion_tokens, completion_tokens, mean_context)
    return learning_multiplier(lora) * forward


# ------------------------------------------------------------------ bytes


def kv_bytes_per_position(shape: Shape, precision: str = "fp32") -> int:
    """One position's keys and values over all layers."""
    return 2 * shape.layers * shape.kv_width * KV_BYTES[precision]


def decode_step_bytes(shape: Shape, rows: int, context: float, precision: str = "fp32") -> float:
    """One decode step: every weight read once for all rows, and each row's KV cache up to `context`."""
    weights = (shape.body + shape.head) * BYTES[precision]
    return weights + rows * context * kv_bytes_per_position(shape, precision)


def decode_floor_bytes(shape: Shape, steps: int, generated_tokens: float, context: float,
                       precision: str = "fp32") -> float:
    """What a measured decode must have moved at least: the weights once per step, and each generated
    token's read of a KV cache at least `context` long (the shortest prompt: a lower bound)."""
    weights = (shape.body + shape.head) * BYTES[precision]
    return steps * weights + generated_tokens * context * kv_bytes_per_position(shape, precision)


def decode_bytes(shape: Shape, rows: int, prompt_tokens: int, new_tokens: int, precision: str = "fp32") -> float:
    """A whole decode of `new_tokens` steps over `rows` rows from prompts of `prompt_tokens` (per row)."""
    mean_context = prompt_tokens + (new_tokens - 1) / 2.0  # the cache grows by one position a step
    return new_tokens * decode_step_bytes(shape, rows, mean_context, precision)


def learning_bytes(shape: Shape, lora: bool = False, precision: str = "fp32", optimizer: bool = True) -> float:
    """Weights read in the forward and the backward; with a full fine-tune, the weight gradients written
    and AdamW's pass over parameters, gradients and its two moments (fp32: read 4, write 3 tensors of N).
    Activations are left out: the learning pass is compute-bound by a wide margin (docs/cost-model.md)."""
    trained = 0 if lora or not optimizer else shape.body + shape.head
    weights = 2 * (shape.body + shape.head) * BYTES[precision]
    return weights + trained * (BYTES[precision] + 7 * 4)


# ------------------------------------------------------------------ floors and fractions


@dataclass(frozen=True)
class Limits:
    """What the machine can do, measured in the same run (or published, for a prediction)."""

    gflops: dict[str, float]  # precision -> best matmul GFLOP/s over the kernels hasten uses
    bandwidth_gbs: float  # best memory bandwidth, GB/s

    def peak(self, precision: str) -> float:
        if precision not in self.gflops or self.gflops[precision] <= 0:
            raise ValueError(f"no matmul peak measured for precision {precision!r} (have {sorted(self.gflops)})")
        return self.gflops[precision]


def floor_seconds(limits: Limits, flops: float, bytes_moved: float, precision: str) -> float:
    """The roofline: a phase takes at least its FLOPs at peak and at least its bytes at full bandwidth."""
    compute = flops / (limits.peak(precision) * 1e9)
    memory = bytes_moved / (limits.bandwidth_gbs * 1e9) if limits.bandwidth_gbs > 0 else 0.0
    return max(compute, memory)


class LimitError(ValueError):
    """A fraction of the hardware limit over 100%: the denominator (a peak or the bandwidth) is wrong."""


def fraction(floor: float, seconds: float, what: str = "phase") -> float:
    """floor / seconds: how close a measured phase came to its floor. Over 1 cannot be: raise."""
    if seconds <= 0:
        raise ValueError(f"{what}: measured seconds must be > 0 (got {seconds})")
    value = floor / seconds
    if value > 1.0 + 1e-9:
        raise LimitError(f"{what}: {100 * value:.0f}% of the hardware limit: the peak or bandwidth it divides by "
                         "is lower than what the machine did (a wrong denominator)")
    return value


# Published figures, for predictions only (NVIDIA H100 SXM5 80 GB datasheet: dense, no sparsity).
H100 = Limits(gflops={"bf16": 989_000.0, "tf32": 494_000.0, "fp32": 67_000.0}, bandwidth_gbs=3350.0)
NVLINK_GBS = 450.0  # H100 NVLink 4: 900 GB/s bidirectional per GPU, 450 each way


def predict_step(shape: Shape, limits: Limits, gpus: int, samples: int, prompt_tokens: int, completion_tokens: int,
                 group: int, lora: bool = False, precision: str = "bf16") -> dict[str, float]:
    """Floor seconds of one GRPO step on `gpus` GPUs in data parallel (rows split evenly, one gradient
    all-reduce of 2 (g-1)/g x gradient bytes over NVLink): a prediction, never a measurement."""
    rows = samples / gpus
    prompts = samples / group / gpus
    prefill = forward_flops(shape, prompts * prompt_tokens, 0, prompt_tokens / 2)
    decode = forward_flops(shape, rows * completion_tokens, rows * completion_tokens,
                           prompt_tokens + completion_tokens / 2)
    decode_moved = decode_bytes(shape, int(rows), prompt_tokens, completion_tokens, precision)
    generate = floor_seconds(limits, prefill, 0.0, precision) + floor_seconds(limits, decode, decode_moved, precision)
    learn_flops = learning_flops(shape, prompts * prompt_tokens, rows * completion_tokens, lora,
                                 (prompt_tokens + completion_tokens) / 2)
    learn = floor_seconds(limits, learn_flops, learning_bytes(shape, lora, precision), precision)
    trained = 0.01 * shape.parameters() if lora else shape.parameters()  # LoRA: adapters, ~1% (rank 16 order)
    reduce = 2 * (gpus - 1) / gpus * trained * BYTES[precision] / (NVLINK_GBS * 1e9) if gpus > 1 else 0.0
    return {"generate_s": generate, "learn_s": learn, "all_reduce_s": reduce, "step_s": generate + learn + reduce}


# ------------------------------------------------------------------ memory (B8's full-or-LoRA choice and OOM estimate)

RUNTIME_BYTES = 512 * 1024**2  # a Python process with torch and transformers imported, before any model


def training_memory_bytes(shape: Shape, samples: int, group: int, prompt_tokens: int, completion_tokens: int,
                          lora: bool, prompt_per_sample: bool = False, logits_chunk: int = 0,
                          checkpointing: bool = False, copy_bytes: int = 0, moment_bytes: int = 8,
                          token_budget: int = 0) -> dict[str, float]:
    """An estimate (fp32) of a GRPO step's resident memory, by part.

    - model: every parameter once in fp32 (tied head: one matrix); full fine-tune adds its fp32 gradient and
      AdamW's two moments (moment_bytes per parameter: 8 in fp32, 4 in bf16); LoRA adds nothing that counts (< 1%);
    - activations kept for the backward, per token and layer: ~10 hidden-wide tensors (norm inputs and
      outputs, q, attention output, o projection, residuals) + 4 intermediate-wide (gate, up, their
      product, the activation) + k and v; with activation checkpointing, each layer's input alone
      (one hidden-wide tensor per token and layer) plus one layer's full set while it is recomputed;
    - logits: the log-softmax over the vocabulary kept for the backward, three (tokens, vocab) tensors
      (logits, log-probs, their gradient) for every completion token; where the pass chunks them (hasten's
      speed.logit_chunk_tokens), two for `logits_chunk` tokens at a time (one buffer that holds the logits,
      then their softmax, then its gradient: train/packing.py; and a margin for the gradient's transposed
      copy where fast_linear makes one);
    - KV cache of the decode: every row's positions;
    - runtime: the interpreter, torch and its libraries (~0.5 GiB), and copy_bytes per parameter of a second
      copy of the weights (hasten's lean engine under speed.engine_weights=copy samples from its own packed
      weights, in the precision it samples in: train/microbatch.py's COPY_BYTES; under shared it reads the
      training weights: 0).
    prompt_per_sample: the prompt is in every sample's row (TRL) rather than once per group (hasten).
    token_budget: the learning pass runs micro-batches of at most this many tokens (hasten's
    speed.token_budget; 0 = one pass), as few as fit and evenly cut (train/microbatch.py), so activations
    are kept for the batch's tokens / that number at a time (one sample's at least: a sample is never split).
    """
    count = shape.parameters(tied=True)
    model = count * (4 if lora else 8 + moment_bytes)
    prompts = samples if prompt_per_sample else samples // max(group, 1)
    tokens = prompts * prompt_tokens + samples * completion_tokens
    per_layer = (10 * shape.hidden + 4 * shape.intermediate + 2 * shape.kv_width) * 4
    per_token = (shape.layers * shape.hidden * 4 + per_layer) if checkpointing else shape.layers * per_layer
    if token_budget > 0:
        pieces = -(-tokens // max(token_budget, 1))
        tokens = min(tokens, max(-(-tokens // pieces), prompt_tokens + completion_tokens))
    logit_tokens = samples * completion_tokens if logits_chunk <= 0 else min(logits_chunk, samples * completion_tokens)
    # a chunked backward also holds the head's weight gradient and a head-sized transient (train/microbatch.py)
    head_transients = 2 * shape.vocab * shape.hidden * 4 if logits_chunk > 0 else 0
    parts = {"model": float(model), "activations": float(tokens * per_token),
             "logits": float((3 if logits_chunk <= 0 else 2) * logit_tokens * shape.vocab * 4 + head_transients),
             "kv_cache": float(samples * (prompt_tokens + completion_tokens) * kv_bytes_per_position(shape)),
             "runtime": float(RUNTIME_BYTES + count * copy_bytes)}
    parts["total"] = sum(parts.values())
    return parts
