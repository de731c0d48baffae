"""Grouped-query attention on CUDA: repeat K/V where torch would run the math kernel.

`F.scaled_dot_product_attention(..., enable_gqa=True)` (query heads a multiple of
the key/value heads) runs in only two of CUDA's kernels in torch 2.13: flash,
which needs fp16/bf16 and no arbitrary mask, and math. fp32 attention (the
default precision) and every masked call (the grouped and packed learning
passes) therefore fall to the math kernel, which forms the whole (L, S) fp32
score matrix per head and keeps it for backward: quadratic memory that
speed.token_budget=auto does not count. Repeating K/V to the query's head
count, as transformers' repeat_kv does, lets the memory-efficient kernel run
instead (fp32 and masks allowed, no score matrix kept), for a K/V copy linear
in S. The CPU keeps enable_gqa (its flash kernel handles it; measured there).
Decoding (rollout/) keeps enable_gqa too: a one-token query's scores are (1, S).
"""

from __future__ import annotations

from typing import Any

import torch

HALF = (torch.float16, torch.bfloat16)


def math_kernel_would_run(device_type: str, dtype: torch.dtype, masked: bool, gqa: bool) -> bool:
    """CUDA SDPA with enable_gqa and an input flash cannot take (fp32, or an explicit mask)."""
    return device_type == "cuda" and gqa and (dtype not in HALF or masked)


def repeat_kv_where_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(key, value, kwargs) for SDPA: K/V repeated to the query's heads, enable_gqa off, where the math
    kernel would run; else as given. Query head h reads K/V head h // groups, as enable_gqa does."""
    gqa = bool(kwargs.get("enable_gqa")) and query.shape[-3] != key.shape[-3]
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    if not math_kernel_would_run(device_type, dtype, kwargs.get("attn_mask") is not None, gqa):
        return key, value, kwargs
    groups = query.shape[-3] // key.shape[-3]
    return (key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3),
            {**kwargs, "enable_gqa": False})
