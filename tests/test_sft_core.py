"""One SFT behind `hasten sft` and SFTTrainer: the same data gives the same examples, and the API's eval
loss is the loss the shared loop (rft/sft.py's SFTJob) trains on."""

from __future__ import annotations

import pytest

from hasten.api import SFTConfig, SFTTrainer
from hasten.config import TaskConfig
from hasten.models.tiny import tiny_model
from hasten.rft.batches import eval_loss
from hasten.rft.data import RFTRecord
from hasten.rft.examples import labelled_example, record_examples
from hasten.rft.prompts import PromptFormat
from hasten.rft.sft import SFTJob
from hasten.tasks import make_task


def records_and_rows():
    """RFT records of a chat-prompt task, and the same data as TRL prompt-completion rows."""
    task = make_task(TaskConfig(num_train=4, num_eval=2))
    prompt_format = PromptFormat(task)
    records = [RFTRecord(row["question"], row["answer"], f"<answer>{row['answer']:g}</answer>")
               for row in task.train_rows]
    rows = [{"prompt": prompt_format(record.question), "completion": record.reasoning} for record in records]
    return records, prompt_format, rows


@pytest.mark.parametrize("packing", [False, True])
def test_cli_records_and_api_rows_train_the_same_examples_and_loss(tmp_path, tokenizer, packing):
    records, prompt_format, rows = records_and_rows()
    cli = record_examples(records, prompt_format, tokenizer, tokenizer.eos_token_id)
    assert all(example.target_mask is None and example.completion_ids[-1] == tokenizer.eos_token_id
               for example in cli)
    args = SFTConfig(output_dir=str(tmp_path / "sft"), num_train_epochs=1, per_device_train_batch_size=len(rows),
                     per_device_eval_batch_size=3, max_length=2048, packing=packing)
    trainer = SFTTrainer(model=tiny_model(len(tokenizer)), processing_class=tokenizer, args=args,
                         train_dataset=rows, log=lambda line: None)
    assert trainer.examples == cli  # the API's rows are the CLI's records, token for token

    api_loss = trainer.evaluate(eval_dataset=rows)["eval_loss"]
    core = eval_loss(trainer.model, cli, trainer.policy.pad_token_id, batch_size=len(cli)).means()
    assert api_loss == pytest.approx(core["loss"], rel=1e-6)
    # the loop's first step (one batch of every example, before its update) takes the same loss
    job = SFTJob(trainer.model, cli, trainer.config, trainer.policy.pad_token_id, lambda line: None)
    record = job.step(1)
    assert record["loss"] == pytest.approx(api_loss, rel=1e-4)
    assert record["mean_token_accuracy"] == pytest.approx(core["mean_token_accuracy"])  # TRL's training metric
    job.close()


def test_labelled_example_keeps_context_inside_the_targets():
    example = labelled_example([5, 6, 7, 8, 9], [-100, -100, 7, -100, 9])
    assert (example.prompt_ids, example.completion_ids, example.target_mask) == ([5, 6], [7, 8, 9], (1, 0, 1))
    assert labelled_example([5, 6], [5, -100]) is None  # the first token is never a target: nothing predicts it


def test_api_steps_count_the_examples_wrapped_packing_makes(tmp_path, tokenizer):
    """packing_strategy="wrapped" turns 8 rows into more blocks: the run's steps (and warmup) follow them."""
    rows = [{"text": f"row {index}: " + "beautiful is better than ugly " * 3} for index in range(8)]
    args = SFTConfig(output_dir=str(tmp_path / "sft"), num_train_epochs=1, per_device_train_batch_size=4,
                     packing=True, packing_strategy="wrapped", max_length=16, warmup_steps=0.5)
    trainer = SFTTrainer(model=tiny_model(len(tokenizer)), processing_class=tokenizer, args=args, train_dataset=rows,
                         log=lambda line: None)
    blocks = len(trainer.examples)
    assert blocks > len(rows)
    assert trainer.state.max_steps == -(-blocks // 4) and trainer.config.sft.warmup_steps == -(-trainer.state.max_steps // 2)
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps
