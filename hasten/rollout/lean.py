"""Lean generation engine for Llama-family models: same protocol as KVCacheEngine, less overhead.

Token ids in; token ids, per-token sampling log-probs and masks out, with an
explicit seed. Sampling is sampling.py's, one uniform per row per step drawn
for every row, so for the same seed the tokens are KVCacheEngine's up to
float rounding (the forward is a different sequence of kernels).

Why: on 2 CPU cores a transformers decode step of SmolLM2-135M at 64 rows is
mostly overhead (DynamicCache's growing `cat`, many thin matmuls, Python in
every module), not FLOPs. Choices, each measured on SmolLM2-135M:
- The forward is written here with plain torch ops over the model's own
  weight tensors (no module calls except lm_head, so hooks on it still run):
  RMSNorm as F.rms_norm, RoPE from a cos/sin table built per call from the
  model's inv_freq (HF's default rope, same arithmetic), SDPA attention with
  the query heads of a KV group folded into its query axis (no repeated K/V).
- The KV cache is preallocated, (rows, kv_heads, prompt + new tokens,
  head_dim) per layer, and written in place: no cat per step.
- q/k/v and gate/up weights are fused into one matrix each, rebuilt by
  `sync_weights()` at the start of every generate (the policy changes after
  each optimizer step).
- Each prompt is prefilled once (left-padded, positions from the mask) and
  its K/V broadcast-copied into its num_generations rows.
- Finished rows keep computing (masked out of the outputs) until a share
  `compact_at` of the batch has finished; then the batch is compacted.
- One host sync per step: the count of finished rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .engine import left_pad
from .sampling import sample_tokens
from .types import Rollout, SamplingParams


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor  # (H,)
    qkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, H), fused, prepared by Matmul
    out: torch.Tensor  # (H, heads * head_dim), prepared
    post_norm: torch.Tensor  # (H,)
    gate_up: torch.Tensor  # (2 * I, H), fused, prepared
    down: torch.Tensor  # (H, I), prepared


def check_supported(model) -> None:
    """Raise ValueError unless model is a plain LlamaForCausalLM this engine reproduces exactly."""
    from transformers import LlamaForCausalLM

    if hasattr(model, "peft_config"):
        raise ValueError("LeanEngine needs a plain Llama-family model; a peft (LoRA) model must use KVCacheEngine")
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"LeanEngine needs a Llama-family model (LlamaForCausalLM), got {type(model).__name__}")
    config = model.config
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    unsupported = {
        "hidden_act": config.hidden_act != "silu",
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "rope_type": rope_type != "default",
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"LeanEngine supports silu, no biases and default RoPE; this model differs in {bad}")


class Matmul:
    """x @ weight.T with the weight prepared once: oneDNN-packed where that works, else plain.

    On this machine (AMD EPYC, 2 cores) F.linear's MKL sgemm reaches 90-150 GFLOP/s at the
    decode shapes (M = 16..64) and 36-70 for the 49152-wide lm_head; oneDNN with packed
    weights reaches 250-345 and 150. Packing is a copy (~0.2 s for SmolLM2), so it is redone
    only when the weights changed. `_linear_pointwise` is internal to torch, hence the probe.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.packed = device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
        if self.packed:
            x, weight = torch.randn(3, 16), torch.randn(8, 16)
            try:
                self.packed = torch.allclose(self(x, self.prepare(weight)), F.linear(x, weight), atol=1e-5)
            except (RuntimeError, AttributeError):
                self.packed = False

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        weight = weight.detach()
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64) if self.packed else weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
        return F.linear(x, weight)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as HF computes it: x*cos + rotate_half(x)*sin, with rotate_half's sign moved into sin."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
    return x * cos + swapped * signed_sin


class LeanEngine:
    """Batched sampling from a LlamaForCausalLM through a lean forward and a preallocated cache."""

    def __init__(self, model, pad_token_id: int, eos_token_ids: list[int], compact_at: float = 0.5):
        check_supported(model)
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        # compact_at: compact the running batch once this share of it has finished (0 = at every finish).
        self.compact_at = compact_at
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        weight = model.model.embed_tokens.weight
        self.linear = Matmul(weight.dtype, weight.device)
        self.layers: list[LayerWeights] = []
        self.head = weight  # lm_head's weight, prepared
        self.weight_versions: list[tuple[int, int]] = []
        self.sync_weights()

    @torch.no_grad()
    def sync_weights(self, force: bool = False) -> None:
        """Rebuild the fused and packed matrices if any weight changed since the last call.

        A change is seen through each parameter's version counter (bumped by every
        in-place update, the optimizer's included) and storage pointer (a replaced
        tensor). Writes through `param.data` bypass the counter: call with force=True then.
        """
        parameters = list(self.model.parameters())
        versions = [(parameter._version, parameter.data_ptr()) for parameter in parameters]
        if versions == self.weight_versions and not force:
            return
        prepare = self.linear.prepare
        self.layers = []
        for layer in self.model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
            self.layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=prepare(qkv),
                out=prepare(attention.o_proj.weight),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=prepare(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                down=prepare(mlp.down_proj.weight),
            ))
        self.head = prepare(self.model.lm_head.weight)
        self.weight_versions = versions

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int
    ) -> Rollout:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.sync_weights()
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)  # (B, P)
        num_prompts, prompt_width = prompt_ids.shape
        num_rows, steps = num_prompts * num_generations, sampling.max_new_tokens
        cache_width = prompt_width + steps - 1  # the last sampled token is never fed back
        device = self.model.model.embed_tokens.weight.device
        cos, signed_sin = self._rope_table(prompt_width + steps, device)  # (positions, head_dim)

        logits, caches = self._prefill(prompt_ids.to(device), prompt_mask.to(device), cos, signed_sin,
                                       num_generations, cache_width)  # (B*G, V)
        # key_bias: -inf on the cache slots a row must not attend to (its prompt's padding), else 0.
        dtype = self.model.model.embed_tokens.weight.dtype
        key_bias = torch.zeros((num_rows, 1, 1, cache_width), dtype=dtype, device=device)
        padding = prompt_mask.repeat_interleave(num_generations, dim=0).to(device) == 0  # (B*G, P)
        key_bias[:, 0, 0, :prompt_width].masked_fill_(padding, float("-inf"))
        position = prompt_mask.sum(-1).repeat_interleave(num_generations).to(device)  # (B*G,)

        tokens = torch.full((num_rows, steps), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((num_rows, steps), dtype=torch.float32)
        mask = torch.zeros((num_rows, steps), dtype=torch.long)
        ended = torch.zeros(num_rows, dtype=torch.bool)
        live = torch.arange(num_rows)  # batch row -> output row
        done = torch.zeros(num_rows, dtype=torch.bool, device=device)  # finished, still in the batch
        generator = torch.Generator().manual_seed(seed)
        eos = self.eos_token_ids.to(device)

        for step in range(steps):
            uniforms = torch.rand(num_rows, generator=generator)  # drawn for all rows, see sampling.py
            if len(live) < num_rows:
                uniforms = uniforms[live]
            token, token_logprob = sample_tokens(logits, sampling, uniforms.to(device))  # (batch,)
            finished = torch.isin(token, eos) & ~done
            tokens[live, step] = token.masked_fill(done, self.pad_token_id).cpu()
            logprobs[live, step] = token_logprob.masked_fill(done, 0.0).cpu()
            mask[live, step] = (~done).long().cpu()
            ended[live] |= finished.cpu()
            done |= finished
            if step == steps - 1:
                break
            num_done = int(done.sum())  # the one host sync per step
            if num_done == len(live):
                break
            if num_done and num_done >= self.compact_at * len(live):
                keep = (~done).nonzero().squeeze(-1)  # (live_after,)
                stop = prompt_width + step
                caches = [(_take_rows(keys, keep, stop), _take_rows(values, keep, stop)) for keys, values in caches]
                live, done = live[keep.cpu()], done[keep]
                key_bias, position, token = key_bias[keep], position[keep], token[keep]
            slot = prompt_width + step
            hidden = self._layers(
                F.embedding(token, self.model.model.embed_tokens.weight)[:, None],  # (batch, 1, H)
                cos[position][:, None, None], signed_sin[position][:, None, None],  # (batch, 1, 1, head_dim)
                key_bias[..., : slot + 1], caches, slot,
            )
            logits = self._logits(hidden[:, -1])  # (batch, V)
            position = position + 1

        width = int(mask.sum(1).max())  # trim columns no row reached
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=tokens[:, :width],
            completion_mask=mask[:, :width],
            sampling_logprobs=logprobs[:, :width],
            ended_with_eos=ended,
            num_generations=num_generations,
        )

    def _prefill(self, prompt_ids, prompt_mask, cos, signed_sin, num_generations, cache_width):
        """Run the prompts once; return the last position's logits per row and the group-shared cache."""
        num_prompts, width = prompt_ids.shape
        dtype, device = self.model.model.embed_tokens.weight.dtype, prompt_ids.device
        real = prompt_mask.bool()
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        # A padding query may attend to itself only, so its row is never empty (no NaN in its K/V).
        attend = (causal & real[:, None, :]) | torch.eye(width, dtype=torch.bool, device=device)  # (B, P, P)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        shape = (num_prompts, self.num_kv_heads, width, self.head_dim)
        prompt_caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                         for _ in self.layers]
        hidden = self._layers(
            F.embedding(prompt_ids, self.model.model.embed_tokens.weight),  # (B, P, H)
            cos[positions][:, None], signed_sin[positions][:, None],  # (B, 1, P, head_dim)
            attend[:, None], prompt_caches, 0,
        )
        logits = self._logits(hidden[:, -1]).repeat_interleave(num_generations, dim=0)  # (B*G, V)
        rows = num_prompts * num_generations
        shape = (rows, self.num_kv_heads, cache_width, self.head_dim)
        caches = []
        for prompt_keys, prompt_values in prompt_caches:
            keys = torch.empty(shape, dtype=dtype, device=device)
            values = torch.empty(shape, dtype=dtype, device=device)
            # Broadcast each prompt's K/V into its num_generations rows (no repeated intermediate).
            keys.view(num_prompts, num_generations, *shape[1:])[..., :width, :] = prompt_keys[:, None]
            values.view(num_prompts, num_generations, *shape[1:])[..., :width, :] = prompt_values[:, None]
            caches.append((keys, values))
        return logits, caches

    def _layers(self, hidden, cos, signed_sin, attend, caches, slot):
        """The decoder layers on hidden (N, S, H) at cache slots slot..slot+S; returns (N, S, H)."""
        rows, length, _ = hidden.shape
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        stop = slot + length
        for weights, (keys, values) in zip(self.layers, caches):
            normed = F.rms_norm(hidden, weights.input_norm.shape, weights.input_norm, self.eps)
            qkv = self.linear(normed, weights.qkv).view(rows, length, heads + 2 * kv_heads, head_dim).transpose(1, 2)
            query_key = rotate(qkv[:, : heads + kv_heads], cos, signed_sin)  # (N, heads + kv, S, head_dim)
            keys[:, :, slot:stop] = query_key[:, heads:]
            values[:, :, slot:stop] = qkv[:, heads + kv_heads:]
            query = query_key[:, :heads]  # (N, heads, S, head_dim)
            if length == 1:
                # Decode: the heads sharing a KV head become that head's queries, so K/V are never
                # repeated; plain matmuls beat SDPA's CPU kernel at this shape (1.4x at 120 keys).
                query = query.reshape(rows, kv_heads, heads // kv_heads, head_dim) * self.scale
                scores = torch.matmul(query, keys[:, :, :stop].transpose(-1, -2)) + attend  # (N, kv, group, L)
                attended = torch.matmul(torch.softmax(scores, dim=-1), values[:, :, :stop])  # (N, kv, group, head_dim)
            else:
                attended = F.scaled_dot_product_attention(
                    query, keys[:, :, :stop], values[:, :, :stop], attend, enable_gqa=True
                ).transpose(1, 2)  # (N, S, heads, head_dim)
            hidden = hidden + self.linear(attended.reshape(rows, length, heads * head_dim), weights.out)
            normed = F.rms_norm(hidden, weights.post_norm.shape, weights.post_norm, self.eps)
            gate, up = self.linear(normed, weights.gate_up).chunk(2, dim=-1)  # (N, S, I) each
            hidden = hidden + self.linear(F.silu(gate) * up, weights.down)
        return hidden

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm, head = self.model.model.norm, self.model.lm_head
        normed = F.rms_norm(hidden, norm.weight.shape, norm.weight, self.eps)
        if head._forward_hooks or head._forward_pre_hooks:  # e.g. a logit bias: run the module itself
            return head(normed)
        return self.linear(normed, self.head)

    def _rope_table(self, num_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, (num_positions, head_dim), computed as HF's default rope does.

        inv_freq is the model's own buffer: HF keeps it in whatever dtype the
        model was cast to, and the forward uses exactly that.
        """
        inv_freq = self.model.model.rotary_emb.inv_freq.to(device=device, dtype=torch.float)
        positions = torch.arange(num_positions, device=device, dtype=torch.long)
        freqs = positions[:, None].float() * inv_freq  # (positions, head_dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        sin = angles.sin()
        signed_sin = torch.cat((-sin[:, : sin.shape[1] // 2], sin[:, sin.shape[1] // 2:]), dim=-1)
        dtype = self.model.model.embed_tokens.weight.dtype
        return angles.cos().to(dtype), signed_sin.to(dtype)


def _take_rows(cache: torch.Tensor, keep: torch.Tensor, stop: int) -> torch.Tensor:
    """cache[keep], copying only the slots written so far (..stop)."""
    taken = cache.new_empty((len(keep),) + cache.shape[1:])
    taken[:, :, :stop] = cache[:, :, :stop].index_select(0, keep)
    return taken
