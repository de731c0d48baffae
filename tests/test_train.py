"""End to end on the tiny model: learning happens, every loss/option path runs,
the run directory is complete, and `hasten eval` loads the checkpoint."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path

import pytest
import torch

from hasten.cli import main
from hasten.config import load_config
from hasten.train.trainer import train

LETTERS_REWARD = '''
def letters(prompts, completions, **kwargs):
    """Fraction of lowercase letters: ~10% for a random byte model, learnable."""
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
'''

RAISING_REWARD = '''
def fragile(prompts, completions, bad, **kwargs):
    out = []
    for is_bad in bad:
        if is_bad:
            raise ValueError("cannot score this one")
        out.append(0.0)
    return out
'''


@pytest.fixture
def data(tmp_path):
    rows = [{"prompt": f"write letters {i}:", "answer": "abc"} for i in range(40)]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(LETTERS_REWARD + RAISING_REWARD)
    return tmp_path


def tiny_config(data, **overrides):
    pairs = {
        "model.name": "tiny", "task.name": "jsonl", "task.path": str(data / "data.jsonl"),
        "rewards.extra": [f"{data / 'rewards.py'}:letters"], "train.steps": 2, "train.prompts_per_step": 2,
        "generation.num_generations": 4, "generation.max_new_tokens": 8, "eval.num_examples": 4,
        "eval.max_new_tokens": 8, "output.dir": str(data / "runs"), "output.progress": "off",
    }
    pairs.update(overrides)
    return load_config(overrides=list(pairs.items()))


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])  # fused CPU AdamW leaves _version alone
def test_mean_reward_rises_on_a_learnable_reward(data, optimizer):
    cfg = tiny_config(data, **{"train.steps": 40, "train.lr": 3e-3, "train.prompts_per_step": 4,
                               "generation.max_new_tokens": 12, "eval.num_examples": 0, "output.plot": False,
                               "speed.optimizer": optimizer})
    summary = train(cfg, log=lambda text: None)
    rewards = [json.loads(line)["reward_mean"] for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.2, first  # the random model writes few lowercase letters
    assert last > first + 0.25, (first, last)


def test_run_directory_is_complete(data):
    summary = train(tiny_config(data, **{"output.save_every": 1, "eval.every": 1}), log=lambda text: None)
    run = data / "runs" / summary["run_dir"].split("/")[-1]
    for name in ("config.yaml", "metrics.jsonl", "eval.jsonl", "summary.json", "progress.png",
                 "checkpoint/config.json", "checkpoint/model.safetensors", "checkpoint/tokenizer.json",
                 "checkpoint-1/model.safetensors", "samples/eval-step0.jsonl"):
        assert (run / name).exists(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward_mean", "reward_std", "rewards/letters", "rewards/letters/std", "zero_variance_groups", "completion_length",
                "loss", "entropy", "lr", "grad_norm", "time/generate", "time/reward", "time/learn",
                "tokens_per_second"):
        assert key in records[0], key
    evals = [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 1, 2]
    # Peak memory so far, per step: never falling, in MiB (not KiB or bytes), and this process's own peak.
    peaks = [r["memory/peak_mib"] for r in records]
    assert peaks == sorted(peaks), peaks
    resident_mib = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20
    assert resident_mib * 0.5 < peaks[-1] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, (
        peaks, resident_mib)


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dr_grpo", "dapo", "gspo"])
def test_every_loss_trains(data, loss):
    """Each loss gives finite losses and gradients, and moves the weights away from the tiny model's."""
    from safetensors.torch import load_file

    from hasten.models.tiny import tiny_model, tiny_tokenizer

    cfg = tiny_config(data, **{"algo.loss": loss, "eval.num_examples": 0, "output.plot": False})
    summary = train(cfg, log=lambda text: None)
    records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
    trained = load_file(f"{summary['run_dir']}/checkpoint/model.safetensors")
    initial = tiny_model(len(tiny_tokenizer())).state_dict()  # fixed seed: the weights the run started from
    assert all(torch.isfinite(tensor).all() for tensor in trained.values())
    moved = [name for name, tensor in trained.items() if not torch.equal(tensor, initial[name])]
    assert "model.layers.0.self_attn.q_proj.weight" in moved and len(moved) > len(trained) // 2, moved


@pytest.mark.parametrize("lora", [False, True])
def test_kl_reference_and_multiple_iterations(data, lora):
    cfg = tiny_config(data, **{"algo.beta": 0.1, "algo.num_iterations": 2, "model.lora": lora,
                               "model.lora_r": 4, "train.gradient_accumulation_steps": 2,
                               "eval.num_examples": 0, "output.plot": False})
    summary = train(cfg, log=lambda text: None)
    records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert all("kl" in r and r["kl"] >= 0 for r in records)
    if lora:  # the checkpoint holds the adapter only
        assert (data / "runs" / summary["run_dir"].split("/")[-1] / "checkpoint" / "adapter_config.json").exists()


def test_cli_train_then_eval_the_checkpoint(data, capsys):
    code = main(["train", "--model", "tiny", "--task", "arithmetic", "--steps", "1",
                 "--train.prompts_per_step=2", "--generation.num_generations=2", "--generation.max_new_tokens=4",
                 "--eval.num_examples=2", "--eval.max_new_tokens=4", f"--output.dir={data}/runs",
                 "--output.progress=off", "--output.name=cli"])
    assert code == 0
    out = capsys.readouterr().out
    assert "held-out accuracy: before" in out
    code = main(["eval", "--model", f"{data}/runs/cli/checkpoint", "--task", "arithmetic", "--num-examples", "3",
                 "--eval.max_new_tokens=4", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_examples"] == 3 and 0 <= result["accuracy"] <= 1


def test_a_raising_reward_stops_the_run_naming_function_and_sample(data, capsys):
    # Two rows, the second one bad; one step samples both: 4 samples per row, group-major.
    rows = [{"prompt": "fine", "bad": False}, {"prompt": "broken", "bad": True}]
    (data / "two.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    code = main(["train", "--model", "tiny", "--task", "jsonl", f"--task.path={data}/two.jsonl",
                 f"--task.eval_path={data}/two.jsonl",
                 "--reward", f"{data}/rewards.py:fragile", "--steps", "1", "--train.prompts_per_step=2",
                 "--generation.num_generations=4", "--generation.max_new_tokens=4", "--eval.num_examples=0",
                 f"--output.dir={data}/runs", "--output.progress=off"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # The first sample of the bad row's group: index 0 or 4 depending on the shuffle.
    assert err.startswith("reward error: function 'fragile' failed on sample ")
    assert err.endswith(": ValueError: cannot score this one")
    index = int(err.split("failed on sample ")[1].split(" ")[0])
    assert ' (prompt "' in err  # and the start of its prompt
    assert index in (0, 4)


def test_jsonl_task_without_rewards_is_a_config_error(data, capsys):
    code = main(["train", "--model", "tiny", "--task", "jsonl", f"--task.path={data}/data.jsonl",
                 f"--output.dir={data}/runs"])
    assert code == 2
    assert "config error: no reward functions" in capsys.readouterr().err
    assert not (data / "runs").exists()


def test_lora_checkpoint_evaluates_through_the_cli(data, capsys):
    code = main(["train", "--model", "tiny", "--task", "arithmetic", "--steps", "1", "--model.lora=true",
                 "--model.lora_r=4", "--train.prompts_per_step=2", "--generation.num_generations=2",
                 "--generation.max_new_tokens=4", "--eval.num_examples=0", f"--output.dir={data}/runs",
                 "--output.progress=off", "--output.name=lora"])
    assert code == 0
    checkpoint = data / "runs" / "lora" / "checkpoint"
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "model.safetensors").exists()
    adapter = json.loads((checkpoint / "adapter_config.json").read_text())
    assert (Path(adapter["base_model_name_or_path"]) / "config.json").is_file()  # a directory peft can load
    assert json.loads((checkpoint / "hasten_base.json").read_text()) == {"name": "tiny"}
    from peft import AutoPeftModelForCausalLM

    loaded = AutoPeftModelForCausalLM.from_pretrained(str(checkpoint))
    assert hasattr(loaded, "peft_config")
    # On a machine without that cache path, hasten still finds the base through hasten_base.json.
    adapter["base_model_name_or_path"] = "/nowhere/tiny"
    (checkpoint / "adapter_config.json").write_text(json.dumps(adapter))
    capsys.readouterr()
    code = main(["eval", "--model", str(checkpoint), "--task", "arithmetic", "--num-examples", "2",
                 "--eval.max_new_tokens=4", "--json"])
    assert code == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["num_examples"] == 2
