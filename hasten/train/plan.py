"""The run's plan: every choice the config leaves to the model and the machine, resolved once.

`prepare` (train/trainer.py) builds it after the model is loaded and the engine is made, from the
validated config, the model's device and the engine the factory chose (rollout/factory.py): which
engine samples and with which forward, how the learner's pass runs and how it corrects for the
sampler (train/learner.py's LearningPlan), whether the weights are sharded, whether threads adapt.
Nothing downstream asks the config these questions again. Its one-line description is printed when
a run starts, so what ran is on the screen and in the log, not only implied by defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config
from ..profiles import held_back_notes
from . import fsdp
from .learner import LearningPlan


@dataclass(frozen=True)
class Plan:
    device: str  # the model's device: cpu, cuda:0, ...
    engine: str  # the engine that samples: lean | lean+speculative | hf | vllm | vllm-server
    model_impl: str  # the policy's forward: native (models/llama.py) | transformers
    learning: LearningPlan  # the learner's settings, pass and correction
    sharded: bool  # train.distributed=fsdp under torchrun
    adaptive_threads: bool  # speed.adaptive_threads where it applies (one CPU process, threads not pinned)
    async_steps: int  # algo.async_steps: batches sampled ahead of the update
    threads: int = 0  # torch's intra-op threads when the run starts (0: not known)
    cores: int = 0  # the cores this process may run on
    decode_attention: bool = False  # the lean engine's decode attention runs the fused kernel (speed.decode_attention)
    sampling: str = "fp32"  # generation.precision, resolved: the sampled rollouts' matmuls (fp32 | bf16 | int8)
    held_back: tuple[str, ...] = ()  # what the profile left out because this launch cannot run it (profiles.py)
    bf16_base: bool = False  # the frozen LoRA base held in bf16: the learner reads it as bf16 only (frozen_base.py)

    @classmethod
    def resolve(cls, cfg: Config, policy, engine, adaptive_threads: bool, loaded: bool = False) -> Plan:
        """loaded: the policy is the one the run loaded from its weights file (not a model the API was given,
        whose owner keeps using it): only then may its frozen LoRA base be held in bf16."""
        from ..kernels import frozen_base
        from ..models.llama import NativeLlamaForCausalLM
        from . import distributed

        model = policy.model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft's wrapper
        native = isinstance(base, NativeLlamaForCausalLM)
        engine_kind = getattr(engine, "kind", type(engine).__name__)
        if engine_kind == "lean+speculative":
            engine_kind += f" ({cfg.speed.speculative})"
        sharded = fsdp.wanted(cfg)
        first = next(model.parameters())
        device = str(first.device)
        import os

        import torch

        learning = LearningPlan.resolve(cfg, sharded, model.config, device, first.dtype)
        bf16_base = loaded and frozen_base.reason_not(
            device, bool(policy.lora), native, learning.precision, engine_kind, getattr(engine, "weights", ""),
            cfg.speed.nan_guard_action if cfg.speed.nan_guard else "", distributed.world_size(),
            cfg.speed.compile) is None
        return cls(device, engine_kind, "native" if native else "transformers", learning, sharded, adaptive_threads,
                   cfg.algo.async_steps,
                   torch.get_num_threads(), len(os.sched_getaffinity(0)),
                   decode_attention=bool(getattr(engine, "decode_attention", False)),
                   sampling=getattr(engine, "sample_precision", "fp32"), held_back=tuple(held_back_notes(cfg)),
                   bf16_base=bf16_base)

    def describe(self) -> str:
        """One line: 'plan: cpu, lean engine, native forward, packed learning pass (...), on-policy, 2 threads
        on 2 cores, adaptive (fewer while other processes run; each step line says when)'."""
        extras = (["FSDP-sharded"] if self.sharded else []) + (
            ["LoRA base held in bf16 (the learner reads it as bf16 only)"] if self.bf16_base else []) + (
            [f"{self.async_steps} batch sampled ahead"] if self.async_steps else []) + [self.describe_threads()] + (
            [f"profile left out for this launch: {'; '.join(self.held_back)}"] if self.held_back else [])
        details = ([f"{self.sampling} sampling"] if self.sampling != "fp32" else []) + (
            ["fused decode attention"] if self.decode_attention else [])
        engine = f"{self.engine} engine" + (f" ({', '.join(details)})" if details else "")
        return (f"plan: {self.device}, {engine}, {self.model_impl} forward, {self.learning.describe()}"
                + "".join(f", {extra}" for extra in extras if extra))

    def describe_eval(self) -> str:
        """One line for `hasten eval`, which generates and never learns: 'eval plan: cpu, lean engine, native
        forward, 2 threads on 2 cores' (the learning pass's micro-batches and skipping would be noise there)."""
        engine = f"{self.engine} engine" + (" (fused decode attention)" if self.decode_attention else "")
        threads = self.describe_threads()
        return f"eval plan: {self.device}, {engine}, {self.model_impl} forward" + (f", {threads}" if threads else "")

    def describe_threads(self) -> str:
        """The thread choice: a slow step on a busy box is often one thread (kernels/threads.py)."""
        if not self.threads:
            return "adaptive threads" if self.adaptive_threads else ""
        text = f"{_count(self.threads, 'thread')} on {_count(self.cores, 'core')}"
        if self.adaptive_threads:
            return text + ", adaptive (fewer while other processes run; the step line says when)"
        return text


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' if number != 1 else ''}"
