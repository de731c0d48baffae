"""Which Llama-family checkpoints the native model (llama.py) and the lean engine (rollout/lean.py)
reproduce, read from config.json alone, and the RoPE frequencies each one uses.

Llama, Mistral, Qwen2/2.5 and Qwen3 are one architecture (pre-norm decoder,
RMSNorm, SwiGLU MLP, rotary attention with grouped KV heads) that differs in
a few switches. `FAMILIES` maps a `model_type` to a small pure function that
reads those switches from the config, as transformers' own classes do:

  llama    biases on q/k/v/o if `attention_bias`, on the MLP if `mlp_bias`
  mistral  no biases (MistralAttention hard-codes bias=False)
  qwen2    biases on q/k/v always, never on o_proj or the MLP
  qwen3    q/k RMSNorm over each head ("qk-norm"); biases on q/k/v/o if
           `attention_bias`; head_dim given explicitly (may differ from
           hidden_size / num_attention_heads)

RoPE (`inv_freq`): "default", "linear" (frequencies / factor) and "llama3"
(Llama 3.1's wavelength-banded scaling), each with transformers'
arithmetic (modeling_rope_utils.py) so the buffer is bitwise theirs; none
of the three scales cos/sin (attention_factor = 1).

Rejected, with the reason `unsupported_reason` returns (the caller logs it
and uses transformers):
- rope "dynamic": transformers recomputes the frequencies from the longest
  position in each forward, so a sequence's RoPE depends on its batch; the
  lean engine's table, the sampling pass and the packed learning pass would
  disagree past original_max_position_embeddings. "yarn", "longrope" and the
  rest also scale cos/sin and are not reproduced.
- a sliding window shorter than max_position_embeddings (Mistral-7B-v0.1's
  4096, Qwen with use_sliding_window): neither the native masks, the grouped
  attention layout nor the lean engine's cache implement a window. A window
  at least max_position_embeddings long (or none: Mistral v0.2+, every
  released Qwen2.5/Qwen3 config) never masks anything and is accepted.
- partial rotary embeddings, activations other than silu, pretraining_tp > 1.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch


class Features(NamedTuple):
    """The switches in which the supported families differ."""

    qkv_bias: bool  # q_proj, k_proj, v_proj carry a bias
    out_bias: bool  # o_proj carries a bias
    mlp_bias: bool  # gate_proj, up_proj, down_proj carry a bias
    qk_norm: bool  # self_attn.q_norm / k_norm: RMSNorm over head_dim before RoPE


def _llama(raw: dict[str, Any]) -> Features:
    bias = bool(raw.get("attention_bias", False))
    return Features(qkv_bias=bias, out_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)), qk_norm=False)


def _mistral(raw: dict[str, Any]) -> Features:
    return Features(qkv_bias=False, out_bias=False, mlp_bias=False, qk_norm=False)


def _qwen2(raw: dict[str, Any]) -> Features:
    return Features(qkv_bias=True, out_bias=False, mlp_bias=False, qk_norm=False)


def _qwen3(raw: dict[str, Any]) -> Features:
    bias = bool(raw.get("attention_bias", False))
    return Features(qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=True)


FAMILIES: dict[str, Callable[[dict[str, Any]], Features]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
}

ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE settings, from transformers 5's `rope_parameters` or the older `rope_scaling` + `rope_theta`."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))  # "type" is the pre-4.45 spelling
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    if rope["rope_type"] == "llama3":  # as transformers' standardize_rope_params
        rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return rope


def sliding_window(raw: dict[str, Any]) -> int | None:
    """The attention window some layer uses, or None when every layer attends to all earlier tokens."""
    window = raw.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None  # Qwen's configs carry a window that is off unless use_sliding_window
    layer_types = raw.get("layer_types")
    if layer_types and "sliding_attention" not in layer_types:
        window = None
    return window


def unsupported_reason(raw: dict[str, Any]) -> str | None:
    """Why the native model and the lean engine cannot reproduce a model with this config.json, or None."""
    model_type = raw.get("model_type")
    rope = rope_parameters(raw)
    window = sliding_window(raw)
    longest = raw.get("max_position_embeddings")
    checks = {
        f"model_type {model_type!r}": model_type not in FAMILIES,
        f"hidden_act {raw.get('hidden_act')!r}": raw.get("hidden_act", "silu") != "silu",
        f"rope_type {rope['rope_type']!r}": rope["rope_type"] not in ROPE_TYPES,
        "partial_rotary_factor < 1": rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0,
        f"sliding_window {window} < max_position_embeddings {longest}":
            window is not None and (longest is None or window < longest),
        "pretraining_tp > 1": raw.get("pretraining_tp", 1) != 1,
    }
    bad = [name for name, flag in checks.items() if flag]
    if not bad:
        return None
    return (f"the native Llama family covers {', '.join(FAMILIES)} with silu, rope {'/'.join(ROPE_TYPES)} "
            f"and no sliding window; this model has {', '.join(bad)}")


def inv_freq(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim / 2,), fp32, computed as transformers' rope init functions do."""
    base = rope["rope_theta"]
    frequencies = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope["rope_type"] == "linear":
        return frequencies / rope["factor"]
    if rope["rope_type"] == "llama3":
        return _llama3(frequencies, rope)
    return frequencies


def _llama3(frequencies: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    low_wavelength, high_wavelength = context / low, context / high
    wavelength = 2 * math.pi / frequencies
    scaled = torch.where(wavelength > low_wavelength, frequencies / factor, frequencies)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
    return torch.where(medium, smoothed, scaled)
