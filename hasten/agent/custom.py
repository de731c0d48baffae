"""rollout_func, TRL 1.16's contract: the user's function does the generation.

    def rollout_func(prompts: list, trainer) -> dict:
        return {"prompt_ids": [...], "completion_ids": [...], "logprobs": [...],   # one list per completion
                "env_mask": [...],                  # optional: 1 = model token, 0 = environment token (TRL)
                "my_field": [...]}                  # anything else: a per-completion reward column

`prompts` are the step's prompts as TRL's sampler hands them over: each one
num_generations times in a row (group-major), so the function returns one
completion per entry. `trainer` is the hasten GRPOTrainer (its
processing_class, model and args). The result becomes an ordinary Rollout
(every completion with its own prompt) and the learner proceeds as usual;
`env_mask` plays the role of the tool mask (the loss leaves its 0 tokens out).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UserError
from ..rewards.batch import RewardInputs
from ..rollout import Engine, Rollout, RowRange, SamplingParams
from .loop import AgentBatch

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


class RolloutFuncError(UserError):
    """rollout_func returned something the trainer cannot learn from; one line."""


class RolloutFunction:
    """Agent-shaped (generate -> AgentBatch) around a user's rollout_func."""

    def __init__(self, fn: Callable[[list, Any], dict], trainer: Any, tokenizer, pad_token_id: int,
                 eos_token_ids: list[int]):
        self.fn, self.trainer, self.tokenizer = fn, trainer, tokenizer
        self.pad_token_id, self.eos_token_ids = pad_token_id, set(eos_token_ids)

    def generate(self, engine: Engine, rows: list[dict], num_generations: int, sampling: SamplingParams,
                 seed: int, row_range: RowRange | None = None) -> AgentBatch:
        sample_rows = [row for row in rows for _ in range(num_generations)]
        output = self.fn([row["prompt"] for row in sample_rows], self.trainer)
        count = len(sample_rows)
        missing = [key for key in REQUIRED if not isinstance(output, dict) or key not in output]
        if missing:
            raise RolloutFuncError(f"rollout_func error: the result has no {', '.join(missing)} "
                                   f"(it must return a dict with {', '.join(REQUIRED)})")
        for key, values in output.items():
            if values is not None and len(values) != count:
                raise RolloutFuncError(f"rollout_func error: '{key}' has {len(values)} entries for {count} "
                                       f"completions ({len(rows)} prompts x {num_generations} generations)")
        rollout = self._rollout(output, sampling)
        completion_ids = [list(ids) for ids in output["completion_ids"]]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": text}] if isinstance(row["prompt"], list) else text
                       for row, text in zip(sample_rows, texts)]
        keys = sorted({key for row in rows for key in row if key != "prompt"})
        columns = {key: [row.get(key) for row in sample_rows] for key in keys}
        columns.update({key: list(values) for key, values in output.items()
                        if key not in REQUIRED and key != "env_mask"})
        inputs = RewardInputs([row["prompt"] for row in sample_rows], completions, texts, columns, completion_ids)
        return AgentBatch(rollout, inputs, {})

    def _rollout(self, output: dict, sampling: SamplingParams) -> Rollout:
        prompts = [list(ids) for ids in output["prompt_ids"]]
        completions = [list(ids) for ids in output["completion_ids"]]
        logprobs = output["logprobs"]
        masks = output.get("env_mask")
        count, width = len(completions), max(1, max(len(ids) for ids in completions))
        prompt_width = max(len(ids) for ids in prompts)
        prompt_ids = torch.full((count, prompt_width), self.pad_token_id, dtype=torch.long)  # (N, P) left-padded
        prompt_mask = torch.zeros(count, prompt_width, dtype=torch.long)
        ids = torch.full((count, width), self.pad_token_id, dtype=torch.long)  # (N, T)
        mask = torch.zeros(count, width, dtype=torch.long)
        tool_mask = torch.zeros(count, width, dtype=torch.long)
        sampled = torch.zeros(count, width)
        for row, (prompt, completion) in enumerate(zip(prompts, completions)):
            if prompt:
                prompt_ids[row, prompt_width - len(prompt):] = torch.tensor(prompt)
                prompt_mask[row, prompt_width - len(prompt):] = 1
            length = len(completion)
            if length:
                ids[row, :length] = torch.tensor(completion)
                mask[row, :length] = 1
                tool_mask[row, :length] = torch.tensor(masks[row] if masks is not None else [1] * length)
                if logprobs is not None and logprobs[row] is not None:
                    sampled[row, :length] = torch.tensor([float(value) for value in logprobs[row]][:length])
        ended = torch.tensor([bool(c) and c[-1] in self.eos_token_ids for c in completions])
        device = next(self.trainer.model.parameters()).device  # a Rollout lives on the model's device
        return Rollout(prompt_ids.to(device), prompt_mask.to(device), ids.to(device), mask.to(device),
                       (sampled * tool_mask).to(device), ended.to(device), 1, sampling,
                       tool_mask=tool_mask.to(device) if masks is not None else None)

    def close(self) -> None:
        pass
