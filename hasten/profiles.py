"""Speed profiles: `--profile baseline | conservative | balanced | aggressive`.

A profile is a named bundle of config values applied on top of the YAML file
and under the command-line overrides (defaults <- YAML <- profile <-
--section.key=value), so `--profile balanced --speed.reward_workers=4` works.

    baseline      every acceleration off: the plain reference path (transformers
                  forward for generation, padded learning pass with MKL matmuls and
                  dense attention, for-loop AdamW,
                  rewards scored inline, nothing cached or prefetched)
    conservative  every acceleration that cannot change what is learned (equal
                  to the code defaults of the speed: section; fp32 learning and
                  sampling, where a run's default takes both at auto)
    balanced      conservative + DAPO dynamic sampling (one extra generation
                  round at most) + the early-termination gate as configured +
                  the precisions at `auto`, as a run's default: where the hardware
                  has native bf16 (AVX512-BF16, AMX, a bf16 GPU), a bf16 learning
                  pass with the LM head and its log-softmax in fp32 and bf16
                  sampling (importance-weighted), measured on B5 (docs/precision.md)
                  + when the model lives on a GPU (model.device): TF32 and torch.compile
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


def _low_precision_sampling(cfg: Config) -> str:
    """generation.precision for aggressive: int8 (its decode matmuls on VNNI; kernels/int8.py) where the
    lean engine samples on a CPU without native bf16; elsewhere auto (bf16 where the CPU has it)."""
    from .device import cpu_has_native_bf16, cpu_int8_unavailable_reason

    if cfg.speed.engine not in ("auto", "lean") or _device(cfg).type != "cpu" or cpu_has_native_bf16():
        return "auto"
    return "int8" if cpu_int8_unavailable_reason() is None else "auto"


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
    # bf16 learning with an fp32 head and bf16 sampling (importance-weighted) where the hardware has native bf16
    # and the model is wide enough, fp32 elsewhere: the run defaults (B5 over 12 seeds, docs/precision.md),
    # which conservative sets back to fp32.
    "train.precision": "auto",
    "generation.precision": "auto",
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

# What each profile gives up; "" = it learns what baseline learns: up to float rounding, and where the hardware
# has native bf16, up to bf16's rounding in the body's matmuls and sampling, measured (docs/precision.md).
TRADES: dict[str, str] = {
    "baseline": "",
    "conservative": "",
    "balanced": "changes the batch: algo.dynamic_sampling drops zero-variance groups and refills them (DAPO, "
                "algo.dynamic_sampling_max_rounds=1); "
                "algo.gate_reward, where set, gives gated samples a fixed reward; on a GPU, train.tf32",
    "aggressive": "trades quality: half the generations per prompt, 3/4 of the completion tokens, easy prompts "
                  "first (algo.curriculum over algo.curriculum_warmup_steps); on a CPU without native bf16, "
                  "generation.precision=int8 (importance-weighted); plus balanced's changes",
}


def resolve(name: str, cfg: Config) -> dict[str, Any]:
    """The concrete key -> value settings of profile `name` for the config so far, less what this launch
    cannot run (`held_back` says what that was)."""
    if name not in PROFILES:
        raise ConfigError(f"config error: unknown profile '{name}' (choose from {', '.join(PROFILES)})")
    settings = {key: value(cfg) if callable(value) else value for key, value in PROFILES[name].items()}
    for key, (runs, instead, _) in _launch_limits(cfg).items():
        if key in settings and not runs(settings[key]):
            settings[key] = instead
    return settings


def held_back(name: str, cfg: Config) -> dict[str, str]:
    """What profile `name` would set that this launch cannot run, key -> why (the plan line prints
    them): a profile the user did not edit never ends in a config error."""
    asked = {key: value(cfg) if callable(value) else value for key, value in PROFILES.get(name, {}).items()}
    return {key: why for key, (runs, _, why) in _launch_limits(cfg).items() if key in asked and not runs(asked[key])}


def _launch_limits(cfg: Config) -> dict[str, tuple[Any, Any, str]]:
    """key -> (does this value run here?, the value that does, why): config.validate_ranks' rules for a
    torchrun launch, and its FSDP rules (train/fsdp.py), for the keys a profile sets."""
    from .device import world_size_from_env

    if world_size_from_env() <= 1:
        return {}
    limits = {
        "algo.dynamic_sampling": (lambda value: not value, False, "not under torchrun yet"),
        "algo.curriculum": (lambda value: value != "success_rate", "off", "success_rate not under torchrun yet"),
    }
    if cfg.train.distributed == "fsdp":
        limits["speed.compile"] = (lambda value: not value, False, "not under FSDP")
    return limits


HELD_BACK = "_hasten_held_back"  # attribute load_config sets on a Config: held_back's list for its profile


def held_back_notes(cfg: Config) -> list[str]:
    """What the profile this config was built with left out for its launch (train/plan.py prints it)."""
    return list(getattr(cfg, HELD_BACK, []))
