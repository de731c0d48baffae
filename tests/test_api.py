"""The Python API: a TRL script runs by changing its import line; GRPOConfig maps onto Config;
unsupported options are one clear error; callbacks, resume, LoRA and save_model behave as in TRL."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml

from hasten import GRPOConfig, GRPOTrainer
from hasten.api import APIError
from hasten.config import ConfigError

WORDS = ["cats", "dogs", "rain", "sun", "sea", "tea", "books", "code"]


def reward_len(completions, **kwargs):
    return [-abs(12 - len(completion)) for completion in completions]


def rows():
    return [{"prompt": f"Tell me about {word}:", "topic": word} for word in WORDS]


def quick_args(tmp_path, **more):
    settings = dict(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                    max_completion_length=8, logging_steps=1, disable_tqdm=True)
    settings.update(more)
    return GRPOConfig(**settings)


def test_trl_quickstart_runs_with_only_the_import_changed(tmp_path):
    """TRL's GRPO quickstart (dataset, reward function, GRPOConfig, GRPOTrainer, train) on the tiny model."""
    script = textwrap.dedent('''
        from datasets import Dataset
        from hasten import GRPOConfig, GRPOTrainer

        dataset = Dataset.from_list([{"prompt": f"Write about {w}:"} for w in ["cats", "dogs", "rain", "sun"]])

        # Dummy reward function: count the number of unique characters in the completions
        def reward_num_unique_chars(completions, **kwargs):
            return [len(set(c)) for c in completions]

        training_args = GRPOConfig(output_dir="tiny-GRPO", max_steps=2, per_device_train_batch_size=4,
                                   num_generations=2, max_completion_length=8)
        trainer = GRPOTrainer(
            model="tiny",
            reward_funcs=reward_num_unique_chars,
            args=training_args,
            train_dataset=dataset,
        )
        trainer.train()
        ''')
    pytest.importorskip("datasets")
    (tmp_path / "quickstart.py").write_text(script)
    done = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((tmp_path / "tiny-GRPO" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2
    assert (tmp_path / "tiny-GRPO" / "checkpoint" / "model.safetensors").is_file()


def test_trainer_trains_the_model_in_place_and_keeps_trl_state(tmp_path):
    from hasten.models.tiny import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=quick_args(tmp_path, learning_rate=1e-3),
                          train_dataset=rows(), processing_class=tokenizer)
    assert trainer.model is model
    output = trainer.train()
    assert output.global_step == 2 and trainer.state.global_step == 2
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert changed, "training must update the model the user passed in"
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2]
    assert {"reward", "reward_std", "rewards/reward_len/mean", "learning_rate", "completions/mean_length"} <= set(logs[0])
    saved = trainer.save_model(str(tmp_path / "saved"))
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer_config.json").is_file()


def test_config_yaml_records_the_mapping_with_trl_defaults(tmp_path):
    trainer = GRPOTrainer(model="tiny", reward_funcs=[reward_len, "hasten.rewards.builtin:format_reward"],
                          args=quick_args(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4,
                                          warmup_ratio=0.5, reward_weights=[1.0, 0.5], min_p=0.1, beta=0.04,
                                          generation_kwargs={"stop_strings": ["\n"]}, speed={"engine": "hf"}),
                          train_dataset=rows())
    cfg = trainer.config
    assert cfg.train.prompts_per_step == 2  # 4 completions x 2 micro-batches / 4 generations
    assert cfg.train.gradient_accumulation_steps == 2 and cfg.train.steps == 2
    assert (cfg.train.adam_beta2, cfg.train.lr_schedule, cfg.train.warmup_from_zero) == (0.999, "linear", True)
    assert cfg.train.warmup_steps == 1 and cfg.train.seed == 42
    assert cfg.generation.min_p == 0.1 and cfg.generation.stop_strings == ["\n"] and cfg.algo.beta == 0.04
    assert cfg.speed.engine == "hf" and cfg.output.save_minutes == 0
    assert [f.name for f in trainer.session.rewards] == ["reward_len", "format_reward"]
    assert [f.weight for f in trainer.session.rewards] == [1.0, 0.5]
    trainer.train()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["adam_beta2"] == 0.999 and saved["generation"]["stop_strings"] == ["\n"]
    from hasten.train.progress_plot import TRAINING_PANELS

    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {key for key, _ in TRAINING_PANELS} <= set(record)  # every progress.png panel has data (beta > 0: KL)
    assert (tmp_path / "run" / "progress.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("fields, message", [
    ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2 is not supported by hasten"),
    ({"push_to_hub": True}, "push_to_hub=True is not supported"),
    ({"not_a_field": 1}, "not_a_field is not a GRPOConfig field"),
    ({"loss_type": "ppo"}, "loss_type='ppo' is not supported"),
    ({"importance_sampling_level": "tokens"}, "importance_sampling_level must be 'token' or 'sequence'"),
    ({"steps_per_generation": 2}, "steps_per_generation=2 with gradient_accumulation_steps=1 is not supported"),
    ({"per_device_train_batch_size": 6}, "generation_batch_size (6) must be divisible by num_generations (4)"),
    ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type='polynomial' is not supported"),
    ({"generation_kwargs": {"do_sample": False}}, "generation_kwargs do_sample=False is not supported"),
    ({"report_to": "neptune"}, "output.report_to must be a list of tensorboard"),
    ({"max_steps": 3, "num_iterations": 2}, "max_steps (3) must be a multiple of num_iterations (2)"),
])
def test_unsupported_options_are_one_error_naming_them(tmp_path, fields, message):
    with pytest.raises((APIError, ConfigError)) as error:
        GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path, **fields), train_dataset=rows())
    assert message in str(error.value) and "\n" not in str(error.value)


def test_trl_defaults_of_unsupported_fields_pass(tmp_path):
    args = quick_args(tmp_path, use_vllm=False, push_to_hub=False, vllm_mode="colocate", shuffle_dataset=True,
                      dataloader_num_workers=0, remove_unused_columns=False)
    assert args.max_steps == 2


def test_trainer_argument_errors(tmp_path):
    args = quick_args(tmp_path)
    with pytest.raises(APIError, match="'no-such-reward' is neither a model directory nor"):
        GRPOTrainer(model="tiny", reward_funcs="no-such-reward", args=args, train_dataset=rows())
    with pytest.raises(APIError, match="quantization_config is not supported"):
        GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args, train_dataset=rows(), quantization_config=1)
    with pytest.raises(Exception, match="train_dataset row 2: missing 'prompt'"):
        GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args, train_dataset=[{"prompt": "a"}, {"q": "b"}])


def test_callbacks_hear_the_run_and_can_stop_it(tmp_path):
    from transformers import TrainerCallback

    events = []

    class Recorder(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            events.append("begin")

        def on_step_end(self, args, state, control, **kwargs):
            events.append(f"step{state.global_step}")
            if state.global_step == 2:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(f"log:{sorted(logs)[0]}")

        def on_save(self, args, state, control, **kwargs):
            events.append("save")

        def on_train_end(self, args, state, control, **kwargs):
            events.append("end")

    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path, max_steps=4),
                          train_dataset=rows(), callbacks=[Recorder])
    output = trainer.train()
    assert output.metrics["status"] == "stopped" and output.global_step == 2
    assert events[0] == "begin" and events[-1] == "end" and "save" in events
    assert [e for e in events if e.startswith("step")] == ["step1", "step2"]
    assert sum(e.startswith("log:") for e in events) == 3  # two windows, then transformers' summary entry
    assert "train_loss" in trainer.state.log_history[-1] and "train_runtime" in output.metrics


def test_a_callback_hook_hasten_never_calls_is_an_error(tmp_path):
    from transformers import TrainerCallback

    class EpochWatcher(TrainerCallback):
        def on_epoch_end(self, args, state, control, **kwargs):
            pass

    with pytest.raises(APIError, match="EpochWatcher.on_epoch_end is never called"):
        GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path), train_dataset=rows(),
                    callbacks=[EpochWatcher()])


def test_resume_from_checkpoint_continues_bit_identically(tmp_path):
    from transformers import TrainerCallback

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    whole = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path / "a", max_steps=3),
                        train_dataset=rows())
    whole.train()
    first = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path / "b", max_steps=3),
                        train_dataset=rows(), callbacks=[StopAtTwo()])
    assert first.train().metrics["status"] == "stopped"
    changed = GRPOTrainer(model="tiny", reward_funcs=reward_len,
                          args=quick_args(tmp_path / "b", max_steps=3, learning_rate=1e-3), train_dataset=rows())
    with pytest.raises(APIError, match="train.lr is 0.001 now but 1e-06"):
        changed.train(resume_from_checkpoint=str(tmp_path / "b" / "run"))
    second = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path / "b", max_steps=3),
                         train_dataset=rows())
    assert second.train(resume_from_checkpoint=True).metrics["status"] == "finished"
    for (name, a), (_, b) in zip(whole.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name
    assert (tmp_path / "a" / "run" / "metrics.jsonl").read_text().count("\n") == 3
    assert (tmp_path / "b" / "run" / "metrics.jsonl").read_text().count("\n") == 3


def test_a_rerun_writes_output_dir_and_keeps_the_earlier_run_beside_it(tmp_path):
    from transformers import AutoModelForCausalLM

    said = []
    first = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path, max_steps=1),
                        train_dataset=rows())
    first.train()
    again = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path, max_steps=1, seed=7,
                                                                               learning_rate=1e-2),
                        train_dataset=rows(), log=said.append)
    again.train()
    run, earlier = tmp_path / "run", tmp_path / "run.previous-1"
    assert again.run_dir == run and (earlier / "checkpoint").is_dir()  # TRL's output_dir; nothing deleted
    assert any(f"kept as {earlier}" in line for line in said)
    loaded = AutoModelForCausalLM.from_pretrained(run / "checkpoint")  # what a script loads afterwards
    trained, saved = dict(again.model.named_parameters()), dict(loaded.named_parameters())
    assert trained.keys() == saved.keys()
    for name, value in trained.items():
        assert torch.equal(value, saved[name]), name


def test_lora_through_peft_config(tmp_path):
    from peft import LoraConfig

    trainer = GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path, max_steps=1),
                          train_dataset=rows(), peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert hasattr(trainer.model, "peft_config") and trainer.config.model.lora_r == 4
    trainer.train()
    assert (tmp_path / "run" / "checkpoint" / "adapter_model.safetensors").is_file()


def test_reward_kwargs_and_completions_reach_the_logs(tmp_path):
    pytest.importorskip("tensorboardX")

    def judged(completions, trainer_state, log_metric, log_extra, **kwargs):
        log_metric("judge/calls", 1.0 + trainer_state.global_step)
        log_extra("judge_note", ["fine"] * len(completions))
        return [None if i % 4 == 0 else 1.0 for i in range(len(completions))]  # one unscorable per group

    trainer = GRPOTrainer(model="tiny", reward_funcs=judged, train_dataset=rows(),
                          args=quick_args(tmp_path, log_completions=True, report_to="tensorboard"))
    trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["judge/calls"] for r in records] == [1.0, 2.0]
    assert all(r["unscored_fraction"] == 0.25 for r in records)
    assert trainer.session.completions[0]["judge_note"] == "fine"
    tags = tensorboard_tags(tmp_path / "run" / "tensorboard")
    assert {"train/reward", "train/loss", "train/judge/calls", "completions/text_summary"} <= tags  # TRL names


def tensorboard_tags(directory) -> set[str]:
    """Every tag in the event files under `directory` (TFRecord framing, read without tensorboard)."""
    import struct

    from tensorboardX.proto import event_pb2

    tags = set()
    for path in directory.glob("events.out.tfevents.*"):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
            tags.update(value.tag for value in event.summary.value)
            offset += 12 + length + 4
    return tags


def test_import_hasten_stays_light():
    done = subprocess.run([sys.executable, "-c", "import sys, hasten; hasten.__version__; "
                           "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False"


def test_sft_trainer_prompt_completion_and_text_rows(tmp_path):
    from hasten import SFTConfig, SFTTrainer

    data = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(6)]
    args = SFTConfig(output_dir=str(tmp_path / "sft"), num_train_epochs=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, disable_tqdm=True)
    trainer = SFTTrainer(model="tiny", args=args, train_dataset=data)
    cfg = trainer.config
    assert (cfg.sft.batch_size, cfg.sft.gradient_accumulation_steps, cfg.sft.epochs) == (4, 2, 2)
    assert (cfg.sft.lr_schedule, cfg.sft.warmup_from_zero) == ("linear", True)
    output = trainer.train()
    assert output.metrics["status"] == "finished" and output.global_step == 4  # 2 epochs x ceil(6 / 4)
    assert len([e for e in trainer.state.log_history if "loss" in e]) == 4
    assert (tmp_path / "sft" / "checkpoint" / "model.safetensors").is_file()
    text = SFTTrainer(model="tiny", args=SFTConfig(output_dir=str(tmp_path / "lm"), num_train_epochs=1,
                                                   disable_tqdm=True),
                      train_dataset=[{"text": "hello world"}, {"text": "more text"}])
    assert text.train().metrics["status"] == "finished"
    # max_steps replaces num_train_epochs, as TRL: 5 steps of 4 from 6 rows run into a second pass
    longer = SFTTrainer(model="tiny", args=SFTConfig(output_dir=str(tmp_path / "x"), max_steps=5, num_train_epochs=1.5, logging_steps=1,
                                                     per_device_train_batch_size=4, disable_tqdm=True),
                        train_dataset=data)
    assert longer.train().global_step == 5
    assert len([e for e in longer.state.log_history if "loss" in e]) == 5


def test_sft_plan_with_max_steps_repeats_epochs_with_a_fresh_shuffle_each():
    from hasten.config_jobs import SFTConfig as Settings
    from hasten.rft.sft import plan_steps

    settings = Settings(batch_size=4, gradient_accumulation_steps=2, max_steps=5, seed=3)
    plan = plan_steps(6, settings)
    flat = [[index for micro in step for index in micro] for step in plan]
    assert [len(step) for step in flat] == [4, 2, 4, 2, 4]  # ceil(6 / 4) = 2 steps an epoch, the third cut short
    assert sorted(flat[0] + flat[1]) == sorted(flat[2] + flat[3]) == list(range(6))
    assert flat[0] + flat[1] != flat[2] + flat[3]  # a new order each epoch
    settings.max_steps = 0
    assert len(plan_steps(6, settings)) == 3 * 2  # sft.epochs (3)


def test_sft_iterable_dataset_reads_what_max_steps_needs(tmp_path):
    from datasets import Dataset

    from hasten import SFTConfig, SFTTrainer

    stream = Dataset.from_dict({"text": [f"row {i}" for i in range(100)]}).to_iterable_dataset()
    with pytest.raises(APIError, match="IterableDataset, which needs max_steps > 0"):
        SFTTrainer(model="tiny", args=SFTConfig(output_dir=str(tmp_path / "a")), train_dataset=stream)
    trainer = SFTTrainer(model="tiny", args=SFTConfig(output_dir=str(tmp_path / "b"), max_steps=2,
                                                      per_device_train_batch_size=3, disable_tqdm=True),
                         train_dataset=stream)
    assert len(trainer.examples) == 6  # 2 steps x 3 rows: the stream is not read to its end


def test_a_missing_tracker_package_is_one_error_before_anything_is_written(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.raises(ConfigError, match=r"output.report_to=wandb needs the wandb package \(pip install wandb\)"):
        GRPOTrainer(model="tiny", reward_funcs=reward_len, args=quick_args(tmp_path, report_to=["wandb"]),
                    train_dataset=rows())
    assert not (tmp_path / "run").exists()
