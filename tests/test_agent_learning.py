"""Multi-turn samples through the learning pass: log-probs equal transformers' on the whole conversation,
and the loss with the tool mask equals TRL 1.16's own _compute_loss on the same tensors.

The sample is real: turn 0 is a scripted tool call (the random tiny model would never write one), the
tool runs, its result is appended as the template's tool turn, and the lean engine samples the next
turn from the conversation so far. So the continuation's sampling log-probs are checked too.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hasten.agent import make_tool
from hasten.agent.loop import Agent, AgentSettings
from hasten.agent.template import HERMES_TEMPLATE, ToolTemplate
from hasten.algo import LOSSES, LossInputs, LossSettings
from hasten.models.tiny import tiny_model, tiny_tokenizer
from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine
from hasten.train.logprobs import completion_logprobs
from hasten.train.packing import packed_logprobs

TEMPERATURE = 0.7
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 13}}\n</tool_call>'


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class ScriptedFirstTurn:
    """The real engine, except that turn 0 is the tool call CALL (+ EOS) for every sample."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer, self.first = engine, tokenizer, True
        self.call_ids = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(self, prompts, num_generations, sampling, seed, rows=None):
        rollout = self.engine.generate(prompts, num_generations, sampling, seed, rows)
        if not self.first:
            return rollout
        self.first = False
        count, length = rollout.num_samples, len(self.call_ids)
        ids = torch.tensor([self.call_ids] * count)
        return dataclasses.replace(rollout, completion_ids=ids, completion_mask=torch.ones_like(ids),
                                   sampling_logprobs=torch.zeros(count, length),
                                   ended_with_eos=torch.ones(count, dtype=torch.bool))

    def weights_changed(self):
        pass


@pytest.fixture(scope="module")
def multi_turn():
    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer)).eval()
    engine = ScriptedFirstTurn(LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id]), tokenizer)
    agent = Agent(tokenizer, ToolTemplate(tokenizer, HERMES_TEMPLATE), [make_tool(multiply)], None,
                  AgentSettings(max_turns=2), tokenizer.pad_token_id)
    rows = [{"prompt": [{"role": "user", "content": f"What is {n} x 13?"}]} for n in (12, 7)]
    batch = agent.generate(engine, rows, 3, SamplingParams(max_new_tokens=160, temperature=TEMPERATURE), seed=5)
    return model, batch.rollout, len(engine.call_ids)


def reference_logprobs(model, rollout) -> torch.Tensor:
    """transformers' forward on prompt + whole completion, one sample at a time: (N, T), 0 past the end."""
    out = torch.zeros(rollout.completion_ids.shape)
    for row in range(rollout.num_samples):
        group = row // rollout.num_generations
        prompt = rollout.prompt_ids[group][rollout.prompt_mask[group].bool()].tolist()
        length = int(rollout.completion_mask[row].sum())
        full = torch.tensor([prompt + rollout.completion_ids[row, :length].tolist()])
        with torch.no_grad():
            logits = model(full).logits[0, :-1].float() / TEMPERATURE  # (L-1, V)
        logps = torch.log_softmax(logits, dim=-1).gather(1, full[0, 1:, None])[:, 0]
        out[row, :length] = logps[-length:]
    return out


def test_multi_turn_sample_has_tool_and_model_turns(multi_turn):
    _, rollout, first = multi_turn
    tool_mask = rollout.tool_mask
    for row in range(rollout.num_samples):
        marks = tool_mask[row, :int(rollout.completion_mask[row].sum())].tolist()
        assert marks[:first] == [1] * first and 0 in marks and marks[-1] == 1  # call, tool turn, model turn


@pytest.mark.parametrize("packed", [False, True])
def test_learning_pass_logprobs_equal_transformers_on_the_conversation(multi_turn, packed):
    model, rollout, _ = multi_turn
    expected = reference_logprobs(model, rollout)
    rows = torch.arange(rollout.num_samples)
    with torch.no_grad():
        if packed:
            stats = packed_logprobs(model, rollout, rows, TEMPERATURE, False, 0)
        else:
            group = rows // rollout.num_generations
            stats = completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                        rollout.completion_ids, rollout.completion_mask, temperature=TEMPERATURE)
    mask = rollout.completion_mask.bool()  # every token the forward sees, tool results included
    assert (stats.logps - expected)[mask].abs().max() < 1e-4


def test_continuation_sampling_logprobs_equal_transformers(multi_turn):
    """The turn after the tool result was sampled from the right distribution: the whole conversation."""
    model, rollout, first = multi_turn
    expected = reference_logprobs(model, rollout)
    sampled = rollout.tool_mask.bool() & rollout.completion_mask.bool()
    sampled[:, :first] = False  # the scripted call has no sampling log-probs
    assert sampled.any()
    assert (rollout.sampling_logprobs - expected)[sampled].abs().max() < 1e-4
    assert torch.all(rollout.sampling_logprobs[rollout.tool_mask == 0] == 0)


def trl_loss(loss_type, logps, old_logps, advantages, completion_mask, tool_mask, max_completion_length):
    """TRL 1.16's GRPOTrainer._compute_loss on these tensors, its forward stubbed to return `logps`."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    identity = SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction="sum": x, num_processes=1,
                               sync_gradients=True, gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=0.0, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=identity, _entropy_bonus_enabled=False,
        max_completion_length=max_completion_length, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1))
    count = completion_mask.shape[0]
    inputs = {"prompt_ids": torch.zeros(count, 1, dtype=torch.long), "prompt_mask": torch.ones(count, 1),
              "completion_ids": torch.zeros_like(completion_mask), "completion_mask": completion_mask,
              "tool_mask": tool_mask, "advantages": advantages, "old_per_token_logps": old_logps,
              "num_items_in_batch": (completion_mask * tool_mask).sum()}
    return trl.GRPOTrainer._compute_loss(trainer, None, inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_with_tool_mask_equals_trl(multi_turn, loss_type):
    model, rollout, _ = multi_turn
    rows = torch.arange(rollout.num_samples)
    with torch.no_grad():
        logps = packed_logprobs(model, rollout, rows, TEMPERATURE, False, 0).logps  # (N, T)
    generator = torch.Generator().manual_seed(1)
    old_logps = logps + 0.3 * torch.randn(logps.shape, generator=generator)  # ratios that clip on both sides
    advantages = torch.randn(rollout.num_samples, generator=generator)  # (N,)
    mask = rollout.loss_mask()  # (N, T) model tokens only
    ours_logps = logps.clone().requires_grad_(True)
    theirs_logps = logps.clone().requires_grad_(True)
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28)
    ours, _ = LOSSES[loss_type](LossInputs(ours_logps, old_logps, None, advantages, mask, float(mask.sum()),
                                           rollout.num_samples, rollout.sampling.max_new_tokens), settings)
    theirs = trl_loss(loss_type, theirs_logps, old_logps, advantages, rollout.completion_mask, rollout.tool_mask,
                      rollout.sampling.max_new_tokens)
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), abs=1e-6)
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_logps.grad, theirs_logps.grad, atol=1e-7)
    assert torch.all(ours_logps.grad[rollout.tool_mask == 0] == 0)  # no gradient through tool results
