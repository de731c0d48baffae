"""Records that flow out of generation: sampling settings and a rollout batch.

The engine works on token ids only (ids in; ids, log-probs and masks out), so
these records hold tensors and nothing about text or rewards. A Rollout is
also what the learner consumes, which is why it carries the prompts too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus filter; 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (after temperature); 0 = off
    repetition_penalty: float = 1.0  # on the raw logits of tokens already in the prompt or completion; 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class RowRange:
    """Which rows of a larger seeded batch one generate call samples (data parallel: one rank's share).

    Row i of the call draws the uniforms of row first + i of a batch of `total`
    rows with the same seed, so N processes sampling their slices get exactly the
    tokens one process sampling the whole batch gets (tests/test_distributed.py).
    """

    first: int  # the batch row of this call's row 0
    total: int  # rows in the whole batch

    def __post_init__(self):
        if not 0 <= self.first <= self.total:
            raise ValueError(f"RowRange(first={self.first}, total={self.total}) is not a range of the batch")


@dataclass
class Rollout:
    """num_generations completions for each of B prompts, group-major.

    Row i of the completion tensors belongs to prompt i // num_generations.
    `sampling_logprobs` are log-softmax(logits / sampling.temperature) at the sampled
    token, before top-k/top-p filtering: the same quantity the learner
    computes, so the two can be compared directly.
    """

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P) 1 = real token
    completion_ids: torch.Tensor  # (B*G, T) right-padded with the pad id
    completion_mask: torch.Tensor  # (B*G, T) 1 = generated token (EOS included)
    sampling_logprobs: torch.Tensor  # (B*G, T) 0 where masked
    ended_with_eos: torch.Tensor  # (B*G,) bool; False = cut at max_new_tokens
    num_generations: int
    sampling: SamplingParams | None = None  # how it was sampled: the learner's temperature and length cap
    stats: dict[str, float] = field(default_factory=dict)  # the engine's own counters (spec/acceptance, ...)
    # Multi-turn rollouts (agent/loop.py): 1 = written by the model, 0 = a tool result the forward sees
    # and the loss leaves out (TRL's tool_mask); None = every completion token is the model's.
    tool_mask: torch.Tensor | None = None  # (B*G, T)

    @property
    def num_prompts(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def num_samples(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)  # (B*G,)

    @property
    def model_lengths(self) -> torch.Tensor:
        """Tokens the model wrote per sample (tool results left out): TRL's completion length."""
        if self.tool_mask is None:
            return self.completion_lengths
        return (self.completion_mask * self.tool_mask).sum(dim=1)  # (B*G,)

    def loss_mask(self, mask_truncated: bool = False) -> torch.Tensor | None:
        """The tokens the loss counts: the model's (tool_mask), not cut at the length cap when mask_truncated
        (algo.mask_truncated_completions); None = every completion token."""
        mask = None if self.tool_mask is None else self.completion_mask * self.tool_mask  # (B*G, T)
        if mask_truncated:
            mask = (self.completion_mask if mask is None else mask) * self.ended_with_eos[:, None]
        return mask

    def completion_token_lists(self) -> list[list[int]]:
        lengths = self.completion_lengths.tolist()
        return [row[:length] for row, length in zip(self.completion_ids.tolist(), lengths)]


class Engine(Protocol):
    """Anything that samples completions: our KV-cache engine, the lean engine, later vLLM."""

    def generate(
        self, prompts: list[list[int]], num_generations: int, sampling: SamplingParams, seed: int,
        rows: RowRange | None = None,
    ) -> Rollout: ...  # rows: this call's slice of a seeded batch; None = the whole batch

    def weights_changed(self) -> None:
        """The policy's weights were updated (an optimizer step, a resume): engines that keep their own
        copy (fused matrices, a vLLM server) refresh it before the next generate."""

    def release_weights(self) -> None:
        """The learning pass is next, and nothing samples until the update: an engine that holds its own copy
        of the weights in this process may free it (the next generate rebuilds it from the updated weights)."""

    def state_dict(self) -> dict:
        """What the engine carries from one step to the next that decides later samples (the int8
        sampler's activation statistics), saved in checkpoints so a resume samples as the straight
        run would; {} for engines that carry nothing."""

    def load_state_dict(self, state: dict) -> None:
        """Restore state_dict()'s output (a checkpoint's; {} from engines or runs that saved none)."""
