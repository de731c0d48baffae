"""Lean generation engine for Llama-family models: KVCacheEngine's protocol over fused, packed weights.

Families: Llama (Llama-3 rope scaling included), Mistral, Qwen2/2.5, Qwen3,
as models/families.py lists them, from either the native model or
transformers' classes. Biases ride along with their fused matrices; Qwen3's
qk-norm runs between the projection and RoPE. RMSNorm, the RoPE table and
the rotation are models/llama.py's functions, so there is one copy of the
layer math; what this file adds is the loop over fused, packed weights and
the cache.

Token ids in; token ids, per-token sampling log-probs and masks out, with an
explicit seed. Sampling is sampling.py's (one uniform per row per step, drawn
for every row), so for a seed the tokens are KVCacheEngine's up to float
rounding: equal on the tiny test model; on SmolLM2 a row can differ where its
uniform lands within ~1e-6 of a CDF step between two 1e-7-probability tokens.

Why it is fast, in order of effect (the figures: docs/results/code-notes.md):
- Matmuls run through oneDNN with packed weights (`Matmul`), which beat
  F.linear's MKL sgemm at decode shapes on CPUs where MKL takes a generic path.
- q/k/v and gate/up are fused into one matrix each. Packed copies must follow
  the optimizer, so `sync_weights()` runs at the start of every generate and
  rebuilds them when a parameter's version counter moved (cheap when nothing
  changed). They cost one more copy of the weights; speed.engine_weights=shared
  (shared_weights.py) reads the live parameters instead, unfused and unpacked.
- The forward is plain torch ops over the model's tensors, no module calls
  (lm_head runs as its module only when hooks are on it): F.rms_norm in
  fp32, RoPE from a cos/sin table made from the model's inv_freq with
  HF's arithmetic (models/llama.py's functions), SDPA for the prefill.
- speed.shared_prefix: the prompts' common prefix (chat header, system prompt,
  worked example) is prefilled once, as one sequence, and each prompt's rest
  against its K/V (GroupCache.attend_prefix / attend_rest); the decode steps
  are unchanged.
- Each prompt is prefilled once; its K/V stay in one copy per prompt, and a
  decode step attends to them through a (prompt, sample) grid (`GroupCache`),
  so the prompt part is read once per group: attention is memory-bound. Each
  row's own K/V is preallocated and written in place (no cat per step); plain
  matmuls beat SDPA's CPU kernel at one query. speed.decode_attention runs
  the decode step's attention as one fused kernel (kernels/decode_attention.py:
  each K/V row read once for the query heads sharing it, one softmax over
  prompt and own keys), at the rate the machine streams; elsewhere it stays two
  batched matmuls per part, a cat of the scores and a softmax, bound by the
  batched matmul's rate at 3 query rows per KV head (torch's flash kernel, a
  transposed K cache and a two-part softmax were no faster: docs/speedups.md;
  dev/profile_decode.py measures all of them). tests/test_decode_attention.py
  holds both to dense attention. With the kernel, the rest of a decode step's
  work between its matmuls runs fused too (`_fused_step`): the residual add,
  norm and cast to the next matmul's input in one call, RoPE writing the
  keys and values into the cache, SiLU(gate) * up, the bf16 matmuls' outputs
  read as bf16 (no cast back to fp32 between them); some 60 small ops per layer
  become about ten calls (tests/test_decode_step.py).
- A row that samples EOS leaves the batch at once: with the prompt K/V shared,
  compaction copies only the rows' own K/V, which beat compacting later or never.
- One host sync per step: "did any row finish?".
- The prefill and the decode steps run under torch.inference_mode(): no
  version counter or view tracking per op, the same kernels and results. A
  decode step is some 60 small ops per layer, and at a few rows their
  per-op cost shows. DecodeState's buffers, which become the Rollout, are
  made outside it, so the learner gets ordinary tensors.
- LoRA (a peft policy): with the copy, each projection is merged, W + scale * B @ A, when
  the weights are synced, and the fused matrices are built from that; the
  policy keeps its adapters for training. A decode step then costs what
  it costs without LoRA; the merge runs once per update.
- generation.precision=bf16|int8 (off by default; changes learning):
  sampled rollouts run the matmuls on bf16 copies of the fused weights (inputs
  cast to bf16, outputs back to fp32) or on int8 ones (kernels/int8.py: int8
  weights per output channel, activations quantized per call, VNNI dot
  products; down_proj in bf16 or fp32); norms, attention, the cache and
  sampling stay fp32. Decode is
  memory-bound, and int8 weights are a quarter of the fp32 bytes; CPUs with AMX
  run bf16 matmuls several times faster. The samples come from a rounded
  policy, so the learner weights each token by min(pi_fp32 / pi_sampler, cap)
  (truncated importance sampling, as for vLLM). Greedy calls (evaluation)
  always use the fp32 weights, so reported accuracy is the fp32 policy's (under
  LoRA with bf16 learning, a base the run holds in bf16, kernels/frozen_base.py,
  is that policy's base: float(bf16(W)) + scale * B @ A); a
  sampled evaluation (pass@k at temperature > 0) samples as training does, in
  generation.precision. The engine holds one sampling copy at a time (a switch
  frees the other).
Left out: torch.compile (inductor cannot lower oneDNN's packed linear; with
F.linear it compiled slowly with a recompile per new batch size), bf16 weights
for greedy calls (log-probs would no longer match the fp32 learner).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..device import is_sharded_tensor
from ..kernels import decode_attention as fused_decode_attention
from ..kernels.shared_prefix import common_prefix
from ..models.llama import rms_norm, rope_table, rotate
from .decode import DecodeState, decode
from .engine import left_pad
from .group_cache import GroupCache  # re-exported: tests and callers name it from here
from .matmul import Matmul  # re-exported: the bench and tests name it from here
from .shared_weights import Projections, SharedMatmul
from .types import Rollout, RowRange, SamplingParams


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor  # (H,)
    qkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, H), fused, prepared by Matmul
    qkv_bias: torch.Tensor | None  # ((heads + 2 * kv_heads) * head_dim,): Qwen2, attention_bias
    q_norm: torch.Tensor | None  # (head_dim,): Qwen3's qk-norm
    k_norm: torch.Tensor | None  # (head_dim,)
    out: torch.Tensor  # (H, heads * head_dim), prepared
    out_bias: torch.Tensor | None  # (H,)
    post_norm: torch.Tensor  # (H,)
    gate_up: torch.Tensor  # (2 * I, H), fused, prepared
    gate_up_bias: torch.Tensor | None  # (2 * I,): Llama's mlp_bias
    down: torch.Tensor  # (H, I), prepared
    down_bias: torch.Tensor | None  # (H,)


# transformers' classes whose forward this engine reproduces (for configs families.py accepts)
HF_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_supported(model) -> None:
    """Raise ValueError unless this engine reproduces the model's forward (LoRA adapters included)."""
    if hasattr(model, "peft_config"):
        _check_adapters(model)
        model = model.get_base_model()
    if getattr(model, "hasten_native", False):  # models/llama.py: checked when it was loaded
        return
    if type(model).__name__ not in HF_CLASSES or not type(model).__module__.startswith("transformers."):
        raise ValueError(f"LeanEngine needs a Llama-family model ({', '.join(HF_CLASSES)}), "
                         f"got {type(model).__name__}")
    from ..models.llama import (
        unsupported_reason,  # one list of what a lean Llama forward reproduces
    )

    reason = unsupported_reason(model.config.to_dict())
    if reason is not None:
        raise ValueError(f"LeanEngine: {reason}")


def _check_adapters(model) -> None:
    """Plain LoRA on the seven projections merges into W + scale * B @ A; anything else is refused."""
    for name, module in model.get_base_model().named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper":
            raise ValueError(f"LeanEngine: peft modules_to_save ({name}) is not merged; use KVCacheEngine")
        if not hasattr(module, "lora_A"):
            continue
        if name.rsplit(".", 1)[-1] not in PROJECTIONS or not hasattr(module, "get_delta_weight"):
            raise ValueError(f"LeanEngine merges LoRA on {', '.join(PROJECTIONS)} only, not on {name}")
        if any(module.use_dora.values()) or any(getattr(module, "lora_bias", {}).values()):
            raise ValueError(f"LeanEngine merges plain LoRA only; {name} uses DoRA or lora_bias")


def _effective(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) that a projection applies, LoRA merged: W + scale * B @ A per active adapter.

    The policy keeps its adapters for training: the merge is a new tensor made
    at weight-sync time, never written back. Matches peft's unmerged forward up
    to float rounding (sampling runs in eval mode: no LoRA dropout).
    """
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight, linear.bias
    weight = base.weight
    if weight.dtype == torch.bfloat16 and not weight.requires_grad:  # a base held in bf16 (kernels/frozen_base.py)
        weight = weight.float()  # the merge and the fp32 forms in fp32, from the learner's own base
    if not linear.disable_adapters and not linear.merged:  # merged: peft already added the delta into W
        for adapter in linear.active_adapters:
            if adapter in linear.lora_A:
                weight = weight + linear.get_delta_weight(adapter)  # scale * B @ A, fan_in_fan_out handled
    return weight, base.bias


def _fused(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One matrix (sum of out_features, in) for projections that read the same input, and its bias or None."""
    weights, biases = zip(*(_effective(linear) for linear in linears))
    weight = torch.cat(weights) if len(weights) > 1 else weights[0]
    if all(bias is None for bias in biases):
        return weight, None
    return weight, torch.cat([bias.detach() if bias is not None else weight.new_zeros(w.shape[0])
                              for bias, w in zip(biases, weights)])


class LeanEngine:
    """Batched sampling from a Llama-family model (or a LoRA policy on one) through a lean forward
    and a preallocated cache."""

    kind = "lean"

    def __init__(self, model, pad_token_id: int, eos_token_ids: list[int], sample_precision: str = "fp32",
                 shared_prefix: bool = False, weights: str = "copy", decode_attention: bool = False):
        check_supported(model)
        self.shared_prefix = shared_prefix  # speed.shared_prefix: the prompts' common prefix prefilled once
        if sample_precision not in ("fp32", "bf16", "int8"):
            raise ValueError(f"sample_precision must be fp32, bf16 or int8, got {sample_precision!r}")
        if weights not in ("copy", "shared") or (weights == "shared" and sample_precision != "fp32"):
            raise ValueError(f"weights must be copy, or shared with fp32 sampling, got {weights!r} with "
                             f"{sample_precision!r}")
        self.weights = weights  # speed.engine_weights (rollout/shared_weights.py): own packed copy, or live tensors
        self.model = model  # the policy: its parameters' versions say when to re-merge and repack
        self.base = model.get_base_model() if hasattr(model, "peft_config") else model  # under LoRA adapters
        self.pad_token_id = pad_token_id
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        weight = self.base.model.embed_tokens.weight
        # speed.decode_attention, resolved: the decode steps' attention through the fused kernel
        # (kernels/decode_attention.py) where it takes this model's heads and cache, else torch's (GroupCache).
        self.decode_attention = decode_attention and fused_decode_attention.supports(
            self.head_dim, self.num_heads // self.num_kv_heads, weight.dtype, weight.device)
        # generation.precision: sampled rollouts may run bf16 or int8 matmuls (the learner corrects
        # with truncated importance sampling); greedy calls (evaluation) always run the fp32 weights.
        self.sample_precision = sample_precision
        fp32 = SharedMatmul(weight.device) if weights == "shared" else Matmul(weight.dtype, weight.device)
        self.matmuls = {"fp32": fp32}
        if sample_precision != "fp32":
            self.matmuls[sample_precision] = Matmul(weight.dtype, weight.device, sample_precision)
        self.linear = self.matmuls["fp32"]
        # The prepared weights are built by the first generate, in the precision it asks for (ready_for): built
        # here, they were an fp32 copy that a bf16 run replaced at its first sample, after it had set the
        # process's peak (5.9 GB more at Qwen2.5-1.5B).
        self.layers: list[LayerWeights] = []
        self.head: torch.Tensor | None = None  # lm_head's weight, prepared
        self.weight_versions: list[tuple[int, int]] = []

    @property
    def num_layers(self) -> int:
        return len(self.base.model.layers)

    def state_dict(self) -> dict:
        """int8 sampling: each projection's activation statistics (the next quantization's smoothing)."""
        statistics = getattr(self.matmuls.get("int8"), "statistics", {})
        return {"int8_statistics": {name: tensor.clone() for name, tensor in statistics.items()}} if statistics else {}

    def load_state_dict(self, state: dict) -> None:
        if "int8_statistics" in state and "int8" in self.matmuls:
            self.matmuls["int8"].statistics = {name: tensor.clone() for name, tensor in state["int8_statistics"].items()}
            self.weights_changed()

    def weights_changed(self) -> None:
        """The policy was updated: re-merge LoRA and rebuild the fused and packed matrices before the next use.

        Under FSDP this is called as the gathered weights are resharded (train/fsdp.py full_weights): the
        parameters are shards again, the next sampling rebuilds from a fresh gather, and the fused copies
        are dropped now rather than held through the learning pass on every rank."""
        self.weight_versions = []
        if any(is_sharded_tensor(parameter) for parameter in self.model.parameters()):
            self.layers, self.head = [], None

    def release_weights(self) -> None:
        """Free the sampling copy (speed.engine_weights=copy) until the next generate rebuilds it.

        The trainer calls this before the learning pass: the update changes every weight, so the copy would
        be rebuilt anyway, and the pass runs without it (a model's size in bf16 or fp32 less at the step's
        peak). Its memory goes back to the allocator while the pass needs it, and the rebuilt copy takes it
        again; the samples are those of a copy kept (the same weights, cast and packed the same way).
        Shared weights are views of the live parameters: nothing to free."""
        if self.weights == "copy":
            self.layers, self.head = [], None
            self.weight_versions = []

    def ready_for(self, sampling: SamplingParams) -> None:
        """Weights current and in the call's precision: generation.precision (bf16 | int8) for sampled
        calls, fp32 for greedy ones (evaluation) and otherwise."""
        self.use_precision("fp32" if sampling.greedy else self.sample_precision)
        self.sync_weights()

    def use_precision(self, precision: str) -> None:
        """Run the next generate's matmuls in `precision` (fp32 | bf16 | int8): a switch rebuilds the weights
        once, and the other precision's copies are freed (one sampling copy of the weights at a time)."""
        if self.linear is not self.matmuls[precision]:
            self.linear = self.matmuls[precision]
            self.weight_versions = []

    @torch.no_grad()
    def sync_weights(self, force: bool = False) -> None:
        """Rebuild the fused (and LoRA-merged) packed matrices if any weight changed since the last call.

        A change is seen through each parameter's version counter (bumped by every
        in-place update, the optimizer's included) and storage pointer (a replaced
        tensor). Writes through `param.data` bypass the counter, and so does torch's fused
        CPU AdamW (`_fused_adamw_` leaves `_version` alone, measured on torch 2.13): the
        trainer calls `weights_changed()` after every update so neither can leave stale weights.
        """
        versions = [(parameter._version, parameter.data_ptr()) for parameter in self.model.parameters()]
        if versions == self.weight_versions and not force:
            return
        if self.weights == "shared":  # views of the live tensors, rebuilt only to follow a replaced parameter
            self.layers = [self._shared_layer(layer) for layer in self.base.model.layers]
            self.head = self.base.lm_head.weight
            self.weight_versions = versions
            return
        prepare = self.linear.prepare
        # The previous sync's matrices, reused in place where the form allows (Matmul.prepare: bf16 only);
        # otherwise dropped before the new ones are made, so two sampling copies never coexist.
        count = len(self.base.model.layers)
        # a bf16 copy only: the fp32 one a greedy call (evaluation) built is dropped first, not kept to the end
        reuse = (self.linear.bf16 and len(self.layers) == count
                 and getattr(self.layers[0].qkv, "_hasten_bf16_copy", False))
        previous = self.layers if reuse else [None] * count
        old_head = self.head if reuse and self.head is not self.base.model.embed_tokens.weight else None
        self.layers, self.head = [], None
        # int8: down_proj stays out of int8 (bf16 where the CPU has it, else fp32). Its input
        # (silu(gate) * up) carries the model's massive activations, channels and tokens thousands of
        # times the median, which no int8 scale spans (docs/speedups.md).
        exact_down = self.linear.precision == "int8"
        for index, (layer, old) in enumerate(zip(self.base.model.layers, previous)):
            attention, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fused(attention.q_proj, attention.k_proj, attention.v_proj)
            out, out_bias = _fused(attention.o_proj)
            gate_up, gate_up_bias = _fused(mlp.gate_proj, mlp.up_proj)
            down, down_bias = _fused(mlp.down_proj)
            qk_norm = hasattr(attention, "q_norm")
            self.layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight.detach(),
                qkv=prepare(qkv, old and old.qkv, name=f"{index}.qkv"),
                qkv_bias=qkv_bias,
                q_norm=attention.q_norm.weight.detach() if qk_norm else None,
                k_norm=attention.k_norm.weight.detach() if qk_norm else None,
                out=prepare(out, old and old.out, name=f"{index}.out"),
                out_bias=out_bias,
                post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=prepare(gate_up, old and old.gate_up, name=f"{index}.gate_up"),
                gate_up_bias=gate_up_bias,
                down=prepare(down, old and old.down, exact=exact_down, name=f"{index}.down"),
                down_bias=down_bias,
            ))
        self.head = prepare(self.base.lm_head.weight, old_head, name="head")
        self.weight_versions = versions

    @staticmethod
    def _shared_layer(layer) -> LayerWeights:
        """speed.engine_weights=shared: the layer's projections as modules (SharedMatmul reads them at each
        call, LoRA adapters included; biases too), its norms as the parameters themselves."""
        attention, mlp = layer.self_attn, layer.mlp
        qk_norm = hasattr(attention, "q_norm")
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(), qkv_bias=None, out_bias=None, gate_up_bias=None,
            qkv=Projections(attention.q_proj, attention.k_proj, attention.v_proj), down_bias=None,
            q_norm=attention.q_norm.weight.detach() if qk_norm else None,
            k_norm=attention.k_norm.weight.detach() if qk_norm else None,
            out=Projections(attention.o_proj), post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=Projections(mlp.gate_proj, mlp.up_proj), down=Projections(mlp.down_proj))

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
        rows: RowRange | None = None,
    ) -> Rollout:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self.ready_for(sampling)
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)  # (B, P)
        device = self.base.model.embed_tokens.weight.device
        # Made outside inference mode: its buffers become the Rollout, which the learner reads under autograd.
        state = DecodeState(len(prompts) * num_generations, sampling.max_new_tokens, self.pad_token_id,
                            self.eos_token_ids.to(device), seed, rows, sampling, prompt_ids, prompt_mask)
        # The prefill and the decode steps run in inference mode: no version counter or view tracking per op,
        # the same kernels and results (dev/profile_decode.py measures the per-op overhead it removes).
        with torch.inference_mode():
            self._prefill_and_decode(prompts, prompt_ids, prompt_mask, num_generations, state, sampling)
        return state.rollout(prompt_ids, prompt_mask, num_generations, sampling)

    def _prefill_and_decode(self, prompts, prompt_ids, prompt_mask, num_generations, state: DecodeState,
                            sampling: SamplingParams) -> None:
        """Prefill each prompt once (its common prefix once, under speed.shared_prefix), then decode into state."""
        num_prompts, prompt_width = prompt_ids.shape
        steps = sampling.max_new_tokens
        embedding = self.base.model.embed_tokens.weight
        device = embedding.device
        cos, signed_sin = self._rope_table(prompt_width + steps, device)  # (positions, head_dim)
        shared = common_prefix(prompts) if self.shared_prefix else 0
        # With a shared prefix the cache's columns are [prefix, each prompt's rest left-padded]; the
        # decode steps read keys through the mask and never need the pad's place.
        layout_mask = prompt_mask
        if shared:
            rest_ids, rest_mask = left_pad([prompt[shared:] for prompt in prompts], self.pad_token_id)  # (B, P - C)
            layout_mask = torch.cat([torch.ones(num_prompts, shared, dtype=rest_mask.dtype), rest_mask], dim=1)
        cache = GroupCache(self, layout_mask.to(device), num_generations, steps)

        # Prefill each prompt once (a shared prefix once for all); only the last position's logits are needed.
        positions = (layout_mask.cumsum(-1) - 1).clamp(min=0).to(device)  # (B, P)
        if shared:
            cache.share_prefix(shared)
            prefix = torch.tensor(prompts[0][:shared], dtype=torch.long, device=device)[None]  # (1, C)
            self._layers(F.embedding(prefix, embedding),  # (1, C, H)
                         cos[:shared][None, None], signed_sin[:shared][None, None], cache.attend_prefix)
            rest = positions[:, shared:]
            hidden = self._layers(F.embedding(rest_ids.to(device), embedding),  # (B, P - C, H)
                                  cos[rest][:, None], signed_sin[rest][:, None], cache.attend_rest)
        else:
            hidden = self._layers(F.embedding(prompt_ids.to(device), embedding),  # (B, P, H)
                                  cos[positions][:, None], signed_sin[positions][:, None], cache.attend_prompt)
        logits = self._logits(hidden[:, -1]).repeat_interleave(num_generations, dim=0)  # (B*G, V)
        position = prompt_mask.sum(-1).repeat_interleave(num_generations).to(device)  # (B*G,)

        def keep_rows(keep: torch.Tensor) -> None:
            nonlocal position
            cache.keep(keep)
            position = position[keep]

        fused = self._fused_step_supported()

        def forward(token: torch.Tensor) -> torch.Tensor:
            nonlocal position
            if fused:
                normed = self._fused_step(F.embedding(token, embedding), cos[position], signed_sin[position], cache)
                cache.length += 1
                position = position + 1
                logits = self.linear.raw(normed, self.head)  # (live, V)
                return logits.float() if logits.dtype != torch.float32 else logits
            hidden = self._layers(F.embedding(token, embedding)[:, None],  # (live, 1, H)
                                  cos[position][:, None, None], signed_sin[position][:, None, None],  # (live, 1, 1, D)
                                  cache.attend_step)
            cache.length += 1
            position = position + 1
            return self._logits(hidden[:, -1])  # (live, V)

        decode(state, logits, sampling, keep_rows, forward)

    def _layers(self, hidden, cos, signed_sin, attend):
        """The decoder layers on hidden (N, S, H); attend(layer, query, key, value) owns the cache.

        models/llama.py's DecoderLayer with q/k/v and gate/up fused: same
        norms, qk-norm, RoPE and residuals, in the same order.
        """
        rows, length, _ = hidden.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        for index, weights in enumerate(self.layers):
            normed = rms_norm(hidden, weights.input_norm, self.eps)
            qkv = self.linear(normed, weights.qkv, weights.qkv_bias)
            qkv = qkv.view(rows, length, heads + 2 * kv_heads, self.head_dim)  # (N, S, heads + 2 * kv, head_dim)
            query_key = qkv[:, :, : heads + kv_heads]  # (N, S, heads + kv, head_dim)
            if weights.q_norm is not None:  # Qwen3: each head's query and key normalized before RoPE
                query_key = torch.cat([rms_norm(query_key[:, :, :heads], weights.q_norm, self.eps),
                                       rms_norm(query_key[:, :, heads:], weights.k_norm, self.eps)], dim=2)
            query_key = rotate(query_key.transpose(1, 2), cos, signed_sin)  # (N, heads + kv, S, head_dim)
            value = qkv[:, :, heads + kv_heads:].transpose(1, 2)  # (N, kv, S, head_dim)
            attended = attend(index, query_key[:, :heads], query_key[:, heads:], value)
            hidden = hidden + self.linear(attended, weights.out, weights.out_bias)
            normed = rms_norm(hidden, weights.post_norm, self.eps)
            gate, up = self.linear(normed, weights.gate_up, weights.gate_up_bias).chunk(2, dim=-1)  # (N, S, I) each
            hidden = hidden + self.linear(F.silu(gate) * up, weights.down, weights.down_bias)
        return hidden

    def _fused_step_supported(self) -> bool:
        """Whether decode steps run _fused_step: speed.decode_attention's kernels take this model (widths,
        head_dim), the matmuls run on this engine's own fp32 or bf16 copy (not int8, not shared weights), no
        projection but q/k/v carries a bias (an fp32 one), no qk-norm, and no hook on the LM head."""
        config, head = self.base.config, self.base.lm_head
        return (self.decode_attention and bool(self.layers) and self.weights == "copy"
                and self.linear.precision in ("fp32", "bf16")
                and fused_decode_attention.layers_supported(config.hidden_size, config.intermediate_size,
                                                            self.head_dim)
                and all(weights.q_norm is None and weights.out_bias is None and weights.gate_up_bias is None
                        and weights.down_bias is None
                        and (weights.qkv_bias is None or weights.qkv_bias.dtype == torch.float32)
                        for weights in self.layers)
                and not (head._forward_hooks or head._forward_pre_hooks))

    def _fused_step(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                    cache: GroupCache) -> torch.Tensor:
        """One decode step's layers, _layers' math with the work between the matmuls in
        kernels/decode_attention.py's fused calls: the residual adds and norms with the cast to the next
        matmul's input, RoPE writing the keys and values into the cache, SiLU(gate) * up. hidden (N, H) fp32,
        its rows' own; cos, signed_sin (N, head_dim). Returns the final norm's output, the LM head's input
        (N, H), in the matmuls' dtype (bf16 under generation.precision=bf16)."""
        kernels, matmul = fused_decode_attention, self.linear.raw
        rows = hidden.shape[0]
        dtype = torch.bfloat16 if self.linear.bf16 else torch.float32
        normed = hidden.new_empty(hidden.shape, dtype=dtype)
        kernels.add_norm(hidden, None, self.layers[0].input_norm, self.eps, normed)
        norms = [weights.input_norm for weights in self.layers[1:]] + [self.base.model.norm.weight]
        for index, (weights, next_norm) in enumerate(zip(self.layers, norms)):
            keys, values = cache.own[index]
            query = hidden.new_empty(rows, self.num_heads, 1, self.head_dim)
            kernels.rope(matmul(normed, weights.qkv), weights.qkv_bias, self.num_heads, cos, signed_sin, query,
                         keys, values, cache.length)
            attended = cache.attend_written(index, query).view(rows, -1)  # (N, heads * head_dim) fp32
            kernels.add_norm(hidden, matmul(attended.to(dtype), weights.out), weights.post_norm, self.eps, normed)
            gate_up = matmul(normed, weights.gate_up)  # (N, 2 I)
            product = kernels.silu_mul(gate_up, gate_up.new_empty(rows, gate_up.shape[1] // 2))
            kernels.add_norm(hidden, matmul(product, weights.down), next_norm, self.eps, normed)
        return normed

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm, head = self.base.model.norm, self.base.lm_head
        normed = rms_norm(hidden, norm.weight, self.eps)
        if head._forward_hooks or head._forward_pre_hooks:  # e.g. a logit bias: run the module itself
            return head(normed)
        return self.linear(normed, self.head)

    def _rope_table(self, num_positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, (num_positions, head_dim), as the model's own forward computes them.

        inv_freq is the model's own buffer (default, linear or llama3 RoPE:
        families.py), so the table follows whatever the model was built with.
        """
        inv_freq = self.base.model.rotary_emb.inv_freq.to(device=device, dtype=torch.float)
        positions = torch.arange(num_positions, device=device, dtype=torch.long)
        return rope_table(inv_freq, positions, self.base.model.embed_tokens.weight.dtype)
