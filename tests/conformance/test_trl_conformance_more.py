"""More of TRL's GRPO and SFT trainer tests as hasten's contract, beyond test_trl_conformance.py.

Same sources and rules as that file (TRL's tests/test_grpo_trainer.py at 004b40afc9e2 and
tests/test_sft_trainer.py at 0126d0837f3d, read to learn what they check and written anew here; tiny
local models and datasets, the same on both sides). COVERAGE.md maps every TRL test to the test here or
there that mirrors it, or says why none does.
"""

from __future__ import annotations


import torch

from .conftest import PROMPTS, prompt_dataset, sft_dataset, unsupported_on_hasten
from .test_trl_conformance import _lora_checks, assert_trained, grpo_args, sft_args, snapshot


# ------------------------------------------------------------------ GRPO


def test_training_peft_with_gradient_checkpointing(lib, models, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["qwen2"], dtype=torch.float32)
    base_names = [f"base_model.model.{name}" for name, _ in model.named_parameters()]
    trainer = lib.GRPOTrainer(model=model, reward_funcs=models["qwen2_reward"],
                              args=grpo_args(lib, tmp_path, gradient_checkpointing=True),
                              train_dataset=prompt_dataset(), peft_config=LoraConfig())
    before = snapshot(trainer)
    trainer.train()
    _lora_checks(trainer, before, base_names)


def test_correct_reward_processing_classes_list(lib, models, tmp_path):
    from transformers import AutoTokenizer

    tokenizers = [AutoTokenizer.from_pretrained(models[name]) for name in ("qwen2_reward", "llama_reward")]
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=[models["qwen2_reward"], models["llama_reward"]],
                              reward_processing_classes=tokenizers, args=grpo_args(lib, tmp_path),
                              train_dataset=prompt_dataset())
    assert len(trainer.reward_processing_classes) == 2


def test_single_reward_model_with_single_processing_class(lib, models, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2_reward"])
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"],
                              reward_processing_classes=tokenizer, args=grpo_args(lib, tmp_path),
                              train_dataset=prompt_dataset())
    assert len(trainer.reward_processing_classes) == 1
    assert trainer.reward_processing_classes[0] is tokenizer


def test_training_with_chat_template_kwargs(lib, models, tmp_path):
    trainer_args = grpo_args(lib, tmp_path, chat_template_kwargs={"enable_thinking": False})
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=models["qwen2_reward"], args=trainer_args,
                              train_dataset=prompt_dataset("conversational"))
    before = snapshot(trainer)
    trainer.train()
    assert_trained(trainer, before)


# ------------------------------------------------------------------ SFT


def _sft_trained(trainer, before) -> None:
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, value in before.items():
        assert not torch.allclose(value, trainer.model.get_parameter(name)), f"{name} did not change"


def test_sft_train_with_gradient_checkpointing(lib, models, tmp_path):
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, gradient_checkpointing=True),
                             train_dataset=sft_dataset("language_modeling"))
    before = snapshot(trainer)
    trainer.train()
    _sft_trained(trainer, before)


def test_sft_train_peft_model(lib, models, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["qwen2"])
    base_names = [f"base_model.model.{name}" for name, _ in model.named_parameters()]
    trainer = lib.SFTTrainer(model=get_peft_model(model, LoraConfig()), args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"))
    before = snapshot(trainer)
    trainer.train()
    _lora_checks(trainer, before, base_names)


def test_sft_train_with_pretokenized_data(lib, models, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2"])
    dataset = sft_dataset("language_modeling").map(lambda row: tokenizer(row["text"]), remove_columns=["text"])
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path), train_dataset=dataset)
    before = snapshot(trainer)
    trainer.train()
    _sft_trained(trainer, before)


def test_sft_train_with_non_chatml_conversational_data(lib, models, tmp_path):
    rows = sft_dataset("conversational_language_modeling")
    dataset = rows.map(lambda row: {"conversations": [{"from": m["role"], "value": m["content"]}
                                                      for m in row["messages"]]}, remove_columns="messages")
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path), train_dataset=dataset)
    before = snapshot(trainer)
    trainer.train()
    _sft_trained(trainer, before)


def _train_packed(lib, models, tmp_path, strategy):
    trainer = lib.SFTTrainer(model=models["qwen2"],
                             args=sft_args(lib, tmp_path, packing=True, packing_strategy=strategy, max_length=10),
                             train_dataset=sft_dataset("language_modeling"))
    before = snapshot(trainer)
    trainer.train()
    _sft_trained(trainer, before)


def test_sft_train_packing(lib, models, tmp_path):  # TRL's test_train_packing[bfd]
    _train_packed(lib, models, tmp_path, "bfd")


def test_sft_train_packing_wrapped(lib, models, tmp_path):  # TRL's test_train_packing[wrapped]
    _train_packed(lib, models, tmp_path, "wrapped")


def test_sft_train_completion_only(lib, models, tmp_path):
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS[:-1]],
                                 "completion": [[{"role": "assistant", "content": q}] for q in PROMPTS[1:]]})
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, completion_only_loss=True),
                             train_dataset=dataset)
    before = snapshot(trainer)
    trainer.train()
    _sft_trained(trainer, before)


def test_sft_train_with_multiple_eval_dataset(lib, models, tmp_path):
    held_out = sft_dataset("language_modeling")
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, eval_strategy="epoch"),
                             train_dataset=sft_dataset("language_modeling"),
                             eval_dataset={"data1": held_out, "data2": held_out})
    trainer.train()
    keys = {key for entry in trainer.state.log_history for key in entry}
    assert {"eval_data1_loss", "eval_data2_loss"} <= keys


def test_sft_train_model_torch_dtype(lib, models, tmp_path):
    trainer = lib.SFTTrainer(model=models["qwen2"],
                             args=sft_args(lib, tmp_path, model_init_kwargs={"dtype": torch.float16}),
                             train_dataset=sft_dataset("language_modeling"))
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert all(value.dtype == torch.float16 for value in trainer.model.parameters())


def test_sft_train_with_iterable_dataset(lib, models, tmp_path):
    dataset = sft_dataset("language_modeling").to_iterable_dataset()
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, max_steps=3), train_dataset=dataset)
    before = snapshot(trainer)
    trainer.train()
    _sft_trained(trainer, before)


def test_sft_prompt_tuning(lib, models, tmp_path):
    from peft import PromptEncoderConfig, TaskType

    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"),
                             peft_config=PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=8))
    before = snapshot(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, value in before.items():
        changed = not torch.allclose(value, trainer.model.get_parameter(name))
        assert changed == ("prompt_encoder" in name), f"{name}: changed={changed}"
