"""TRL 1.16 GRPOConfig fields hasten does not take, with TRL's defaults and the reason.

A field left at its TRL default is accepted (a script that spells out
defaults still runs); any other value is one UserError naming the field and
why. TrainingArguments' own fields (transformers) not listed here and not
supported by hasten/api/grpo_config.py are checked against the installed
transformers' defaults the same way (`unsupported_value`). docs/trl.md is
the human-readable table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

VLLM = "use_vllm maps onto speed.engine=vllm (speed.vllm_server in server mode); this vLLM option has no counterpart there"
HUB = "hasten does not push to the Hugging Face Hub; upload the run's checkpoint/ yourself"
MULTI = "hasten runs one process on one device"

# name -> (TRL 1.16 default, why hasten does not take another value)
GRPO_ONLY: dict[str, tuple[Any, str]] = {
    "trust_remote_code": (False, "hasten loads Llama-family models and transformers' own classes only"),
    "disable_dropout": (False, "hasten's models run without dropout at generation; training keeps the model's own"),
    "ds3_gather_for_generation": (True, MULTI),
    "cache_implementation": (None, "the engines own their KV caches (rollout/)"),
    "vllm_model_impl": ("vllm", VLLM),
    "vllm_enable_sleep_mode": (False, VLLM), "vllm_structured_outputs_regex": (None, VLLM),
    "vllm_server_timeout": (240.0, VLLM), "vllm_group_port": (51216, VLLM), "vllm_max_model_length": (None, VLLM),
    "vllm_tensor_parallel_size": (1, VLLM), "vllm_importance_sampling_correction": (True, VLLM),
    "vllm_importance_sampling_mode": ("sequence_mask", VLLM), "vllm_importance_sampling_clip_max": (3.0, VLLM),
    "vllm_importance_sampling_clip_min": (None, VLLM), "vllm_importance_sampling_cap": (None, VLLM),
    "log_multimodal": (True, "hasten trains text models only"),
    "num_completions_to_print": (None, "hasten prints no completions; output.log_completions sends them to trackers"),
    "log_unique_prompts": (False, "completions are logged per sample (output.log_completions)"),
    "log_completions_hub_repo": (None, HUB),
    "use_transformers_continuous_batching": (False, "hasten generates with its own engines (speed.engine)"),
    "transformers_continuous_batching_config": (None, "hasten generates with its own engines (speed.engine)"),
    "use_transformers_paged": (False, "hasten generates with its own engines (speed.engine)"),
    "remove_unused_columns": (False, "every dataset column reaches the reward functions, as with TRL's default"),
}

SFT = "hasten's SFT (rft/sft.py) has no counterpart for this option"

# SFTConfig's own fields (beyond TrainingArguments) hasten's SFTConfig does not take: name -> (TRL 1.16
# default, why hasten does not take another value)
SFT_ONLY: dict[str, tuple[Any, str]] = {
    "trust_remote_code": (False, GRPO_ONLY["trust_remote_code"][1]),
    "dataset_num_proc": (None, "hasten tokenizes in its own process"),
    "eos_token": (None, SFT), "pad_token": (None, SFT), "truncation_mode": ("keep_start", SFT),
    "shuffle_dataset": (False, SFT), "pad_to_multiple_of": ("auto", SFT),
    "activation_offloading": (False, SFT),
}

# TrainingArguments fields whose defaults TRL's GRPOConfig overrides (the rest come from transformers).
TRL_OVERRIDES = {"logging_steps": 10, "gradient_checkpointing": True, "bf16": None, "learning_rate": 1e-6,
                 "remove_unused_columns": False}


def training_arguments_defaults() -> dict[str, Any]:
    """transformers.TrainingArguments' fields and defaults (imported only when a non-hasten field is given)."""
    from transformers import TrainingArguments

    defaults = {}
    for item in dataclasses.fields(TrainingArguments):
        if item.default is not dataclasses.MISSING:
            defaults[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:
            defaults[item.name] = item.default_factory()
    return defaults


def unsupported_value(name: str, value: Any, trainer: str = "GRPOConfig") -> str | None:
    """Why `name=value` cannot be honoured (None: it is the TRL default, so nothing is lost)."""
    if name in GRPO_ONLY and trainer == "GRPOConfig":
        default, reason = GRPO_ONLY[name]
        return None if value == default else f"{name}={value!r} is not supported by hasten ({reason})"
    if name in SFT_ONLY and trainer == "SFTConfig":
        default, reason = SFT_ONLY[name]
        return None if value == default else f"{name}={value!r} is not supported by hasten ({reason})"
    defaults = training_arguments_defaults()
    if name in defaults:
        default = TRL_OVERRIDES.get(name, defaults[name])
        if value == default:
            return None
        return (f"{name}={value!r} is not supported by hasten (a transformers TrainingArguments option hasten's "
                "loop has no counterpart for; docs/trl.md lists what is)")
    return f"{name} is not a {trainer} field of TRL 1.16 (misspelt?)"


def markdown_table() -> str:
    """docs/trl.md's "not supported" table, from GRPO_ONLY (tests/test_trl_docs.py keeps the doc equal to it):
    one row per reason, its fields with their TRL defaults."""
    reasons: dict[str, list[str]] = {}
    for name, (default, reason) in GRPO_ONLY.items():
        reasons.setdefault(reason, []).append(f"`{name}` ({default!r})")
    rows = ["| fields (TRL default, the only value accepted) | why |", "|---|---|"]
    rows += [f"| {', '.join(names)} | {reason} |" for reason, names in reasons.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
