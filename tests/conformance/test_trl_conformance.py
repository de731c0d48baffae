"""TRL's trainer tests as hasten's contract: each test here mirrors one behaviour that TRL's own
tests/test_grpo_trainer.py (huggingface/trl at 004b40afc9e2b56fb4d5d181eb0d6d1cfbdf595e, the stored
version closest to trl 1.16.0) or tests/test_sft_trainer.py (at 0126d0837f3d6852edc35366d55f027884b572f6)
checks, written anew for this repository (no code of TRL's is copied), and runs against TRL and hasten
by the `lib` switch (conftest.py).

Differences from TRL's tests, the same on both sides: tiny random local models and small local datasets
instead of hub ones, and max_steps=2 (GRPO) or one epoch (SFT) so each test is a few seconds. Not
mirrored: tests of TRL's private helpers (where hasten has the feature, tests/test_losses.py checks it
against TRL's function; get_high_entropy_mask and get_off_policy_mask, which TRL's own test files call
on the trainer, are in test_trl_contract.py), tests that patch TRL internals
(training_step, generate), and vLLM, vision, tool-calling, liger and quantization tests (hardware or
features outside this suite).
"""

from __future__ import annotations

import logging

import pytest
import torch

from .conftest import prompt_dataset, sft_dataset, unsupported_on_hasten


def varied_reward(completions, **kwargs):
    """A score that differs between completions (the tiny byte tokenizer makes lengths alike)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(sum(map(ord, text)) % 13) for text in texts]


def distinct_letters(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(set(text))) for text in texts]


def grpo_args(lib, tmp_path, **fields):
    values = dict(output_dir=str(tmp_path / "out"), learning_rate=0.1, per_device_train_batch_size=3,
                  num_generations=3, max_completion_length=8, max_steps=2, report_to="none", **lib.machine)
    values.update(fields)
    return lib.GRPOConfig(**values)


def snapshot(trainer) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}


def assert_all_changed(trainer, before) -> None:
    for name, value in before.items():
        assert not torch.equal(value, trainer.model.get_parameter(name)), f"{name} did not change"


def assert_trained(trainer, before) -> None:
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_all_changed(trainer, before)


def assert_trained_but_unrouted(trainer, before, same=torch.equal) -> None:
    """assert_trained, leaving out a mixture of experts' experts and router (experts no example routes to keep
    their values, on both sides)."""
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, value in before.items():
        if "experts" in name or "router" in name or "gate.weight" in name:
            continue
        assert not same(value, trainer.model.get_parameter(name)), f"{name} did not change"


def train_grpo(lib, tmp_path, models, reward_funcs=None, dataset=None, model=None, **fields):
    trainer = lib.GRPOTrainer(model=model or models["qwen2"],
                              reward_funcs=reward_funcs if reward_funcs is not None else models["qwen2_reward"],
                              args=grpo_args(lib, tmp_path, **fields),
                              train_dataset=dataset if dataset is not None else prompt_dataset())
    before = snapshot(trainer)
    trainer.train()
    return trainer, before


# ------------------------------------------------------------------ construction


def test_init_minimal(lib, models, tmp_path, monkeypatch):
    if lib.name == "trl" and not torch.cuda.is_available():  # the control fails here, not hasten: not counted
        pytest.xfail("TRL's default GRPOConfig asks for bf16, which transformers refuses without a GPU")
    monkeypatch.chdir(tmp_path)
    lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"], train_dataset=prompt_dataset())


def test_reward_processing_classes_must_match(lib, models, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2_reward"])
    with pytest.raises(ValueError, match="must match the number of reward functions"):
        lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"], args=grpo_args(lib, tmp_path),
                        train_dataset=prompt_dataset(), reward_processing_classes=[tokenizer, tokenizer])


def test_reward_weights_must_match(lib, models, tmp_path):
    with pytest.raises(ValueError, match="reward weights"):
        lib.GRPOTrainer(model=models["qwen2"], reward_funcs=[varied_reward],
                        args=grpo_args(lib, tmp_path, reward_weights=[1.0, 2.0]), train_dataset=prompt_dataset())


def test_args_read_back(lib, models, tmp_path):
    args = grpo_args(lib, tmp_path, num_iterations=2, beta=0.04, temperature=0.7)
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, args=args,
                              train_dataset=prompt_dataset())
    assert trainer.args is args
    assert (args.num_generations, args.max_completion_length, args.beta, args.temperature) == (3, 8, 0.04, 0.7)
    assert args.output_dir == str(tmp_path / "out") and args.learning_rate == 0.1 and args.num_iterations == 2


# ------------------------------------------------------------------ training


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_training(lib, models, tmp_path, kind):
    trainer, before = train_grpo(lib, tmp_path, models, dataset=prompt_dataset(kind))
    assert_trained(trainer, before)


def test_training_summary_entry(lib, models, tmp_path):
    trainer, _ = train_grpo(lib, tmp_path, models, reward_funcs=varied_reward)
    last = trainer.state.log_history[-1]
    for key in ("train_loss", "train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch"):
        assert key in last, key
    assert trainer.state.global_step == 2 and last["step"] == 2
    assert trainer.state.epoch > 0


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_training_loss_types(lib, models, tmp_path, loss_type):
    trainer, before = train_grpo(lib, tmp_path, models, max_completion_length=16, gradient_accumulation_steps=2,
                                 loss_type=loss_type)
    assert_trained(trainer, before)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "vespo"])
def test_training_other_loss_types(lib, models, tmp_path, loss_type):
    trainer, before = train_grpo(lib, tmp_path, models, loss_type=loss_type)
    assert_trained(trainer, before)


def test_training_luspo(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, loss_type="luspo", importance_sampling_level="sequence")
    assert_trained(trainer, before)


def test_training_with_eval(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"],
                              args=grpo_args(lib, tmp_path, per_device_eval_batch_size=3, eval_strategy="steps",
                                             eval_steps=2),
                              train_dataset=prompt_dataset(), eval_dataset=prompt_dataset(split="test"))
    trainer.train()
    assert any("eval_loss" in entry or "eval_reward" in entry for entry in trainer.state.log_history)


def test_evaluate(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward,
                              args=grpo_args(lib, tmp_path, per_device_eval_batch_size=3),
                              train_dataset=prompt_dataset(), eval_dataset=prompt_dataset(split="test"))
    assert trainer.eval_dataset is not None
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_rewards/varied_reward/mean" in metrics


def test_evaluate_dict_of_datasets(lib, models, tmp_path):
    datasets = {"first": prompt_dataset(split="test"), "second": prompt_dataset("standard", "test")}
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward,
                              args=grpo_args(lib, tmp_path, per_device_eval_batch_size=3, eval_strategy="steps",
                                             eval_steps=2),
                              train_dataset=prompt_dataset(), eval_dataset=datasets)
    trainer.train()
    keys = {key for entry in trainer.state.log_history for key in entry}
    for name in ("first", "second"):  # per-name metrics (TRL: eval_<name>_loss, _runtime, ...)
        assert any(key.startswith(f"eval_{name}_") for key in keys), " ".join(sorted(keys))


def test_training_with_num_generations_eval(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"],
                              args=grpo_args(lib, tmp_path, per_device_eval_batch_size=3, num_generations_eval=1,
                                             eval_strategy="steps", eval_steps=2),
                              train_dataset=prompt_dataset(), eval_dataset=prompt_dataset(split="test"))
    trainer.train()


def test_training_eval_on_start(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"],
                              args=grpo_args(lib, tmp_path, per_device_eval_batch_size=3, loss_type="grpo",
                                             eval_strategy="steps", eval_steps=2, eval_on_start=True),
                              train_dataset=prompt_dataset(), eval_dataset=prompt_dataset(split="test"))
    trainer.train()


def test_training_multiple_iterations(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, num_iterations=2)
    assert_trained(trainer, before)


def _lora_checks(trainer, before, base_names) -> None:
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, value in before.items():
        now = trainer.model.get_parameter(name)
        if name in base_names:
            assert torch.allclose(value, now), f"base parameter {name} changed"
        elif "base_layer" not in name and "ref" not in name:
            assert not torch.allclose(value, now), f"adapter parameter {name} did not change"


def test_training_peft_config(lib, models, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    base_names = [f"base_model.model.{name}" for name, _ in model.named_parameters()]
    trainer = lib.GRPOTrainer(model=model, reward_funcs=models["qwen2_reward"], args=grpo_args(lib, tmp_path),
                              train_dataset=prompt_dataset(), peft_config=LoraConfig())
    before = snapshot(trainer)
    trainer.train()
    _lora_checks(trainer, before, base_names)


def test_training_peft_model(lib, models, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    base_names = [f"base_model.model.{name}" for name, _ in model.named_parameters()]
    model = get_peft_model(model, LoraConfig())
    trainer = lib.GRPOTrainer(model=model, reward_funcs=models["qwen2_reward"], args=grpo_args(lib, tmp_path),
                              train_dataset=prompt_dataset())
    before = snapshot(trainer)
    trainer.train()
    _lora_checks(trainer, before, base_names)


def test_training_different_reward_model(lib, models, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_model = AutoModelForSequenceClassification.from_pretrained(models["llama_reward"])
    reward_tokenizer = AutoTokenizer.from_pretrained(models["llama_reward"])
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=reward_model, args=grpo_args(lib, tmp_path),
                              train_dataset=prompt_dataset("conversational"),
                              reward_processing_classes=reward_tokenizer)
    before = snapshot(trainer)
    trainer.train()
    assert_trained(trainer, before)


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_training_reward_func(lib, models, tmp_path, kind):
    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=varied_reward, dataset=prompt_dataset(kind))
    assert_trained(trainer, before)


def test_training_multiple_reward_funcs(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=[varied_reward, distinct_letters])
    assert_trained(trainer, before)


def test_training_sync_and_async_reward_funcs(lib, models, tmp_path):
    async def async_reward(completions, **kwargs):
        return varied_reward(completions)

    def constant(completions, **kwargs):
        return [1 for _ in completions]

    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=[distinct_letters, constant, async_reward])
    assert_trained(trainer, before)


def test_training_multiple_reward_funcs_with_none_output(lib, models, tmp_path):
    def not_applicable(completions, **kwargs):
        return [None] * len(completions)

    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=[varied_reward, not_applicable])
    assert_trained(trainer, before)


def test_training_multiple_reward_funcs_with_weights(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=[varied_reward, distinct_letters],
                                 reward_weights=[0.7, 0.3])
    last = trainer.state.log_history[-1]
    for key in ("rewards/varied_reward/mean", "rewards/varied_reward/std", "rewards/distinct_letters/mean",
                "rewards/distinct_letters/std"):
        assert key in last, key
    assert_trained(trainer, before)


def test_training_multiple_mixed_reward_funcs(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=[varied_reward, models["qwen2_reward"]])
    assert_trained(trainer, before)


def test_training_reward_func_additional_column(lib, models, tmp_path):
    dataset = prompt_dataset().add_column("some_values", list(range(len(prompt_dataset()))))

    def near_value(completions, some_values, **kwargs):
        return [float(abs(len(c) - v)) + varied_reward([c])[0] for c, v in zip(completions, some_values)]

    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=near_value, dataset=dataset)
    assert_trained(trainer, before)


def test_training_with_reward_func_accessing_trainer_state(lib, models, tmp_path):
    seen = []

    def reward(completions, **kwargs):
        seen.append(kwargs["trainer_state"].global_step)
        return varied_reward(completions)

    train_grpo(lib, tmp_path, models, reward_funcs=reward)
    assert seen == [0, 1]


def test_training_with_sync_ref_model(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"],
                              args=grpo_args(lib, tmp_path, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1),
                              train_dataset=prompt_dataset())
    before = snapshot(trainer)
    assert trainer.ref_model is not None
    reference = {name: value.detach().clone() for name, value in trainer.ref_model.named_parameters()}
    trainer.train()
    assert_trained(trainer, before)
    for name, value in reference.items():
        assert not torch.equal(value, trainer.ref_model.get_parameter(name)), f"reference {name} did not move"


def test_training_beta_non_zero(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, beta=0.1)
    assert_trained(trainer, before)
    assert any("kl" in entry for entry in trainer.state.log_history)


def test_training_with_off_policy_mask(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, off_policy_mask_threshold=0.5)
    assert_all_changed(trainer, before)


def test_training_delta_clipping(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, delta=2.0)
    assert_trained(trainer, before)


@pytest.mark.parametrize("model", ["qwen2", "llama"])
def test_training_with_cast_lm_head_to_fp32(lib, models, tmp_path, model):
    trainer, before = train_grpo(lib, tmp_path, models, model=models[model], cast_lm_head_to_fp32=True)
    assert_trained(trainer, before)
    assert trainer.model.lm_head.weight.dtype == torch.float32


def test_training_with_entropy_filter(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, top_entropy_quantile=0.2)
    assert_trained(trainer, before)


def test_training_with_entropy_bonus(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, entropy_coef=0.01, logging_steps=1)
    assert_trained(trainer, before)
    assert [entry["entropy_coef"] for entry in trainer.state.log_history if "entropy_coef" in entry][:2] == \
        pytest.approx([0.01, 0.01])


def test_training_with_adaptive_entropy(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, use_adaptive_entropy=True, entropy_coef=0.01,
                                 entropy_target=100.0, entropy_coef_delta=0.01, logging_steps=1)
    assert_trained(trainer, before)
    coefficients = [entry["entropy_coef"] for entry in trainer.state.log_history if "entropy_coef" in entry]
    assert coefficients[:2] == pytest.approx([0.02, 0.03])  # the entropy stays below the target: it rises


def test_training_beta_non_zero_without_bias_correction(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, beta=0.1, use_bias_correction_kl=False)
    assert_trained(trainer, before)


def test_resume_finished_run_with_more_steps(lib, models, tmp_path):
    """A finished run resumed with a larger max_steps continues from its last checkpoint to the new end."""
    first, _ = train_grpo(lib, tmp_path, models, reward_funcs=varied_reward, logging_steps=1)
    assert first.state.global_step == 2
    second = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward,
                             args=grpo_args(lib, tmp_path, max_steps=4, logging_steps=1),
                             train_dataset=prompt_dataset())
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 4
    assert [entry["step"] for entry in second.state.log_history if "loss" in entry][-2:] == [3, 4]


def test_training_with_sampling_fields(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, top_p=0.9, top_k=10, min_p=0.01, repetition_penalty=1.1)
    assert_trained(trainer, before)


def test_training_with_sampling_generation_kwargs(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, generation_kwargs={"do_sample": True, "top_k": 50,
                                                                           "top_p": 0.95})
    assert_trained(trainer, before)


@unsupported_on_hasten("hasten samples; beam search (num_beams > 1) is not one of its engines' modes")
def test_training_with_beam_generation_kwargs(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, generation_kwargs={"do_sample": True, "top_k": 50,
                                                                           "num_beams": 2, "length_penalty": -0.1})
    assert_trained(trainer, before)


def test_training_normalize_then_sum_aggregation(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, reward_funcs=[varied_reward, distinct_letters],
                                 multi_objective_aggregation="normalize_then_sum")
    assert_trained(trainer, before)


@pytest.mark.parametrize("scale_rewards", [False, "group", "batch", True, "none"])
def test_training_scale_rewards(lib, models, tmp_path, scale_rewards):
    trainer, before = train_grpo(lib, tmp_path, models, scale_rewards=scale_rewards)
    assert_trained(trainer, before)


def test_warning_raised_all_rewards_none(lib, models, tmp_path, caplog):
    def always_none(completions, **kwargs):
        return [None] * len(completions)

    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=always_none, args=grpo_args(lib, tmp_path),
                              train_dataset=prompt_dataset())
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text


def test_training_num_generations_larger_than_batch_size(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, num_generations=6, gradient_accumulation_steps=2)
    assert_trained(trainer, before)


def test_training_multiple_dataloader_workers(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, dataloader_num_workers=2)
    assert_trained(trainer, before)


def test_training_without_shuffle_and_with_padding_multiple(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, shuffle_dataset=False, pad_to_multiple_of=8)
    assert_trained(trainer, before)


def test_training_with_sequence_importance_sampling(lib, models, tmp_path):
    trainer, before = train_grpo(lib, tmp_path, models, importance_sampling_level="sequence", loss_type="grpo")
    assert_trained(trainer, before)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo"])
def test_training_sequence_importance_sampling_other_losses(lib, models, tmp_path, loss_type):
    trainer, before = train_grpo(lib, tmp_path, models, importance_sampling_level="sequence", loss_type=loss_type)
    assert_trained(trainer, before)


def test_training_moe_model(lib, models, tmp_path):
    trainer, _ = train_grpo(lib, tmp_path, models, model=models["qwen3_moe"], reward_funcs=varied_reward)
    assert trainer.state.log_history[-1]["train_loss"] is not None


def test_report_to_string(lib, models, tmp_path):
    args = grpo_args(lib, tmp_path, report_to="tensorboard")
    lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, args=args, train_dataset=prompt_dataset())


# ------------------------------------------------------------------ SFT


def sft_args(lib, tmp_path, **fields):
    values = dict(output_dir=str(tmp_path / "sft"), num_train_epochs=1, per_device_train_batch_size=4,
                  learning_rate=0.1, report_to="none", **lib.machine)
    values.update(fields)
    return lib.SFTConfig(**values)


@pytest.mark.parametrize("model", ["qwen2", "llama", "qwen3_moe"])
def test_sft_train(lib, models, tmp_path, model):
    trainer = lib.SFTTrainer(model=models[model], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"))
    before = snapshot(trainer)
    trainer.train()
    assert_trained_but_unrouted(trainer, before, same=torch.allclose)


def test_sft_train_model(lib, models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["qwen2"])
    trainer = lib.SFTTrainer(model=model, args=sft_args(lib, tmp_path), train_dataset=sft_dataset("language_modeling"))
    before = snapshot(trainer)
    trainer.train()
    assert_trained(trainer, before)


@pytest.mark.parametrize("kind", ["conversational_language_modeling", "prompt_completion"])
def test_sft_train_dataset_kinds(lib, models, tmp_path, kind):
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path), train_dataset=sft_dataset(kind))
    before = snapshot(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    changed = [name for name, value in before.items() if not torch.equal(value, trainer.model.get_parameter(name))]
    assert changed


def test_sft_train_with_peft_config(lib, models, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    base_names = [f"base_model.model.{name}" for name, _ in
                  AutoModelForCausalLM.from_pretrained(models["qwen2"]).named_parameters()]
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"), peft_config=LoraConfig())
    before = snapshot(trainer)
    trainer.train()
    _lora_checks(trainer, before, base_names)


def test_sft_train_with_eval(lib, models, tmp_path):
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, eval_strategy="epoch"),
                             train_dataset=sft_dataset("language_modeling"),
                             eval_dataset=sft_dataset("language_modeling"))
    trainer.train()
    assert any("eval_loss" in entry for entry in trainer.state.log_history)
