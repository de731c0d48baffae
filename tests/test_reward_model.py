"""Reward models (rewards/reward_model.py): scores equal TRL's own on the same inputs, standard and
conversational, with the model's own tokenizer or a given one; a model directory as a CLI/YAML reward."""

from __future__ import annotations

import pytest
import torch

from hasten.rewards import load_reward
from hasten.rewards.reward_model import RewardModel, is_model_spec

PROMPTS = ["The cat", "Two plus two is", "Say hi"]
COMPLETIONS = [" sat on the mat.", " four", " hi!!"]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from hasten.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("reward") / "tiny_reward"
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def policy_dir(reward_dir):
    """TRL needs a causal LM to build its trainer; the reward model's weights as a Qwen2 causal LM."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    path = reward_dir + "_policy"
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reference(policy_dir, reward_dir, tmp_path, prompts, completions, tokenizer=None):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=3,
                          report_to="none", use_cpu=not torch.cuda.is_available(), bf16=False)
    trainer = trl.GRPOTrainer(model=policy_dir, reward_funcs=reward_dir, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["x"] * 3}),
                              reward_processing_classes=tokenizer)
    inputs = [{"prompt": prompt} for prompt in prompts]
    return trainer._calculate_rewards(inputs, prompts, completions, [[1]] * len(prompts))[:, 0]


def test_standard_rows_score_as_trl(policy_dir, reward_dir, tmp_path):
    ours = load_reward(reward_dir)  # the CLI / YAML path: rewards.extra naming a model directory
    assert ours.name == "tiny_reward" and ours.deterministic
    scores = torch.tensor(ours.fn(prompts=PROMPTS, completions=COMPLETIONS))
    expected = reference(policy_dir, reward_dir, tmp_path, PROMPTS, COMPLETIONS)
    torch.testing.assert_close(scores, expected.float(), rtol=1e-5, atol=1e-6)
    assert len(set(scores.tolist())) == 3  # the inputs differ, so do the scores (the check can fail)


def test_conversational_rows_score_as_trl_with_given_tokenizer(policy_dir, reward_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts = [[{"role": "user", "content": text}] for text in PROMPTS]
    completions = [[{"role": "assistant", "content": text}] for text in COMPLETIONS]
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    tokenizer.pad_token = "<|im_start|>"  # a pad of its own, as TRL's different-reward-model test sets
    model = RewardModel(AutoModelForSequenceClassification.from_pretrained(reward_dir), tokenizer)
    scores = torch.tensor(model(prompts=prompts, completions=completions))
    expected = reference(policy_dir, reward_dir, tmp_path, prompts, completions, AutoTokenizer.from_pretrained(
        reward_dir, pad_token="<|im_start|>"))
    torch.testing.assert_close(scores, expected.float(), rtol=1e-5, atol=1e-6)
    plain = torch.tensor(model(prompts=PROMPTS, completions=COMPLETIONS))
    assert not torch.allclose(scores, plain)  # the chat template was applied


def test_model_spec_recognised(reward_dir, tmp_path):
    assert is_model_spec(reward_dir) and is_model_spec("org/reward-model")
    assert not is_model_spec("rewards.py:fn") and not is_model_spec(str(tmp_path)) and not is_model_spec("x.py")


def test_grpo_trainer_takes_reward_models(reward_dir, policy_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from hasten import GRPOConfig, GRPOTrainer

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    loaded = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    loaded.config._name_or_path = "other/second_reward"
    trainer = GRPOTrainer(model=policy_dir, reward_funcs=[length, reward_dir, loaded],
                          args=GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=3,
                                          num_generations=3, max_steps=1, max_completion_length=4),
                          train_dataset=[{"prompt": p} for p in PROMPTS], log=lambda line: None)
    assert [f.name for f in trainer.session.rewards] == ["length", "tiny_reward", "second_reward"]
    with pytest.raises(ValueError, match=r"number of reward processing classes \(2\) must match"):
        GRPOTrainer(model=policy_dir, reward_funcs=reward_dir, reward_processing_classes=[None, None],
                    args=GRPOConfig(output_dir=str(tmp_path / "out2")), train_dataset=[{"prompt": "x"}])
