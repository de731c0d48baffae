"""The cost model: the FLOPs and bytes each phase of a GRPO step must spend, and the floor they set.

hasten bench reports how far each phase is from what the machine can do, as floor seconds / measured
seconds (always <= 100% when the limits are right: a figure above it means a denominator is wrong).
docs/cost-model.md states the same formulas and their predictions for GPUs.

Counting (N_body = every weight applied at every position: all parameters but the input embedding, a
lookup, and the LM head; N_head = the LM head's weight, counted once where it is tied):
- prefill: 2 N_body FLOPs per prompt token, once per prompt (the group shares it);
- decode: 2 (N_body + N_head) FLOPs per generated token; each decode step reads every weight once
  (shared by the live rows) and each live row's K/V cache so far: 2 x layers x kv_width values a token;
- learning (forward + backward): 6 N_body per prompt token (once per group) plus 6 (N_body + N_head)
  per completion token; with LoRA, 4 instead of 6 (no weight gradients of the frozen base).
Attention scores, norms, sampling and the optimizer are left out (a few % at these lengths): the
floor is a lower bound, which is what a "fraction of the limit" needs.

A phase's floor is compute-bound or memory-bound, whichever is slower: prefill and learning by the
best matmul rate at their precision; decode by max(FLOPs / rate, bytes / bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # per value, by precision


@dataclass(frozen=True)
class ModelSize:
    body: int  # parameters applied at every position
    head: int  # LM head parameters, applied where logits are needed
    layers: int = 0  # decoder layers (for the K/V cache's bytes)
    kv_width: int = 0  # key/value heads x head dim: one token's K (or V) in one layer


def model_size(model) -> ModelSize:
    """The counts of a loaded model (transformers' surface: input/output embeddings and .config)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head)
    layers, kv_width = _cache_shape(model.config)
    return ModelSize(body, head.numel(), layers, kv_width)


def size_from_config(config) -> ModelSize:
    """The counts of a Llama/Qwen2-shaped model from its config alone (no weights built): for predictions."""
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    if getattr(config, "attention_bias", False) or getattr(config, "model_type", "") == "qwen2":
        attention += heads * head_dim + 2 * kv_heads * head_dim  # q, k, v biases
    mlp = 3 * hidden * config.intermediate_size
    norms = 2 * hidden
    body = layers * (attention + mlp + norms) + hidden  # + the final norm
    return ModelSize(body, vocab * hidden, layers, kv_heads * head_dim)


def _cache_shape(config) -> tuple[int, int]:
    heads = getattr(config, "num_attention_heads", 0) or 0
    if not heads:
        return 0, 0
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads * head_dim


def generation_flops(size: ModelSize, prompt_tokens: float, generated_tokens: float) -> float:
    return 2 * size.body * (prompt_tokens + generated_tokens) + 2 * size.head * generated_tokens


def learning_flops(size: ModelSize, prompt_tokens: float, completion_tokens: float, lora: bool = False) -> float:
    per = 4 if lora else 6
    return per * size.body * (prompt_tokens + completion_tokens) + per * size.head * completion_tokens


def context_reads(prompt_lengths: list[int], completion_lengths: list[int]) -> float:
    """Cache tokens read over a decode: row r reads p_r + t cached tokens at its step t < L_r."""
    return float(sum(length * prompt + length * (length - 1) / 2
                     for prompt, length in zip(prompt_lengths, completion_lengths)))


def decode_bytes(size: ModelSize, precision: str, decode_steps: int, reads: float) -> float:
    """Weights once per decode step (shared by the rows) + every cached K/V value each row reads."""
    value = BYTES[precision]
    return decode_steps * (size.body + size.head) * value + reads * 2 * size.layers * size.kv_width * value


@dataclass(frozen=True)
class Limits:
    """What the machine can do, measured in the same run (bench/machine.py) or published (predictions)."""

    fp32_gflops: float  # best fp32 matmul rate over the kernels hasten uses, at the model's shapes
    bf16_gflops: float  # the same in bf16
    bandwidth_gbs: float  # memory bandwidth (a STREAM-like triad)

    def flops_per_second(self, precision: str) -> float:
        return 1e9 * (self.fp32_gflops if precision == "fp32" else self.bf16_gflops)


@dataclass(frozen=True)
class Floor:
    """The seconds a phase cannot go below on a machine, and which limit sets it."""

    seconds: float
    bound: str  # compute | memory


def prefill_floor(size: ModelSize, limits: Limits, precision: str, prompt_tokens: float) -> Floor:
    return Floor(2 * size.body * prompt_tokens / limits.flops_per_second(precision), "compute")


def decode_floor(size: ModelSize, limits: Limits, precision: str, generated_tokens: float, decode_steps: int,
                 reads: float) -> Floor:
    compute = 2 * (size.body + size.head) * generated_tokens / limits.flops_per_second(precision)
    memory = decode_bytes(size, precision, decode_steps, reads) / (limits.bandwidth_gbs * 1e9)
    return Floor(max(compute, memory), "memory" if memory >= compute else "compute")


def learning_floor(size: ModelSize, limits: Limits, precision: str, prompt_tokens: float,
                   completion_tokens: float, lora: bool = False) -> Floor:
    flops = learning_flops(size, prompt_tokens, completion_tokens, lora)
    return Floor(flops / limits.flops_per_second(precision), "compute")


@dataclass(frozen=True)
class StepShape:
    """The work of one GRPO step: prompts once per group, completions per sample."""

    prompt_lengths: list[int]  # per prompt (each prefilled once)
    completion_lengths: list[int]  # per sample, group-major
    num_generations: int

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lengths)

    @property
    def completion_tokens(self) -> int:
        return sum(self.completion_lengths)

    def reads(self) -> float:
        per_sample = [self.prompt_lengths[index // self.num_generations]
                      for index in range(len(self.completion_lengths))]
        return context_reads(per_sample, self.completion_lengths)


def step_floors(size: ModelSize, limits: Limits, shape: StepShape, generation_precision: str = "fp32",
                learning_precision: str = "fp32", lora: bool = False) -> dict[str, Floor]:
    """{generate, learn} floors of one GRPO step of `shape` (generate = prefill + decode)."""
    prefill = prefill_floor(size, limits, generation_precision, shape.prompt_tokens)
    decode = decode_floor(size, limits, generation_precision, shape.completion_tokens,
                          max(shape.completion_lengths, default=0), shape.reads())
    return {"generate": Floor(prefill.seconds + decode.seconds, decode.bound),
            "learn": learning_floor(size, limits, learning_precision, shape.prompt_tokens, shape.completion_tokens,
                                    lora)}


# Published dense peaks (no sparsity) and HBM bandwidth: predictions only, never a measured figure.
PUBLISHED = {
    "H100 SXM": Limits(fp32_gflops=67_000, bf16_gflops=989_000, bandwidth_gbs=3_350),
}


# Published shapes of the models the scaling grid (B8) uses; for predictions and for random-weight builds.
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, vocab_size=49152, num_attention_heads=9,
                         num_key_value_heads=3, intermediate_size=1536, model_type="llama"),
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, vocab_size=151936, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, model_type="qwen2"),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, vocab_size=151936, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, model_type="qwen2"),
}
NVLINK_GBS = 450.0  # H100 SXM NVLink 4: 900 GB/s both directions, 450 each way (published)


def predict_step(size: ModelSize, limits: Limits, shape: StepShape, gpus: int = 1, precision: str = "bf16",
                 interconnect_gbs: float = NVLINK_GBS) -> dict[str, float]:
    """Floor seconds of one GRPO step on `gpus` devices of `limits`, data parallel over whole groups:
    each device samples and learns its share of the groups (reading every weight each decode step all
    the same), then the fp32 gradients are all-reduced (a ring: 2 (g - 1) / g of them over the link)."""
    groups = len(shape.prompt_lengths) // gpus
    share = StepShape(shape.prompt_lengths[:groups], shape.completion_lengths[:groups * shape.num_generations],
                      shape.num_generations)
    floors = step_floors(size, limits, share, precision, precision)
    reduce = 0.0 if gpus == 1 else 2 * (gpus - 1) / gpus * (size.body + size.head) * 4 / (interconnect_gbs * 1e9)
    return {"generate": floors["generate"].seconds, "learn": floors["learn"].seconds, "all_reduce": reduce,
            "step": floors["generate"].seconds + floors["learn"].seconds + reduce}


def prediction_table(lengths: tuple[int, ...] = (64, 256, 1024), prompts: int = 8, generations: int = 8,
                     prompt_tokens: int = 40) -> list[str]:
    """docs/cost-model.md's table of predicted floors on 1 and 8 H100s (a test keeps the doc equal to it)."""
    import types

    h100 = PUBLISHED["H100 SXM"]
    lines = ["| model | completion tokens | 1 H100: generate / learn / step (ms) | 8 H100: generate / learn / "
             "all-reduce / step (ms) |", "|---|---|---|---|"]
    for name, fields in SHAPES.items():
        size = size_from_config(types.SimpleNamespace(**fields))
        for length in lengths:
            shape = StepShape([prompt_tokens] * prompts, [length] * (prompts * generations), generations)
            one, eight = predict_step(size, h100, shape), predict_step(size, h100, shape, gpus=8)
            lines.append(f"| {name} | {length} | {1e3 * one['generate']:.1f} / {1e3 * one['learn']:.1f} / "
                         f"{1e3 * one['step']:.1f} | {1e3 * eight['generate']:.1f} / {1e3 * eight['learn']:.1f} / "
                         f"{1e3 * eight['all_reduce']:.1f} / {1e3 * eight['step']:.1f} |")
    return lines
