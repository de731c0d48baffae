"""TRL 1.16's semantics in the core: unscorable samples, reward keyword arguments, min_p,
repetition penalty (both engines agree), stop strings, chat template kwargs, truncated-completion
masking and transformers' schedules."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import encode, make_engine, rollout_of
from hasten.algo import group_advantages
from hasten.rewards import RewardFunction, score_rewards
from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine
from hasten.rollout.sampling import filter_logits, penalize_repetition
from hasten.rollout.stops import apply_stop_strings, stop_length
from hasten.train.optimization import lr_factor

NAN = math.nan


def test_unscorable_sample_is_left_out_of_its_group_and_gets_advantage_zero():
    rewards = torch.tensor([1.0, 0.0, NAN, 1.0, 2.0, 2.0, 2.0, 5.0])  # (2 groups x 4)
    advantages = group_advantages(rewards, 4, "group")
    assert advantages[2] == 0
    scored = torch.tensor([1.0, 0.0, 1.0])  # group 0 without the unscorable sample
    expected = (scored - scored.mean()) / (scored.std() + 1e-4)
    assert torch.allclose(advantages[[0, 1, 3]], expected)
    second = torch.tensor([2.0, 2.0, 2.0, 5.0])
    assert torch.allclose(advantages[4:], (second - second.mean()) / (second.std() + 1e-4))


def test_group_with_one_scored_sample_has_no_signal_and_no_nan():
    advantages = group_advantages(torch.tensor([NAN, NAN, 3.0, NAN]), 4, "group")
    assert torch.equal(advantages, torch.zeros(4))
    assert torch.isfinite(group_advantages(torch.tensor([NAN, 1.0, 2.0, NAN]), 4, "batch")).all()


def test_scores_mark_samples_no_function_applied_to():
    def first(prompts, completions, **kwargs):
        return [None, 1.0, None]

    def second(prompts, completions, **kwargs):
        return [None, None, 0.5]

    scores = score_rewards([RewardFunction("a", first), RewardFunction("b", second)], ["p"] * 3, ["c"] * 3, {},
                           [[1]] * 3)
    assert scores.scorable.tolist() == [False, True, True]
    assert math.isnan(scores.scored_total[0]) and scores.total[0] == 0  # total keeps TRL's nansum


def test_reward_functions_get_trl_keyword_arguments():
    from hasten.rewards.scoring import RewardLogs, RewardState

    seen = {}

    def reward(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
        seen["step"] = trainer_state.global_step
        log_metric("my_metric", 2.0)
        log_metric("my_metric", 4.0)
        log_extra("judge", ["ok"] * len(completions))
        return [1.0] * len(completions)

    logs = RewardLogs(RewardState(global_step=7))
    score_rewards([RewardFunction("r", reward)], ["p", "q"], ["a", "b"], {}, [[1], [2]], logs.kwargs())
    metrics, columns = logs.drain()
    assert seen["step"] == 7 and metrics == {"my_metric": 3.0} and columns == {"judge": ["ok", "ok"]}
    assert logs.drain() == ({}, {})


def test_min_p_keeps_tokens_within_the_ratio_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(filter_logits(logits, SamplingParams(min_p=0.2)))  # floor 0.1
    assert kept.tolist() == [[True, True, True, False]]


def test_repetition_penalty_is_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    seen = torch.tensor([[True, True, False, False]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[0, 1]]), logits.clone())
    assert torch.allclose(penalize_repetition(logits, seen, 1.3), expected)


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=14, repetition_penalty=1.5),
                                      SamplingParams(max_new_tokens=14, temperature=0.0, repetition_penalty=2.0),
                                      SamplingParams(max_new_tokens=14, temperature=0.8, min_p=0.05)])
def test_engines_agree_with_the_new_sampling_options(short_model, tokenizer, sampling):
    prompts = encode(tokenizer)
    expected = make_engine(short_model, tokenizer).generate(prompts, 4, sampling, seed=3)
    actual = LeanEngine(short_model, tokenizer.pad_token_id, [tokenizer.eos_token_id]).generate(
        prompts, 4, sampling, seed=3)
    assert torch.equal(expected.completion_ids, actual.completion_ids)
    assert torch.equal(expected.completion_mask, actual.completion_mask)


def test_repetition_penalty_changes_greedy_choices(model, tokenizer):
    plain = rollout_of(model, tokenizer, num_generations=1, max_new_tokens=24, temperature=0.0)
    engine = make_engine(model, tokenizer)
    penalized = engine.generate(encode(tokenizer), 1, SamplingParams(max_new_tokens=24, temperature=0.0,
                                                                     repetition_penalty=5.0), seed=0)
    for row, length in zip(penalized.completion_ids.tolist(), penalized.completion_lengths.tolist()):
        tokens = row[:length]
        assert len(set(tokens)) == len(tokens) or tokens[-1] == tokenizer.eos_token_id  # no repeats under a high penalty
    assert not torch.equal(plain.completion_ids, penalized.completion_ids)


def test_stop_strings_cut_after_the_first_occurrence(model, tokenizer):
    ids = tokenizer("ab</answer>cd", add_special_tokens=False)["input_ids"]
    length = stop_length(tokenizer, ids, ["</answer>"])
    assert tokenizer.decode(ids[:length]) == "ab</answer>"
    rollout = rollout_of(model, tokenizer, num_generations=2, max_new_tokens=16)
    first = tokenizer.decode(rollout.completion_token_lists()[0][:3], skip_special_tokens=True)
    cut = apply_stop_strings(rollout, tokenizer, [first[-1]], tokenizer.pad_token_id)
    assert cut.completion_lengths[0] <= 3 and bool(cut.ended_with_eos[0])
    assert (cut.completion_ids[cut.completion_mask == 0] == tokenizer.pad_token_id).all()
    assert torch.equal(cut.completion_mask.sum(1), cut.completion_lengths)


def test_chat_template_kwargs_reach_the_template(tokenizer):
    from hasten.rollout.prompts import encode_prompt

    class Recording:
        def __init__(self):
            self.kwargs = None

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            self.kwargs = kwargs
            return "text"

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [1, 2]}

    recording = Recording()
    encode_prompt(recording, [{"role": "user", "content": "hi"}], enable_thinking=False)
    assert recording.kwargs == {"enable_thinking": False}


def test_transformers_schedules_with_warmup_from_zero():
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    parameter = torch.nn.Parameter(torch.zeros(1))
    for make, name in ((get_linear_schedule_with_warmup, "linear"), (get_cosine_schedule_with_warmup, "cosine")):
        scheduler = make(torch.optim.SGD([parameter], lr=1.0), num_warmup_steps=3, num_training_steps=10)
        for step in range(10):
            assert lr_factor(step, 3, 10, name, 0.0, warmup_from_zero=True) == pytest.approx(
                scheduler.lr_lambdas[0](step), abs=1e-12)


def test_mask_truncated_completions_gives_truncated_samples_no_loss(tokenizer):
    from conftest import learner_step

    from hasten.models.tiny import tiny_model

    model = tiny_model(len(tokenizer))
    rollout = rollout_of(model, tokenizer, num_generations=4, max_new_tokens=6)
    assert not rollout.ended_with_eos.any()  # the plain tiny model rarely ends within 6 tokens
    advantages = torch.linspace(-1, 1, rollout.num_samples)
    zero_mask = rollout.completion_mask * rollout.ended_with_eos[:, None]
    metrics, gradients = learner_step(model, tokenizer, rollout, advantages, lambda cfg: None, loss_mask=zero_mask)
    assert metrics["loss"] == 0 and all(float(g.abs().sum()) == 0 for g in gradients)
