"""A Llama-family causal LM in plain PyTorch, loading and saving Hugging Face checkpoints (speed.model_impl).

Why: importing transformers costs seconds on a small CPU box (its modeling
code pulls in torch._dynamo and torch.distributed.tensor), which by itself
breaks "launch to the first step in 3 s". Everything hasten's fast
path needs from the model is small: a decoder that takes token ids,
positions and a ready-made boolean mask, an lm_head, and HF's parameter
names so checkpoints stay interchangeable. This module is that, and nothing
else; loading it needs torch, safetensors and json.

It reproduces transformers' Llama-family forward (5.x: LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; families.py says
which switches each one sets and which configs are refused) op for op where
it matters for numerics: RMSNorm in fp32 then cast, RoPE cos/sin from the
inv_freq buffer in fp32, SDPA with a boolean mask. tests/test_native_llama.py
and tests/test_model_families.py check logits, log-probs and gradients
against transformers and that a saved checkpoint loads back in transformers
unchanged.

The math both this model and the lean engine (rollout/lean.py) run lives
here once: `rms_norm`, `rope_table` and `rotate`. The engine keeps its own
loop over fused, packed weights; its layer is this file's DecoderLayer
with the projections fused.

What stays with transformers (models/__init__.py picks): the KV-cache
engine (it uses HF's cache objects), a LoRA adapter directory (peft loads
it onto HF modules), any model type or option this file does not reproduce
(`unsupported_reason` says which), and the benchmark peers. LoRA on a fresh
run wraps this model with peft (`prepare_inputs_for_generation` exists only
for that).
"""

from __future__ import annotations

import contextvars
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.precision import attention
from ..kernels.recast_linear import form_again
from .families import FAMILIES, inv_freq, rope_parameters, unsupported_reason

WEIGHTS_NAME = "model.safetensors"


class LlamaSettings(SimpleNamespace):
    """config.json as attributes, with transformers' defaults and names (model.config.hidden_size, ...)."""

    hasten_native = True  # grouped_attention.py: no transformers AttentionInterface to register with

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaSettings:
        settings = cls(**raw)
        settings.raw = dict(raw)
        settings.head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        settings.num_key_value_heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]
        settings.rms_norm_eps = raw.get("rms_norm_eps", 1e-6)
        settings.tie_word_embeddings = raw.get("tie_word_embeddings", False)
        settings.rope_parameters = rope_parameters(raw)
        settings.rope_theta = settings.rope_parameters["rope_theta"]
        settings.hidden_act = "silu"
        settings.features = FAMILIES[raw["model_type"]](raw)  # biases, qk-norm (families.py)
        settings._attn_implementation = "sdpa"  # grouped_attention.py switches it for a packed pass
        return settings

    def to_dict(self) -> dict[str, Any]:
        return dict(self.raw)


class ModelOutput(NamedTuple):
    last_hidden_state: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as transformers' LlamaRMSNorm; used by this model and the lean engine."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(hidden, weight.shape, weight, eps)  # on the CPU a composite of six ops (RMSNorm's lean path)
    dtype = hidden.dtype  # normalize in fp32, cast back, then scale
    hidden = hidden.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None, feeds_projections: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device))
        self.eps = eps
        self.feeds_projections = feeds_projections  # a decoder layer's norm: its output is q/k/v's or gate/up's input

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if not (LEAN_SAVES.get() and hidden.device.type == "cpu" and self.eps is not None
                and hidden.dtype == self.weight.dtype == torch.float32 and torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and not _outer_saved_tensor_hooks()):
            return rms_norm(hidden, self.weight, self.eps)  # a GPU's F.rms_norm is one fused kernel, keeping x, rstd
        # F.rms_norm's own ops (its CPU composite), spelled out so the normalized state is at hand: autograd
        # keeps it for the weight's gradient, and here it is formed again from the input and rstd, which the
        # norm keeps anyway (a hidden-wide fp32 tensor a token less per norm). The same graph: the same bits.
        rstd = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True).add_(self.eps))
        normalized = hidden.mul(rstd)
        if normalized.grad_fn is None:  # nothing of it saved (no graph): the recipe would only hold its inputs
            return normalized.mul(self.weight)
        with torch.autograd.graph.saved_tensors_hooks(*_formed_again(normalized, lambda: hidden.mul(rstd))):
            out = normalized.mul(self.weight)
        if self.feeds_projections:  # recast linears keep no bf16 cast of it (kernels/recast_linear.py)
            form_again(out, _normed_again, hidden, rstd, self.weight)
        return out


def _normed_again(hidden: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm's output from its input and rstd: the forward's two products, the same bits."""
    return hidden.mul(rstd).mul(weight)


def rope_table(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos and sign-folded sin (..., head_dim) at position_ids (...), with transformers' arithmetic.

    The sin's first half is negated, so `rotate` needs no rotate_half
    concatenation; negation is exact, so the result is bitwise HF's.
    """
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., head_dim)
    sin = angles.sin()
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return angles.cos().to(dtype), signed_sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF computes it, x*cos + rotate_half(x)*sin, with rotate_half's sign moved into sin."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
    return x * cos + swapped * signed_sin


class Rotary(nn.Module):
    """RoPE tables; inv_freq is a non-persistent buffer, as in transformers (the lean engine reads it)."""

    def __init__(self, settings: LlamaSettings):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(settings.rope_parameters, settings.head_dim), persistent=False)

    @torch.no_grad()
    def forward(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin), (N, L, head_dim) each, in like's dtype."""
        return rope_table(self.inv_freq, position_ids, like.dtype)


def sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs):
    """query (N, H, L, D), key/value (N, Hkv, L, D), mask (N, 1, L, L) bool -> (N, L, H, D), None."""
    out = attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                    enable_gqa=query.shape[1] != key.shape[1])  # fp32 under CPU autocast (train.attention_fp32)
    return out.transpose(1, 2), None


def attention_function(name: str) -> Callable:
    """The attention kernel by the name in config._attn_implementation (transformers' convention)."""
    if name == "sdpa":
        return sdpa_attention
    from ..kernels.grouped_attention import NAME, grouped_attention_forward

    if name == NAME:
        return grouped_attention_forward
    raise ValueError(f"the native Llama has no attention implementation {name!r}")


class Attention(nn.Module):
    def __init__(self, settings: LlamaSettings, device=None):
        super().__init__()
        self.settings = settings
        self.head_dim = settings.head_dim
        self.scaling = self.head_dim**-0.5
        hidden, heads, kv_heads = settings.hidden_size, settings.num_attention_heads, settings.num_key_value_heads
        bias, out_bias = settings.features.qkv_bias, settings.features.out_bias
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=bias, device=device)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias, device=device)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=bias, device=device)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=out_bias, device=device)
        if settings.features.qk_norm:  # Qwen3: per-head RMSNorm of queries and keys, before RoPE
            self.q_norm = RMSNorm(self.head_dim, settings.rms_norm_eps, device)
            self.k_norm = RMSNorm(self.head_dim, settings.rms_norm_eps, device)

    def forward(self, hidden, cos, signed_sin, attention_mask, **kwargs):
        rows, length, _ = hidden.shape
        shape = (rows, length, -1, self.head_dim)
        query = self.q_proj(hidden).view(shape)  # (N, L, H, D)
        key = self.k_proj(hidden).view(shape)  # (N, L, Hkv, D)
        if self.settings.features.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        value = self.v_proj(hidden).view(shape).transpose(1, 2)  # (N, Hkv, L, D)
        cos, signed_sin = cos[:, None], signed_sin[:, None]  # (N, 1, L, D)
        query = rotate(query.transpose(1, 2), cos, signed_sin)  # (N, H, L, D)
        key = rotate(key.transpose(1, 2), cos, signed_sin)
        attend = attention_function(self.settings._attn_implementation)
        out, _ = attend(self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)  # (N, L, H, D)
        return self.o_proj(out.reshape(rows, length, -1))


class MLP(nn.Module):
    def __init__(self, settings: LlamaSettings, device=None):
        super().__init__()
        hidden, inner, bias = settings.hidden_size, settings.intermediate_size, settings.features.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.up_proj = nn.Linear(hidden, inner, bias=bias, device=device)
        self.down_proj = nn.Linear(inner, hidden, bias=bias, device=device)


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        product = SiluMul.apply(gate, up)
        if not (LEAN_SAVES.get() and product.grad_fn is not None and torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and not _outer_saved_tensor_hooks()):
            return self.down_proj(product)
        # down_proj's saved input (or a view of it: LoRA's adapters, a reshape) is formed again from gate and up,
        # which SiluMul keeps anyway: silu(gate) * up, SiluMul's forward, so the same bits. Without it down_proj
        # holds the intermediate-wide product from the forward to its backward (Qwen2.5-0.5B in bf16: 9.5 KB a
        # token a layer, ~280 MiB at a 1,275-token micro-batch).
        with torch.autograd.graph.saved_tensors_hooks(*_formed_again(product, lambda: F.silu(gate) * up)):
            return self.down_proj(product)


# True while Decoder.forward runs its layers for a learning pass that is not checkpointed: MLP then has
# down_proj's input formed again in backward, and RMSNorm its normalized state. A context value, not a module
# attribute, so that a checkpointed layer recomputed in backward (outside it) saves what its forward saved,
# whatever ran in between.
LEAN_SAVES: contextvars.ContextVar[bool] = contextvars.ContextVar("hasten_lean_saves", default=False)


def _outer_saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are already active (torch.utils.checkpoint, save_on_cpu): the innermost hooks
    alone apply, so the product's would take over from theirs and keep gate and up alive for them."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):
        return True  # cannot tell: leave the saves to autograd


def _formed_again(tensor: torch.Tensor, form):
    """saved_tensors_hooks under which whatever saves `tensor` (or a view of it) keeps a recipe instead, and
    backward reads `form()`: the op that made it, on inputs autograd keeps anyway, so the same bits."""
    # its address only: a reference would keep the tensor alive (the hooks run while its consumer holds it)
    address, device, dtype = tensor.untyped_storage().data_ptr(), tensor.device, tensor.dtype

    def pack(saved: torch.Tensor):
        if saved.device == device and saved.dtype == dtype and saved.untyped_storage().data_ptr() == address:
            return ("again", saved.shape, saved.stride(), saved.storage_offset())
        return saved

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        _, shape, stride, offset = packed
        return form().as_strided(shape, stride, offset)

    return pack, unpack


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward.

    Autograd on `F.silu(gate) * up` keeps three intermediate-wide tensors per layer (gate for silu's
    backward, silu(gate) and up for the product's); this keeps two and forms silu(gate) again in backward,
    one elementwise pass. The backward runs the ops autograd would (the product's two gradients, then
    aten.silu_backward), so outputs and gradients are bitwise the same; per layer it saves
    intermediate_size x 4 bytes a token of the learning pass (a ninth of SmolLM2's activations).
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * F.silu(gate)
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


class DecoderLayer(nn.Module):
    def __init__(self, settings: LlamaSettings, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps, device, feeds_projections=True)
        self.self_attn = Attention(settings, device)
        self.post_attention_layernorm = RMSNorm(settings.hidden_size, settings.rms_norm_eps, device,
                                                feeds_projections=True)
        self.mlp = MLP(settings, device)

    def forward(self, hidden, cos, signed_sin, attention_mask, **kwargs):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, signed_sin, attention_mask, **kwargs)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def causal_padding_mask(padding: torch.Tensor) -> torch.Tensor:
    """(N, L) 1 = real token -> (N, 1, L, L) bool: causal over real keys; a padding query sees itself."""
    length = padding.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=padding.device).tril()
    allowed = causal & padding.bool()[:, None, :]  # (N, L, L)
    allowed |= torch.eye(length, dtype=torch.bool, device=padding.device)  # never an empty row (no NaN)
    return allowed[:, None]


class Decoder(nn.Module):
    """transformers' LlamaModel: embeddings, layers, final norm (same names, same state dict keys)."""

    def __init__(self, settings: LlamaSettings, device=None):
        super().__init__()
        self.config = settings
        # On meta, nn.Embedding's random init runs torch._refs.normal_, which imports torch._dynamo
        # (~1 s); a given (empty) weight skips the init. The loaders fill every tensor anyway.
        empty = torch.empty(settings.vocab_size, settings.hidden_size, device="meta") if device == "meta" else None
        self.embed_tokens = nn.Embedding(settings.vocab_size, settings.hidden_size, device=device, _weight=empty)
        self.layers = nn.ModuleList(DecoderLayer(settings, device) for _ in range(settings.num_hidden_layers))
        self.norm = RMSNorm(settings.hidden_size, settings.rms_norm_eps, device)
        self.rotary_emb = Rotary(settings)
        self.gradient_checkpointing = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **kwargs) -> ModelOutput:
        """input_ids (N, L); attention_mask (N, L) padding or (N, 1, L, L) bool; position_ids (N, L).

        No KV cache: sampling runs in the lean engine (rollout/lean.py), which reads these weights.
        """
        if kwargs.pop("past_key_values", None) is not None or kwargs.pop("use_cache", False):
            raise ValueError("the native Llama has no KV cache; sample with the lean engine (speed.engine=lean)")
        rows, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(rows, -1)
        if attention_mask is None:
            attention_mask = torch.ones(rows, length, dtype=torch.long, device=input_ids.device)
        if attention_mask.dim() == 2:
            attention_mask = causal_padding_mask(attention_mask)
        hidden = self.embed_tokens(input_ids)  # (N, L, H)
        cos, signed_sin = self.rotary_emb(hidden, position_ids)  # (N, L, D) each
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        lean = LEAN_SAVES.set(not recompute)  # a layer recomputed whole (checkpointing) has nothing to gain
        try:
            for layer in self.layers:
                if recompute:
                    hidden = checkpoint(layer, hidden, cos, signed_sin, attention_mask, use_reentrant=False, **kwargs)
                else:
                    hidden = layer(hidden, cos, signed_sin, attention_mask, **kwargs)
        finally:
            LEAN_SAVES.reset(lean)
            form_again(None)  # the last norm's recipe held its tensors
        return ModelOutput(last_hidden_state=self.norm(hidden))


class NativeLlamaForCausalLM(nn.Module):
    """The part of transformers' LlamaForCausalLM interface that hasten uses, in plain PyTorch."""

    hasten_native = True  # grouped_attention.py and the engines look for this

    def __init__(self, settings: LlamaSettings, generation: dict[str, Any] | None = None, device=None):
        """device="meta" builds the layout without initializing anything (the loaders fill it)."""
        super().__init__()
        self.config = settings
        self.generation_config = SimpleNamespace(**(generation or {}))
        if getattr(self.generation_config, "eos_token_id", None) is None:
            self.generation_config.eos_token_id = getattr(settings, "eos_token_id", None)
        self.name_or_path = ""
        self.model = Decoder(settings, device)
        self.lm_head = nn.Linear(settings.hidden_size, settings.vocab_size, bias=False, device=device)
        if settings.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- transformers-compatible accessors used by the learner, the engines and the savers
    def get_decoder(self) -> Decoder:
        return self.model

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        if (gradient_checkpointing_kwargs or {}).get("use_reentrant", False):
            raise ValueError("the native Llama only checkpoints non-reentrantly")
        self.model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    def prepare_inputs_for_generation(self, *args, **kwargs):
        """peft's PeftModelForCausalLM keeps a reference to this at wrap time; nothing here generates."""
        raise NotImplementedError("the native Llama does not generate through transformers; use the lean engine")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0, **kwargs) -> ModelOutput:
        hidden = self.model(input_ids, attention_mask, position_ids, **kwargs).last_hidden_state
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden  # (N, K, H)
        return ModelOutput(last_hidden_state=hidden, logits=self.lm_head(kept))

    # -- loading and saving Hugging Face checkpoints
    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> NativeLlamaForCausalLM:
        from safetensors.torch import load_file

        directory = Path(directory)
        raw = json.loads((directory / "config.json").read_text())
        reason = unsupported_reason(raw)
        if reason is not None:
            raise ValueError(reason)
        generation_file = directory / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
        state = load_file(str(directory / WEIGHTS_NAME))  # plain tensors, read once
        # On meta: no random init, every tensor comes from the file. (Not `with torch.device("meta")`:
        # that mode sends init through torch._refs, which imports torch._dynamo, ~1 s.)
        model = cls(LlamaSettings.from_dict(raw), generation, device="meta")
        model.load_hf_state_dict(state, dtype)
        model.name_or_path = str(directory)
        return model

    @classmethod
    def from_hf(cls, hf_model) -> NativeLlamaForCausalLM:
        """The same weights (copied) under this implementation; for tests and the `tiny` model."""
        raw = hf_model.config.to_dict()
        reason = unsupported_reason(raw)
        if reason is not None:
            raise ValueError(reason)
        generation = hf_model.generation_config.to_dict() if hasattr(hf_model, "generation_config") else None
        dtype = next(hf_model.parameters()).dtype
        model = cls(LlamaSettings.from_dict(raw), generation, device="meta")
        model.load_hf_state_dict({k: v.detach().clone() for k, v in hf_model.state_dict().items()}, dtype)
        model.name_or_path = getattr(hf_model, "name_or_path", "")
        return model

    def load_hf_state_dict(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = {name for name, _ in self.named_parameters()}
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the Llama layout: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        self.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        device = self.model.embed_tokens.weight.device
        self.model.rotary_emb = Rotary(self.config).to(device)  # the buffer was on meta

    def save_pretrained(self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None,
                        **kwargs) -> None:
        """A transformers-loadable checkpoint: config.json, generation_config.json, model.safetensors.

        state_dict: the weights to write instead of this module's (transformers' keyword: FSDP's gathered copy).
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        raw = dict(self.config.raw)
        raw["dtype"] = str(next(self.parameters()).dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        generation = {k: v for k, v in vars(self.generation_config).items() if v is not None}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().contiguous() for k, v in (state_dict or self.state_dict()).items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # tied: transformers restores it from the embeddings
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

