"""Every `speed:` switch and the one module that implements it: the map from a flag to its code.

A feature is one module behind one flag; the flags that only tune a feature (its size, its cap, its
mode) point at the same module. docs/speedups.md says what each feature does and when it helps;
tests/test_architecture.py checks that this table names every `speed:` key and only modules that exist. The keys
that change what is learned left `speed` (hasten/config_yaml.py's MOVED) and this table with it.
Plain strings: this module imports nothing, so the settings layer can read it.
"""

from __future__ import annotations

FEATURES: dict[str, str] = {
    # generation
    "engine": "hasten.rollout.factory",  # auto | lean | hf | vllm, resolved against the model
    "model_impl": "hasten.models.llama",  # the native Llama forward (no transformers import)
    "engine_weights": "hasten.rollout.shared_weights",  # sample from the training weights, no fp32 copy
    "decode_attention": "hasten.kernels.decode_attention",  # the decode step's attention as one fused kernel
    "shared_prefix": "hasten.kernels.shared_prefix",  # the prompts' common prefix once (prefill and learning)
    "speculative": "hasten.rollout.speculative",
    "speculative_tokens": "hasten.rollout.speculative",
    "draft_model": "hasten.rollout.drafters",
    "ngram_size": "hasten.rollout.drafters",
    "vllm_server": "hasten.rollout.vllm_server",
    "vllm_memory_fraction": "hasten.rollout.vllm_engine",
    "vllm_kv_cache_mb": "hasten.rollout.vllm_engine",
    "vllm_max_model_len": "hasten.rollout.vllm_engine",
    "prefetch": "hasten.train.feeder",  # the next step's prompts drawn and encoded in the background
    # rewards and the batch
    "reward_workers": "hasten.rewards.reward_pool",
    "reward_pool": "hasten.rewards.reward_pool",
    "slow_rewards": "hasten.rewards.reward_pool",
    "reward_cache": "hasten.rewards.reward_cache",
    "reward_cache_size": "hasten.rewards.reward_cache",
    "cache_rewards": "hasten.rewards.reward_cache",
    "skip_zero_advantage": "hasten.algo.zero_advantage",
    # learning
    "packed_learning": "hasten.train.packing",  # one row per group, completion-only logits
    "logit_chunk_tokens": "hasten.train.packing",
    "min_pack_ratio": "hasten.train.packing",
    "grouped_attention": "hasten.kernels.grouped_attention",
    "token_budget": "hasten.train.microbatch",
    "fast_linear": "hasten.kernels.fast_linear",  # oneDNN linears in the learning pass
    "compile": "hasten.kernels.compile",
    "compile_mode": "hasten.kernels.compile",
    "optimizer": "hasten.kernels.adamw",
    "gradient_checkpointing": "hasten.kernels.memory",
    "offload_reference": "hasten.kernels.memory",
    "nan_guard": "hasten.kernels.nan_guard",
    "nan_guard_patience": "hasten.kernels.nan_guard",
    "nan_guard_action": "hasten.kernels.nan_guard",
    "nan_guard_lr_factor": "hasten.kernels.nan_guard",
    # the process
    "keep_freed_memory": "hasten.kernels.runtime",
    "allocator": "hasten.kernels.allocator",
    "adaptive_threads": "hasten.kernels.threads",
}
