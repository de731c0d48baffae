"""Reward models as TRL has them: a sequence-classification model whose first logit is the score.

TRL's GRPOTrainer accepts, among its reward_funcs, a model id or directory
(loaded with AutoModelForSequenceClassification, num_labels=1) or a loaded
PreTrainedModel, with a tokenizer from reward_processing_classes or the
model's own. `RewardModel` is that, as a reward function with the usual
calling convention (runner.py), so it mixes with functions, is weighted,
logged and counted like them. It scores as TRL does, so the numbers match
TRL's on the same inputs (tests/test_reward_model.py checks this against
TRL itself):

- text: prompt + completion for string rows; for conversational rows the
  reward tokenizer's chat template over prompt messages + the completion
  message (no generation prompt);
- tokenized as one batch, padded on the right, without special tokens;
- the tokenizer's pad token (its EOS when it has none) is written into the
  model's config, because the model reads its score at the last non-pad token;
- run under inference_mode on the model's device, which the trainer sets to
  the policy's (`place`).

Deterministic (the same text gives the same score), so the reward cache may
keep its scores; not `slow`: it runs in the trainer's process, never in a
worker pool (a model does not travel to worker processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hasten.errors import UserError


class RewardModelError(UserError):
    """A reward model that cannot be loaded or used; one line."""


def is_model_spec(spec: str) -> bool:
    """A reward entry that names a model (a directory with config.json, or a hub id) rather than a function."""
    if ":" in spec:
        return False
    path = Path(spec).expanduser()
    if path.is_dir():
        return (path / "config.json").is_file()
    return not spec.endswith(".py") and spec.count("/") == 1


def is_model(item: Any) -> bool:
    return hasattr(item, "parameters") and hasattr(item, "forward") and hasattr(item, "config")


class RewardModel:
    """fn(prompts, completions, **kwargs) -> one score per sample, from a sequence-classification model."""

    def __init__(self, model: Any, tokenizer: Any, chat_template_kwargs: dict | None = None):
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # the score is read before the pads
        self.model, self.tokenizer = model.eval(), tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.__name__ = str(getattr(model.config, "_name_or_path", "") or type(model).__name__).rstrip("/").split("/")[-1]

    def place(self, device: torch.device) -> None:
        self.model.to(device)

    def texts(self, prompts: list, completions: list) -> list[str]:
        if prompts and isinstance(prompts[0], list):  # conversational rows
            return [self.tokenizer.apply_chat_template(prompt + completion, tokenize=False, **self.chat_template_kwargs)
                    for prompt, completion in zip(prompts, completions)]
        return [prompt + completion for prompt, completion in zip(prompts, completions)]

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        inputs = self.tokenizer(text=self.texts(prompts, completions), return_tensors="pt", padding=True,
                                padding_side="right", add_special_tokens=False)
        device = next(self.model.parameters()).device
        with torch.inference_mode():
            logits = self.model(**{key: value.to(device) for key, value in inputs.items()}).logits  # (N, labels)
        return logits[:, 0].float().tolist()


def load_reward_model(name: str, tokenizer: Any = None, dtype: Any = None,
                      chat_template_kwargs: dict | None = None) -> RewardModel:
    """A model directory or hub id -> RewardModel (num_labels=1, as TRL loads it)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    kwargs = {"dtype": dtype} if dtype is not None else {}
    try:
        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1, **kwargs)
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise RewardModelError(f"reward error: cannot load reward model '{name}' as a sequence-classification "
                               f"model ({str(error).splitlines()[0]})") from None
    return RewardModel(model, tokenizer, chat_template_kwargs)


def place_reward_models(functions: list, device: torch.device) -> None:
    """Put every reward model on the policy's device (scores are computed where the policy runs)."""
    for function in functions:
        if isinstance(function.fn, RewardModel):
            function.fn.place(device)
