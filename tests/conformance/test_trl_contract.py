"""What TRL main's own test files check that hasten lacked until dev/trl_conformance ran them.

dev/trl_conformance/run.py runs huggingface/trl's tests/test_grpo_trainer.py and
tests/test_sft_trainer.py (main at f2cd57710) against TRL and against hasten; it needs a TRL checkout,
so `make test` cannot run it. Each behaviour it found missing and hasten now has is checked here, on
the suite's tiny local models, against both libraries by the `lib` switch (conftest.py), so that
`make test` guards it offline. Written anew from what those tests assert, not copied.
"""

from __future__ import annotations

from unittest.mock import Mock

import pytest
import torch

from .conftest import prompt_dataset, sft_dataset, unsupported_on_hasten
from .test_trl_conformance import grpo_args, sft_args, snapshot, varied_reward

LOGGERS = {"trl": "trl.trainer.grpo_trainer", "hasten": "hasten.api.grpo_trainer"}


# ------------------------------------------------------------------ GRPO: construction


def test_no_reward_source_raises(lib, models, tmp_path):
    with pytest.raises(ValueError, match="No reward source provided"):
        lib.GRPOTrainer(model=models["qwen2"], args=grpo_args(lib, tmp_path), train_dataset=prompt_dataset())


def test_dataset_required_without_environment(lib, models, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, args=grpo_args(lib, tmp_path))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sequence_level_with_token_summed_loss_warns(lib, models, tmp_path, caplog, loss_type):
    with caplog.at_level("WARNING", logger=LOGGERS[lib.name]):
        lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                        args=grpo_args(lib, tmp_path, importance_sampling_level="sequence", loss_type=loss_type))
    assert ("weights each sequence by its completion length" in caplog.text) == (loss_type != "grpo")


def test_trainer_exposes_names_tags_and_entropy_coef(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                              args=grpo_args(lib, tmp_path, entropy_coef=0.01))
    assert trainer.reward_func_names == ["varied_reward"]
    assert {"trl", "grpo"} <= set(trainer.model.model_tags)
    assert trainer.entropy_coef == 0.01
    assert trainer.aux_loss_enabled is False  # a dense model


# ------------------------------------------------------------------ GRPO: the masks TRL's tests call


def _entropy_mask(lib, entropies, mask, threshold):
    trainer = Mock(spec=lib.GRPOTrainer)  # TRL's method reads its accelerator; hasten's needs nothing
    trainer.accelerator = Mock(num_processes=1, gather=lambda x: x, pad_across_processes=lambda x, dim, pad_index: x)
    return lib.GRPOTrainer.get_high_entropy_mask(trainer, entropies, mask, threshold)


@pytest.mark.parametrize("threshold, expected", [
    (0.8, [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]]),  # the top 20% of the 10 unpadded tokens
    (0.5, [[0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 0, 0]]),
    (0.0, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
    (1.0, [[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0]]),  # only the highest unpadded entropy
])
def test_get_high_entropy_mask(lib, threshold, expected):
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    found = _entropy_mask(lib, entropies, mask, threshold)
    torch.testing.assert_close(found, torch.tensor(expected, dtype=torch.bool))
    assert not _entropy_mask(lib, entropies, torch.zeros_like(mask), 0.5).any()


def test_get_off_policy_mask(lib):
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    sampling = torch.zeros(3, 4)
    # mean KL over unpadded tokens: 2 (kept: positive advantage), 0.5 (kept: low KL), 2 (dropped)
    logps = torch.tensor([[-2.0] * 4, [-0.5] * 4, [-2.0, -2.0, -1e4, 1e4]])
    found = lib.GRPOTrainer.get_off_policy_mask(advantages, logps, sampling, mask, 1.0)
    torch.testing.assert_close(found, torch.tensor([[1.0], [1.0], [0.0]]))


# ------------------------------------------------------------------ GRPO: the MoE auxiliary loss


def test_moe_router_aux_loss(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen3_moe"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                              args=grpo_args(lib, tmp_path))
    assert trainer.aux_loss_enabled is True  # TRL's test: a MoE config (output_router_logits) and coef 0.001
    trainer.train()
    assert trainer.state.log_history[-1]["aux_loss"] > 0  # the load-balancing loss, logged as TRL logs it


def test_moe_router_aux_loss_off_with_zero_coef(lib, models, tmp_path):
    trainer = lib.GRPOTrainer(model=models["qwen3_moe"], reward_funcs=varied_reward, train_dataset=prompt_dataset(),
                              args=grpo_args(lib, tmp_path, router_aux_loss_coef=0.0))
    assert trainer.aux_loss_enabled is False


# ------------------------------------------------------------------ SFT


def test_sft_train_dataset_required(lib, models, tmp_path):
    with pytest.raises(ValueError, match="train_dataset"):
        lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path))


def test_sft_with_transform_dataset_raises(lib, models, tmp_path):
    from datasets import Dataset

    dataset = Dataset.from_dict({"text": ["hello world"]}).with_transform(lambda batch: batch)
    with pytest.raises(ValueError, match=r"Dataset\.with_transform\(\).*skip_prepare_dataset"):
        lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path), train_dataset=dataset)


def test_sft_tags_the_model(lib, models, tmp_path):
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"))
    assert {"trl", "sft"} <= set(trainer.model.model_tags)


@pytest.mark.parametrize("rows, max_length, labels", [
    # mask columns become labels (-100 off the mask)
    ([{"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 0, 1, 1]},
      {"input_ids": [5, 6, 7], "assistant_masks": [0, 1, 0]}], None, [[-100, -100, 3, 4], [-100, 6, -100]]),
    # a labels column is taken as given
    ([{"input_ids": [1, 2, 3, 4], "labels": [1, -100, 3, -100]}], None, [[1, -100, 3, -100]]),
    # cut to max_length first; an example left with no target is dropped
    ([{"input_ids": [1, 2, 3, 4, 5], "assistant_masks": [0, 0, 0, 1, 1]},
      {"input_ids": [6, 7, 8], "assistant_masks": [1, 1, 1]}], 3, [[6, 7, 8]]),
])
def test_sft_prepared_dataset_has_labels(lib, models, tmp_path, rows, max_length, labels):
    from datasets import Dataset

    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, max_length=max_length),
                             train_dataset=Dataset.from_list(rows))
    assert trainer.train_dataset[:]["labels"] == labels


def test_sft_prepared_completion_only_labels(lib, models, tmp_path):
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("prompt_completion"))
    for example in trainer.train_dataset:
        labels, input_ids = example["labels"], example["input_ids"]
        assert len(labels) == len(input_ids) and labels[0] == -100 and labels[-1] == input_ids[-1]
        assert all(label in (-100, token) for label, token in zip(labels, input_ids))


@pytest.mark.parametrize("shape", ["dataset", "dict"])
def test_sft_evaluate_and_prepared_eval_dataset(lib, models, tmp_path, shape):
    from datasets import Dataset

    split = Dataset.from_dict({"text": ["Errors should never pass silently.", "Unless explicitly silenced."]})
    eval_dataset = split if shape == "dataset" else {"data1": split, "data2": split}
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"), eval_dataset=eval_dataset)
    if shape == "dataset":
        assert "input_ids" in next(iter(trainer.eval_dataset))
    else:
        assert set(trainer.eval_dataset) == {"data1", "data2"}
    metrics = trainer.evaluate()
    keys = ["eval_loss"] if shape == "dataset" else ["eval_data1_loss", "eval_data2_loss"]
    for key in keys:
        assert metrics[key] > 0
        assert [entry[key] for entry in trainer.state.log_history if key in entry] == [metrics[key]]
    if shape == "dataset":
        assert 0 <= metrics["eval_mean_token_accuracy"] <= 1 and metrics["eval_entropy"] > 0
    before = snapshot(trainer)
    assert all(torch.equal(value, trainer.model.get_parameter(name)) for name, value in before.items())


@pytest.mark.parametrize("model, enabled", [("qwen3_moe", True), ("qwen2", False)])
def test_sft_moe_router_aux_loss(lib, models, tmp_path, model, enabled):
    trainer = lib.SFTTrainer(model=models[model], args=sft_args(lib, tmp_path),
                             train_dataset=sft_dataset("language_modeling"))
    assert trainer.aux_loss_enabled is enabled
    before = snapshot(trainer)
    trainer.train()
    assert all(not torch.equal(value, trainer.model.get_parameter(name)) for name, value in before.items())
    if enabled:
        assert trainer.state.log_history[-1]["aux_loss"] > 0


def test_sft_formatting_func(lib, models, tmp_path):
    from datasets import Dataset

    rows = Dataset.from_dict({"chosen": ["Simple is better.", "Flat is better."], "rejected": ["Complex.", "Nested."]})
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path), train_dataset=rows,
                             formatting_func=lambda row: f"### Chosen: {row['chosen']}\n### Rejected: {row['rejected']}")
    text = trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"])
    assert text.startswith("### Chosen: Simple is better.\n### Rejected: Complex.")
    before = snapshot(trainer)
    trainer.train()
    assert all(not torch.equal(value, trainer.model.get_parameter(name)) for name, value in before.items())


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_sft_gradient_checkpointing_use_reentrant(lib, models, tmp_path, use_reentrant):
    trainer = lib.SFTTrainer(model=models["qwen2"], train_dataset=sft_dataset("language_modeling"),
                             args=sft_args(lib, tmp_path, gradient_checkpointing=True,
                                           gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}))
    before = snapshot(trainer)
    trainer.train()
    assert all(not torch.equal(value, trainer.model.get_parameter(name)) for name, value in before.items())


def test_sft_row_chat_template_kwargs(lib, models, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2"])
    tokenizer.chat_template = ("{% for m in messages %}{{ (m.role.upper() if shout else m.role) + ': ' + m.content "
                               "+ '\n' }}{% endfor %}")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rows = Dataset.from_dict({"messages": [messages, messages],
                              "chat_template_kwargs": [{"shout": False}, {"shout": True}]})
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path), train_dataset=rows,
                             processing_class=tokenizer)
    texts = [tokenizer.decode(row["input_ids"]) for row in trainer.train_dataset]
    assert texts[0].startswith("user: Hi") and texts[1].startswith("USER: Hi")


def test_iterable_dataset_forces_num_workers_zero(lib, models, tmp_path):
    stream = prompt_dataset().to_iterable_dataset()
    trainer = lib.GRPOTrainer(model=models["qwen2"], reward_funcs=varied_reward, train_dataset=stream,
                              args=grpo_args(lib, tmp_path, dataloader_num_workers=4))
    assert trainer.args.dataloader_num_workers == 0


def test_sft_prompt_tuning_peft_model_trains_its_virtual_tokens(lib, models, tmp_path):
    from peft import PromptTuningConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(models["qwen2"]),
                           PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    trainer = lib.SFTTrainer(model=model, args=sft_args(lib, tmp_path), train_dataset=sft_dataset("language_modeling"))
    before = {name: value.detach().clone() for name, value in trainer.model.named_parameters()}
    trainer.train()
    for name, value in before.items():
        changed = not torch.equal(value, trainer.model.get_parameter(name))
        assert changed == ("prompt_encoder" in name), f"{name}: changed={changed}"


TRAINING_CHATML = (  # ChatML with the assistant turns marked, as TRL's training templates mark them
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}{{ m['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\n' }}{% endfor %}")


def test_sft_assistant_only_loss_labels(lib, models, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["qwen2"])
    tokenizer.chat_template = TRAINING_CHATML
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, assistant_only_loss=True),
                             train_dataset=sft_dataset("conversational_language_modeling"), processing_class=tokenizer)
    for example in trainer.train_dataset:
        labels, input_ids = example["labels"], example["input_ids"]
        assert len(labels) == len(input_ids)
        assert all(label in (-100, token) for label, token in zip(labels, input_ids))
        learned = tokenizer.decode([label for label in labels if label != -100])
        assert "user" not in learned and learned.strip()  # the assistant's reply (and its turn end) only
    before = snapshot(trainer)
    trainer.train()
    assert all(not torch.equal(value, trainer.model.get_parameter(name)) for name, value in before.items())


def test_sft_takes_training_arguments(lib, models, tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "ta"), report_to="none", num_train_epochs=1,
                             learning_rate=0.1, **lib.machine)
    trainer = lib.SFTTrainer(model=models["qwen2"], args=args, train_dataset=sft_dataset("language_modeling"))
    assert trainer.args.learning_rate == 0.1 and trainer.args.output_dir == str(tmp_path / "ta")


def test_sft_padding_free_without_packing_needs_no_max_length(lib, models, tmp_path):
    with pytest.raises(ValueError, match="`max_length` is not enforced"):
        lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, padding_free=True, max_length=16),
                       train_dataset=sft_dataset("language_modeling"))


def test_sft_dft_loss(lib, models, tmp_path):
    trainer = lib.SFTTrainer(model=models["qwen2"], args=sft_args(lib, tmp_path, loss_type="dft"),
                             train_dataset=sft_dataset("language_modeling"))
    before = snapshot(trainer)
    trainer.train()
    assert all(not torch.equal(value, trainer.model.get_parameter(name)) for name, value in before.items())


def test_dft_token_loss_is_probability_weighted_nll():
    """TRL's TestDFTLoss case: two equally likely tokens, so each target's loss is its nll x 0.5."""
    from hasten.rft.batches import _token_loss_sum

    logits = torch.zeros(4, 2, requires_grad=True)
    targets = torch.tensor([1, 0, 0, -100])
    nll = _token_loss_sum(logits, targets, dft=False)
    torch.testing.assert_close(_token_loss_sum(logits, targets, dft=True), nll / 2)
    torch.testing.assert_close(nll, torch.tensor(3 * 0.6931472))


def test_sft_compute_metrics_and_best_metric(lib, models, tmp_path):
    from datasets import Dataset

    seen = {}

    def metrics(prediction):
        seen["shapes"] = prediction.predictions.shape, prediction.label_ids.shape
        return {"my_metric": 0.123}

    eval_rows = Dataset.from_dict({"text": ["Errors should never pass silently.", "Unless explicitly silenced."]})
    trainer = lib.SFTTrainer(model=models["qwen2"], train_dataset=sft_dataset("language_modeling"),
                             eval_dataset=eval_rows, compute_metrics=metrics,
                             args=sft_args(lib, tmp_path, eval_strategy="steps", eval_steps=1,
                                           metric_for_best_model="eval_mean_token_accuracy"))
    trainer.train()
    evals = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert evals and all(entry["eval_my_metric"] == 0.123 for entry in evals)
    (logits, labels) = seen["shapes"]
    assert logits[:2] == labels and logits[0] == 2  # (N, L, V) and (N, L)
    assert trainer.state.best_metric == max(entry["eval_mean_token_accuracy"] for entry in evals)
