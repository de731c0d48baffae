"""Switchable speed features, one module each, all configured in the `speed:` section.

    reward_cache.py      LRU of deterministic reward scores
    reward_pool.py       slow reward functions in a thread or process pool
    early_stop.py        a gate reward: failing samples skip the other rewards
    scoring.py           the three above around runner.score_rewards' contract
    curriculum.py        easy prompts first (length, complexity, success_rate)
    dynamic_sampling.py  DAPO: drop zero-variance groups, refill, with a cap
    prefetch.py          the next step's prompts drawn and encoded in the background
    precision.py         autocast (bf16/fp16), fp16 GradScaler, TF32, AdamW kernels
    compile.py           torch.compile with a capability check and a logged fallback
    nan_guard.py         skip non-finite updates; lower lr or drop mixed precision
    memory.py            gradient checkpointing, reference-model CPU offload, pack ratio

Profiles that bundle them are in hasten/profiles.py; docs/speedups.md has one
section per feature with what it does, when it helps and what it measured here.
"""
