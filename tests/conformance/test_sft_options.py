"""TRL 1.16's SFT options, as TRL's tests/test_sft_trainer.py uses them, on TRL (the control) and hasten:
packing_strategy="wrapped", eval_packing and the seq_lengths column, dataset_kwargs={"skip_prepare_dataset":
True}, chat_template_path (a template file, or a tokenizer to clone), and a mixture-of-experts model whose
config declares no router aux loss coefficient (Glm4Moe), peft prompt learning (prompt, prefix and
p-tuning). Tiny local models, no network."""

from __future__ import annotations

import itertools

import pytest
import torch

from .conftest import PROMPTS, TEST_PROMPTS, sft_dataset
from .test_trl_conformance import assert_trained_but_unrouted, sft_args, snapshot


def _text(prompts: list[str]):
    from datasets import Dataset

    return Dataset.from_dict({"text": [f"{prompt} is better than ugly." for prompt in prompts]})


def test_sft_wrapped_packing_cuts_the_concatenated_rows_into_blocks(lib, models, tmp_path):
    plain = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, max_length=None),
                           train_dataset=_text(PROMPTS))
    trainer = lib.SFTTrainer(model=models["qwen2"],
                             args=sft_args(lib, tmp_path, packing=True, packing_strategy="wrapped", max_length=16),
                             train_dataset=_text(PROMPTS))
    blocks = trainer.train_dataset.to_dict()["input_ids"]
    assert "seq_lengths" not in trainer.train_dataset.column_names  # TRL adds them for bfd only
    assert [token for block in blocks for token in block] == [t for row in plain.train_dataset.to_dict()["input_ids"] for t in row]
    assert all(len(block) == 16 for block in blocks[:-1]) and 0 < len(blocks[-1]) <= 16
    before = snapshot(trainer)
    trainer.train()
    assert_trained_but_unrouted(trainer, before)


def test_sft_eval_packing_gives_both_datasets_seq_lengths(lib, models, tmp_path):  # TRL's test_eval_packing
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, packing=True, max_length=128),
                             train_dataset=_text(PROMPTS), eval_dataset=_text(TEST_PROMPTS))
    train, evaluation = trainer.train_dataset.to_dict(), trainer.eval_dataset.to_dict()
    assert sum(len(lengths) for lengths in train["seq_lengths"]) == len(PROMPTS)  # every example, whole
    assert sum(len(lengths) for lengths in evaluation["seq_lengths"]) == len(TEST_PROMPTS)
    assert all(sum(lengths) <= 128 for lengths in train["seq_lengths"] + evaluation["seq_lengths"])
    assert [len(ids) for ids in train["input_ids"]] == [sum(lengths) for lengths in train["seq_lengths"]]
    # best fit, longest first: train lengths 50 49 46 41 38 38 33 33 29 -> [50 49 29] [46 41 38] [38 33 33]
    assert (len(train["input_ids"]), len(evaluation["input_ids"])) == (3, 2)


def test_sft_eval_packing_false_packs_only_the_train_dataset(lib, models, tmp_path):  # test_only_train_packing
    trainer = lib.SFTTrainer(model=models["qwen2"],
                             args=sft_args(lib, tmp_path, packing=True, eval_packing=False, max_length=64),
                             train_dataset=_text(PROMPTS), eval_dataset=_text(TEST_PROMPTS))
    assert sum(len(lengths) for lengths in trainer.train_dataset.to_dict()["seq_lengths"]) == len(PROMPTS)
    assert "seq_lengths" not in trainer.eval_dataset.column_names
    assert len(trainer.eval_dataset) == len(TEST_PROMPTS)


def _tokenized(models):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2"])
    rows = []
    for prompt, answer in itertools.pairwise(PROMPTS):
        context, target = tokenizer(prompt)["input_ids"], tokenizer(f" {answer}.")["input_ids"]
        rows.append({"input_ids": context + target, "labels": [-100] * len(context) + target})
    return Dataset.from_list(rows)


def test_sft_skip_prepare_dataset_trains_on_the_rows_as_given(lib, models, tmp_path):
    dataset = _tokenized(models)
    trainer = lib.SFTTrainer(model=models["qwen2"],
                             args=sft_args(lib, tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                             train_dataset=dataset)
    assert trainer.train_dataset.column_names == dataset.column_names  # not prepared: no EOS, no truncation
    assert trainer.train_dataset.to_dict()["input_ids"] == dataset.to_dict()["input_ids"]
    before = snapshot(trainer)
    trainer.train()
    assert_trained_but_unrouted(trainer, before)


def test_sft_skip_prepare_dataset_with_masks_but_no_labels_raises(lib, models, tmp_path):
    from datasets import Dataset

    dataset = Dataset.from_list([{"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 0, 1, 1]} for _ in range(2)])
    with pytest.raises(ValueError, match="Add a 'labels' column"):
        lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                       train_dataset=dataset)


TEMPLATE = ("{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_sft_chat_template_path_takes_a_template_file(lib, models, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, chat_template_path=str(path)),
                             train_dataset=sft_dataset("conversational_language_modeling"))
    assert trainer.processing_class.chat_template == TEMPLATE
    before = snapshot(trainer)
    trainer.train()
    assert_trained_but_unrouted(trainer, before)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == TEMPLATE


def test_sft_chat_template_path_clones_a_tokenizer(lib, models, tmp_path):
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(models["qwen2"])
    source.chat_template = TEMPLATE.replace("\n", "<|turn_end|>")
    source.add_special_tokens({"eos_token": "<|turn_end|>"})
    source.save_pretrained(tmp_path / "source")
    trainer = lib.SFTTrainer(model=models["qwen2"],
                             args=sft_args(lib, tmp_path, chat_template_path=str(tmp_path / "source")),
                             train_dataset=sft_dataset("conversational_language_modeling"))
    tokenizer = trainer.processing_class
    assert tokenizer.chat_template == source.chat_template and tokenizer.eos_token == "<|turn_end|>"
    rows = trainer.model.get_input_embeddings().weight.shape[0]
    assert rows % 64 == 0 and rows == len(tokenizer.vocab)  # grown to a multiple of 64, every row named
    before = snapshot(trainer)
    trainer.train()
    assert_trained_but_unrouted(trainer, before)


def test_sft_moe_without_a_router_coefficient_trains_without_aux_loss(lib, models, tmp_path):  # Glm4Moe
    trainer = lib.SFTTrainer(model=models["glm4_moe"], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"))
    assert trainer.aux_loss_enabled is False  # the config's own coefficient: absent, so 0
    before = snapshot(trainer)
    trainer.train()
    assert_trained_but_unrouted(trainer, before)


def test_sft_router_aux_loss_coef_on_a_dense_model_raises(lib, models, tmp_path):
    with pytest.raises(ValueError, match="not a Mixture-of-Experts model"):
        lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, router_aux_loss_coef=0.01),
                       train_dataset=sft_dataset("language_modeling"))


def test_hasten_sft_core_on_glm4_moe_adds_no_router_term_and_says_so(models):
    """`hasten sft`'s default sft.router_aux_loss_coef (0.001) on a model that has no router loss: the step
    runs (it multiplied by None before), logs no aux_loss, and one line says the coefficient adds nothing."""
    from transformers import AutoModelForCausalLM

    from hasten.config import load_config
    from hasten.rft.batches import Example
    from hasten.rft.sft import SFTJob

    cfg = load_config(None, [("sft.packing", False), ("sft.batch_size", 2)], profile=None)
    assert cfg.sft.router_aux_loss_coef > 0
    lines: list[str] = []
    model = AutoModelForCausalLM.from_pretrained(models["glm4_moe"])
    job = SFTJob(model, [Example([5, 6, 7], [8, 9]), Example([5, 9], [6, 7, 8])], cfg, 0, lines.append)
    record = job.step(1)
    assert record["loss"] > 0 and "aux_loss" not in record
    assert any("declares no router load-balancing loss" in line for line in lines)


def _prompt_config(kind: str, hidden_size: int):
    from peft import (
        PrefixTuningConfig,
        PromptEncoderConfig,
        PromptTuningConfig,
        TaskType,
    )

    if kind == "prompt_tuning":
        return PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    if kind == "prefix_tuning":
        return PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4)
    return PromptEncoderConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4, encoder_hidden_size=hidden_size)


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning", "prompt_encoder"])
def test_sft_peft_prompt_learning_trains_only_the_virtual_tokens(lib, models, tmp_path, kind):
    # TRL's test_train_with_peft_config_prompt_tuning[*]
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, gradient_checkpointing=False),
                             train_dataset=sft_dataset("language_modeling"), peft_config=_prompt_config(kind, 32))
    before = snapshot(trainer)
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["mean_token_accuracy"] is not None  # TRL's test_prompt_tuning reads it
    for name, value in before.items():
        changed = not torch.equal(value, trainer.model.get_parameter(name))
        assert changed == ("base_model" not in name), f"{name}: changed={changed}"


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning"])
def test_hasten_prompt_learning_loss_is_the_peft_models_own(models, tmp_path, kind):
    """The padded pass and the eval loss read the logits of the inputs, after the virtual tokens' (prompt
    tuning returns those first): the loss equals peft's own forward given the labels."""
    from hasten.api import SFTConfig, SFTTrainer

    rows = [{"prompt": "Beautiful is", "completion": " better than ugly."}]
    trainer = SFTTrainer(model=models["qwen2"], args=SFTConfig(output_dir=str(tmp_path / "out"), report_to="none"),
                         train_dataset=rows, peft_config=_prompt_config(kind, 32), log=lambda line: None)
    assert trainer.config.sft.packing is False  # the virtual tokens come from peft's forward: padded batches
    example = trainer.examples[0]
    ids = torch.tensor([example.prompt_ids + example.completion_ids])
    labels = ids.clone()
    labels[0, :len(example.prompt_ids)] = -100
    with torch.no_grad():
        expected = float(trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss)
    assert trainer.evaluate(eval_dataset=rows)["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_sft_vision_dataset_with_text_model_raises(lib, models, tmp_path):  # TRL's test of the same name
    from datasets import Dataset
    from PIL import Image

    image = Image.new("RGB", (8, 8))
    dataset = Dataset.from_dict({"messages": [[{"role": "user", "content": "What is shown?"},
                                               {"role": "assistant", "content": "A square."}]] * 2,
                                 "images": [[image], [image]]})
    with pytest.raises(ValueError, match="vision-related.*vision-language model"):
        lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path), train_dataset=dataset)
