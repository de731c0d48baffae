"""Rollouts through the model's own `generate()`: a user's custom decoding, as TRL samples.

TRL's trainer samples with `model.generate(input_ids, attention_mask, generation_config)`,
so a script that subclasses the model and overrides `generate`, sets one on the
instance, or patches transformers' `GenerationMixin.generate` (TRL's own tool tests
script completions that way) changes what TRL trains on. hasten's engines never call
`generate`; `custom_generate(model)` notices such a replacement, and then
`ModelGenerateEngine` samples instead of the fast engine: each prompt repeated
num_generations times (group-major, one call, as TRL's batch), a GenerationConfig
built from the run's sampling settings, the output cut at max_new_tokens and after
the first EOS. The sampling log-probs come from one forward of the policy over
prompt + completion (log-softmax(logits / temperature) at the returned tokens, the
quantity the fast engines record), since a custom generate returns ids only.

Everything above the engine is unchanged: the tool loop (agent/loop.py) calls it
per turn like any engine, stop strings, tool masks and mask_truncated_completions
apply to its rollouts as to any other. It is the slow path on purpose: a plain
model keeps the fast engine (rollout/factory.py).

Draws: transformers' generate samples from torch's global generator; it is seeded
with the call's seed (plus the rank's first row under torchrun) inside a forked RNG
state, so a run's other draws do not move. The tokens differ from the fast engines'
for the same seed (another sampler), as they differ from TRL's.
"""

from __future__ import annotations

import inspect

import torch

from .engine import left_pad
from .types import Rollout, RowRange, SamplingParams

OWN_MODULES = ("transformers.", "peft.", "hasten.")  # a generate from these is the library's, not the user's


def custom_generate(model) -> str | None:
    """Why rollouts must go through model.generate (the user replaced it), or None for the library's own."""
    if "generate" in vars(model):
        return "a generate set on the model instance"
    method = getattr(type(model), "generate", None)
    if method is None:  # hasten's native Llama has none to replace
        return None
    if not inspect.isfunction(method):  # a mock or callable object put on the class (a patch)
        return f"{type(model).__name__}.generate is replaced by a {type(method).__name__}"
    if not method.__module__.startswith(OWN_MODULES):
        return f"{method.__qualname__} (from {method.__module__}) overrides it"
    return None


def generation_mixin_replaced() -> bool:
    """transformers' GenerationMixin.generate is patched process-wide (not a transformers function): a
    transformers model runs it, hasten's native Llama (which has no generate) would not."""
    from transformers.generation.utils import GenerationMixin

    method = GenerationMixin.__dict__.get("generate")
    return not (inspect.isfunction(method) and method.__module__.startswith("transformers."))


class ModelGenerateEngine:
    """Batched sampling by the model's own generate(); ids in, ids + log-probs + masks out."""

    kind = "model.generate"  # what the run's plan calls this engine

    def __init__(self, model, pad_token_id: int, eos_token_ids: list[int]):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = sorted(set(eos_token_ids))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def weights_changed(self) -> None:
        """Nothing to refresh: generate reads the policy's own parameters."""

    def release_weights(self) -> None:
        """Nothing held: generate reads the policy's own parameters."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
                 rows: RowRange | None = None) -> Rollout:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)  # (B, P)
        inputs = prompt_ids.repeat_interleave(num_generations, dim=0).to(device)  # (B*G, P)
        attention = prompt_mask.repeat_interleave(num_generations, dim=0).to(device)  # (B*G, P)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed + (rows.first if rows is not None else 0))
                output = self.model.generate(input_ids=inputs, attention_mask=attention,
                                             generation_config=self._config(sampling))
        finally:
            self.model.train(was_training)
        sequences = output.sequences if hasattr(output, "sequences") else output  # (B*G, P + T)
        completion, mask, ended = self._cut(sequences[:, inputs.shape[1]:].to(device), sampling.max_new_tokens)
        logprobs = self._logprobs(inputs, attention, completion, mask, sampling.temperature or 1.0)
        return Rollout(prompt_ids.to(device), prompt_mask.to(device), completion, mask, logprobs, ended,
                       num_generations, sampling)

    def _config(self, sampling: SamplingParams):
        """TRL's GenerationConfig from the sampling settings (greedy when temperature is 0)."""
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=not sampling.greedy,
                                temperature=sampling.temperature if not sampling.greedy else None,
                                top_p=sampling.top_p, top_k=sampling.top_k or None, min_p=sampling.min_p or None,
                                repetition_penalty=sampling.repetition_penalty, pad_token_id=self.pad_token_id,
                                eos_token_id=self.eos_token_ids)

    def _cut(self, completion: torch.Tensor, max_new_tokens: int):
        """(ids, mask, ended): at most max_new_tokens, everything after the first EOS padded and masked."""
        completion = completion[:, :max_new_tokens]  # (N, T)
        if completion.shape[1] == 0:  # nothing generated: one masked pad keeps every tensor (N, >= 1)
            completion = torch.full((completion.shape[0], 1), self.pad_token_id, dtype=torch.long,
                                    device=completion.device)
            return completion, torch.zeros_like(completion), torch.zeros(completion.shape[0], dtype=torch.bool,
                                                                         device=completion.device)
        width = completion.shape[1]
        is_eos = torch.isin(completion, torch.tensor(self.eos_token_ids, device=completion.device))  # (N, T)
        ended = is_eos.any(dim=1)  # (N,)
        lengths = torch.where(ended, is_eos.int().argmax(dim=1) + 1, width)  # (N,) the EOS counts
        mask = (torch.arange(width, device=completion.device)[None, :] < lengths[:, None]).long()  # (N, T)
        return completion.masked_fill(mask == 0, self.pad_token_id), mask, ended

    def _logprobs(self, inputs: torch.Tensor, attention: torch.Tensor, completion: torch.Tensor,
                  mask: torch.Tensor, temperature: float) -> torch.Tensor:
        """(N, T) log-softmax(logits / temperature) of the policy at each completion token, 0 where masked."""
        ids = torch.cat([inputs, completion], dim=1)  # (N, P + T)
        full_mask = torch.cat([attention, mask], dim=1)  # (N, P + T)
        positions = (full_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each row's own positions
        logits = self.model(input_ids=ids, attention_mask=full_mask, position_ids=positions).logits  # (N, P+T, V)
        logits = logits[:, inputs.shape[1] - 1:-1].float() / temperature  # (N, T, V) the logits before each token
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, completion[..., None]).squeeze(-1)  # (N, T)
        return chosen * mask


def sampling_engine(engine, model, pad_token_id: int, eos_token_ids: list[int]):
    """`engine`, or a ModelGenerateEngine over `model` when its generate is the user's now: checked per step,
    because a script may replace it after the trainer is built (TRL's tests patch it around train())."""
    if isinstance(engine, ModelGenerateEngine) or custom_generate(model) is None:
        return engine
    return ModelGenerateEngine(model, pad_token_id, eos_token_ids)
