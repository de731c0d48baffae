"""Speed profiles: `--profile baseline | conservative | balanced | aggressive`.

A profile is a named bundle of config values applied on top of the YAML file
and under the command-line overrides (defaults <- YAML <- profile <-
--section.key=value), so `--profile balanced --speed.reward_workers=4` works.

    baseline      every acceleration off: the plain reference path (transformers
                  forward for generation, padded learning pass with MKL matmuls and
                  dense attention, for-loop AdamW,
                  rewards scored inline, nothing cached or prefetched)
    conservative  every acceleration that cannot change what is learned (equal
                  to the code defaults of the speed: section)
    balanced      conservative + DAPO dynamic sampling (one extra generation
                  round at most) + the early-termination gate as configured +
                  when the model lives on a GPU (model.device): bf16 autocast
                  (where the GPU has it), TF32 and torch.compile; on a CPU with
                  native bf16 (AVX512-BF16 or AMX): sampling in bf16
                  (generation.precision, importance-weighted), measured
                  to learn as fp32 sampling does on B5 (docs/results/speedups-notes.md)
    aggressive    balanced + half the generations per prompt, 3/4 of the
                  completion budget and an easy-first curriculum; on a CPU
                  without native bf16, sampling in int8 (importance-weighted;
                  on B5 its final accuracy held but +20 points were not shown
                  to come as fast as with fp32 sampling: docs/speedups.md)

The NaN guard stays on in every profile: it is a safety net, not an
acceleration. `TRADES` says, per profile, what it trades away; `hasten
compare` prints it next to the numbers. Values that depend on the run are
functions of the config so far (e.g. `aggressive` halves the configured
num_generations rather than setting a constant), which keeps the arithmetic
visible here.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

Config = Any  # hasten.config.Config: profiles sit below config (config applies them), so no import of it

Value = Any  # a plain value, or Callable[[Config], value] read from the config so far


def _device(cfg: Config):
    """The device the run's model will live on (model.device resolved): profiles decide from it."""
    from .device import resolve_device

    return resolve_device(cfg.model.device)


def _cuda(cfg: Config) -> bool:
    return _device(cfg).type == "cuda"


def _bf16(cfg: Config) -> bool:
    from .device import bf16_supported

    return bf16_supported(_device(cfg))


def _bf16_sampling(cfg: Config) -> str:
    """generation.precision for balanced: bf16 where the lean engine samples on a CPU with bf16 matmuls.

    On B5 it learned as fp32 sampling does, in less time a step (docs/results/, B5).
    Not on a GPU (not measured there) nor where bf16 is emulated (slower than fp32)."""
    from .device import cpu_has_native_bf16

    lean = cfg.speed.engine in ("auto", "lean")
    return "bf16" if lean and _device(cfg).type == "cpu" and cpu_has_native_bf16() else "fp32"


def _low_precision_sampling(cfg: Config) -> str:
    """generation.precision for aggressive: balanced's bf16 where the CPU has it, else int8 (its
    decode matmuls on VNNI; kernels/int8.py) where the lean engine samples on the CPU."""
    chosen = _bf16_sampling(cfg)
    if chosen != "fp32" or cfg.speed.engine not in ("auto", "lean") or _device(cfg).type != "cpu":
        return chosen
    from .device import cpu_int8_unavailable_reason

    return "int8" if cpu_int8_unavailable_reason() is None else "fp32"


BASELINE: dict[str, Value] = {
    "speed.engine": "hf",
    "speed.model_impl": "hf",
    "speed.keep_freed_memory": False,
    "speed.allocator": "glibc",
    "speed.packed_learning": False,
    "speed.grouped_attention": False,
    "speed.shared_prefix": False,
    "speed.decode_attention": False,
    "speed.skip_zero_advantage": False,
    "speed.fast_linear": False,
    "speed.token_budget": 0,
    "speed.min_pack_ratio": 0.0,
    "speed.reward_workers": 0,
    "speed.reward_cache": False,
    "algo.gate_reward": None,
    "algo.curriculum": "off",
    "algo.dynamic_sampling": False,
    "train.precision": "fp32",
    "generation.precision": "fp32",
    "speed.engine_weights": "copy",  # the lean engine's fused copy (baseline's engine is hf: nothing read)
    "train.tf32": False,
    "speed.compile": False,
    "speed.optimizer": "for_loop",
    "train.optimizer_moments": "fp32",
    "speed.gradient_checkpointing": False,
    "speed.offload_reference": False,
    "speed.nan_guard": True,
    "speed.prefetch": False,
}

CONSERVATIVE: dict[str, Value] = {
    **BASELINE,
    "speed.engine": "auto",
    "speed.model_impl": "auto",
    "speed.keep_freed_memory": True,
    "speed.allocator": "auto",
    "speed.packed_learning": True,
    "speed.grouped_attention": True,
    "speed.shared_prefix": True,
    "speed.decode_attention": "auto",
    "speed.skip_zero_advantage": True,
    "speed.fast_linear": "auto",
    "speed.engine_weights": "auto",
    "speed.token_budget": "auto",
    "speed.reward_workers": 2,
    "speed.reward_cache": True,
    "speed.optimizer": "auto",
    "speed.prefetch": True,
}

BALANCED: dict[str, Value] = {
    **CONSERVATIVE,
    "algo.gate_reward": lambda cfg: cfg.algo.gate_reward,  # early termination as configured (off unless set)
    "algo.dynamic_sampling": True,
    "algo.dynamic_sampling_max_rounds": 1,
    # CPU: fp32. bf16 autocast is faster on CPUs with native bf16 but changes numerics (it learned
    # less per step on B5) and is slower on CPUs without it; opt in with --train.precision=bf16 (docs/results/speedups-notes.md).
    # A GPU without native bf16 (before Ampere) stays fp32 too: fp16 needs a loss scaler's care.
    "train.precision": lambda cfg: "bf16" if _bf16(cfg) else "fp32",
    "generation.precision": _bf16_sampling,
    "train.tf32": True,  # only a CUDA model reads it
    "speed.compile": _cuda,  # CPU: compile time is never paid back in short runs
}

AGGRESSIVE: dict[str, Value] = {
    **BALANCED,
    "generation.num_generations": lambda cfg: max(2, cfg.generation.num_generations // 2),  # 8 -> 4
    "generation.max_new_tokens": lambda cfg: max(1, cfg.generation.max_new_tokens * 3 // 4),  # 64 -> 48
    "algo.curriculum": "success_rate",
    "algo.curriculum_warmup_steps": lambda cfg: cfg.train.steps // 4,  # the first quarter of the run
    "generation.precision": _low_precision_sampling,
}

PROFILES: dict[str, dict[str, Value]] = {
    "baseline": BASELINE,
    "conservative": CONSERVATIVE,
    "balanced": BALANCED,
    "aggressive": AGGRESSIVE,
}

# What each profile gives up; "" = it learns exactly what baseline learns (up to float rounding).
TRADES: dict[str, str] = {
    "baseline": "",
    "conservative": "",
    "balanced": "changes the batch: algo.dynamic_sampling drops zero-variance groups and refills them (DAPO, "
                "algo.dynamic_sampling_max_rounds=1); "
                "algo.gate_reward, where set, gives gated samples a fixed reward; on a CPU with native bf16, "
                "generation.precision=bf16 (importance-weighted); on a GPU, train.precision=bf16 and train.tf32",
    "aggressive": "trades quality: half the generations per prompt, 3/4 of the completion tokens, easy prompts "
                  "first (algo.curriculum over algo.curriculum_warmup_steps); on a CPU without native bf16, "
                  "generation.precision=int8 (importance-weighted); plus balanced's changes",
}


def resolve(name: str, cfg: Config) -> dict[str, Any]:
    """The concrete key -> value settings of profile `name` for the config so far."""
    if name not in PROFILES:
        raise ConfigError(f"config error: unknown profile '{name}' (choose from {', '.join(PROFILES)})")
    return {key: value(cfg) if callable(value) else value for key, value in PROFILES[name].items()}
