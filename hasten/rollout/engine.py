"""KV-cache generation engine on a Hugging Face causal LM.

Token ids in; token ids, per-token sampling log-probs and masks out, with an
explicit seed. It knows nothing of text or rewards.

Choices:
- Each prompt is prefilled once and its KV cache is repeated for its
  num_generations samples (the group shares the prefix), instead of
  prefilling the same prompt G times as `generate(num_return_sequences=G)`.
- Prompts are left-padded; positions come from the attention mask, so a
  padded prompt sees exactly the positions it would see alone.
- Finished rows (EOS sampled) leave the running batch: the cache, mask and
  positions are compacted, so late steps cost what the live rows cost.
- Sampling draws one uniform per row per step for all rows (sampling.py),
  so compaction cannot change which tokens a row gets.
- The only host sync per step is "did any row finish?": every buffer lives
  on the model's device (decode.py).

Left out on purpose (see the fast-path issue): a preallocated cache, fused
projections and a leaner forward than transformers' own.
"""

from __future__ import annotations

import torch

from .decode import DecodeState, decode
from .types import Rollout, RowRange, SamplingParams


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and mask, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


class KVCacheEngine:
    """Batched sampling with transformers' DynamicCache."""

    kind = "hf"  # what the run's plan calls this engine

    def __init__(self, model, pad_token_id: int, eos_token_ids: list[int]):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)

    def state_dict(self) -> dict:
        return {}  # nothing carried between steps that decides later samples

    def load_state_dict(self, state: dict) -> None:
        pass

    def weights_changed(self) -> None:
        """Nothing to refresh: every forward reads the policy's own parameters."""

    def release_weights(self) -> None:
        """Nothing held: the policy's own parameters."""

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
        rows: RowRange | None = None,
    ) -> Rollout:
        from transformers import DynamicCache

        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            # the model's config shapes the cache as generate() would: a hybrid model's (NemotronH) mamba layers
            # keep conv / ssm states, not keys and values; a config-less cache has no layer for them
            config = getattr(self.model, "config", None)
            cache = DynamicCache(config=config) if config is not None and hasattr(config, "num_hidden_layers") \
                else DynamicCache()
            return self._generate(prompts, num_generations, sampling, seed, rows, cache)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts, num_generations, sampling, seed, rows, cache) -> Rollout:
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)  # (B, P)
        num_rows = len(prompts) * num_generations
        steps = sampling.max_new_tokens

        # Prefill each prompt once; only the last position's logits are needed.
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (B, P)
        out = self.model(
            input_ids=prompt_ids.to(device),
            attention_mask=prompt_mask.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1].repeat_interleave(num_generations, dim=0)  # (B*G, V)
        # a hybrid model's linear-attention layers (NemotronH's mamba states) have no batch operations, only
        # reorder_cache by index; both pick the same rows. Decided once: the layers exist after the prefill.
        batched = all(hasattr(layer, "batch_select_indices") for layer in getattr(cache, "layers", []))
        if batched:
            cache.batch_repeat_interleave(num_generations)  # share the prefix across the group
        else:
            cache.reorder_cache(torch.arange(len(prompts), device=device).repeat_interleave(num_generations))
        attention = prompt_mask.repeat_interleave(num_generations, dim=0).to(device)  # (B*G, P)
        next_position = prompt_mask.sum(-1).repeat_interleave(num_generations).to(device)  # (B*G,)

        state = DecodeState(num_rows, steps, self.pad_token_id, self.eos_token_ids.to(device), seed, rows,
                            sampling, prompt_ids, prompt_mask)

        def keep_rows(keep: torch.Tensor) -> None:
            nonlocal attention, next_position
            if batched:
                cache.batch_select_indices(keep)
            else:
                cache.reorder_cache(keep)
            attention, next_position = attention[keep], next_position[keep]

        def forward(token: torch.Tensor) -> torch.Tensor:
            nonlocal attention, next_position
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)  # (live, P+t)
            out = self.model(input_ids=token[:, None], attention_mask=attention, position_ids=next_position[:, None],
                             past_key_values=cache, use_cache=True)
            next_position = next_position + 1
            return out.logits[:, -1]  # (live, V)

        decode(state, logits, sampling, keep_rows, forward)
        return state.rollout(prompt_ids, prompt_mask, num_generations, sampling)
