"""SFT profiles: named bundles of `sft.*` settings, and how an RFT command's config is layered.

A profile only chooses HOW the same training runs (packing, checkpointing,
micro-batch size, optimizer kernel, compile, precision, loader workers);
it never changes the learning rate, epochs, batch size or LoRA shape, so
plain, conservative and balanced learn the same thing up to float rounding.
aggressive alone trades exactness for speed: its matmuls run in bf16 (on
CPU too), so its losses differ at the 1e-3 level; `hasten rft compare`
puts its accuracy beside the others so the cost, if any, shows. Micro-batches do not change
the result because the loss is summed per micro-batch and divided by the
whole optimizer batch's target tokens.

Layering, each overriding the one before:
  1. the dataclass defaults (hasten/config.py; `sft` defaults = balanced)
  2. the command's defaults (RFT commands hold out 100 questions; sft trains LoRA)
  3. the profile (`--profile NAME`)
  4. the YAML file (`--config`)
  5. `--section.key=value` flags
A key the YAML file sets is never overridden by 2 or 3, so a profile is a
starting point that any flag or file can change one setting at a time.

Measured on the 2-core CPU: see docs/rft.md (`hasten rft compare`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, load_config


@dataclass(frozen=True)
class Profile:
    description: str
    settings: dict[str, Any]


PROFILES: dict[str, Profile] = {
    # The reference every speed-up is measured against: what a plain transformers Trainer
    # run of the homework does (padded batches, full logits, gradient checkpointing on,
    # for-loop AdamW, fp32, no compile, no loader workers).
    "plain": Profile("padded batches, full logits, checkpointing on, for-loop AdamW, fp32", {
        "sft.packing": False, "sft.gradient_checkpointing": True, "sft.gradient_accumulation_steps": 1,
        "sft.adamw": "plain", "sft.precision": "fp32", "sft.compile": "off", "sft.num_workers": 0,
        "speed.allocator": "glibc",
    }),
    # Lowest memory: packed, checkpointed, 8 micro-batches per step (16 / 8 = 2 examples each).
    "conservative": Profile("packed, checkpointing on, 8 micro-batches per step, fused AdamW", {
        "sft.packing": True, "sft.gradient_checkpointing": True, "sft.gradient_accumulation_steps": 8,
        "sft.adamw": "fused", "sft.precision": "auto", "sft.compile": "off", "sft.num_workers": 0,
    }),
    # The default: packed, no checkpointing, 4 micro-batches per step (16 / 4 = 4 examples each).
    # Small micro-batches are faster on a CPU, not only leaner (the A/B measurement: docs/rft.md).
    "balanced": Profile("packed, no checkpointing, 4 micro-batches per step, fused AdamW", {
        "sft.packing": True, "sft.gradient_checkpointing": False, "sft.gradient_accumulation_steps": 4,
        "sft.adamw": "fused", "sft.precision": "auto", "sft.compile": "off", "sft.num_workers": 0,
    }),
    # balanced + bf16 autocast on every device (trades exactness for a faster step: docs/rft.md)
    # + torch.compile on a GPU only (on a CPU inductor takes minutes to compile even the test
    # model) + one loader worker.
    "aggressive": Profile("balanced + bf16 autocast (not exact) + torch.compile on GPU + 1 loader worker", {
        "sft.packing": True, "sft.gradient_checkpointing": False, "sft.gradient_accumulation_steps": 4,
        "sft.adamw": "fused", "sft.precision": "bf16", "sft.compile": "gpu", "sft.num_workers": 1,
    }),
}

# Held-out questions are drawn before training ones, so every RFT command must agree on
# task.num_eval for the training questions (datagen) to stay disjoint from the test (100).
RFT_DEFAULTS: dict[str, Any] = {"task.num_eval": 100, "eval.num_examples": 100}
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "datagen": RFT_DEFAULTS,
    "test": RFT_DEFAULTS,
    "sft": {**RFT_DEFAULTS, "model.lora": True},  # the homework's LoRA SFT
}


def profile_settings(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    if name not in PROFILES:
        raise ConfigError(f"config error: --profile must be one of {', '.join(PROFILES)} (got {name!r})")
    return dict(PROFILES[name].settings)


def _yaml_keys(path: str | Path | None) -> set[str]:
    """Dotted keys a YAML config sets; empty if it cannot be read (load_config then reports why)."""
    if path is None:
        return set()
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return set()
    if not isinstance(data, dict):
        return set()
    return {f"{section}.{key}" for section, values in data.items() if isinstance(values, dict)
            for key in values}


def load_rft_config(command: str, path: str | Path | None, overrides: list[tuple[str, Any]],
                    profile: str | None = None) -> Config:
    """The config of one RFT command, layered as the module docstring says, validated."""
    base = {**COMMAND_DEFAULTS.get(command, RFT_DEFAULTS), **profile_settings(profile)}
    from_file = _yaml_keys(path)
    pairs = [(key, value) for key, value in base.items() if key not in from_file]
    return load_config(path, pairs + list(overrides))
