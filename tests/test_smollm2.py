"""The real default model: conversion from the packaged GGUF, and two GRPO steps
of SmolLM2-135M through the CLI with a complete run directory.

This is the one test file that loads real weights (~30 s the first time, while
the GGUF is converted into $HASTEN_CACHE; seconds afterwards); it is in the slow
tier (tests/conftest.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from hasten.cli import main
from hasten.models.smollm2 import converted_dir


def test_conversion_produces_a_plain_model_directory():
    directory = converted_dir(log=lambda text: None)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert (directory / "model.safetensors").stat().st_size > 500_000_000  # 135M fp32 parameters
    assert (directory / "tokenizer.json").is_file()


def test_failed_conversion_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """The conversion runs in a child process; when it fails the run says why in one line."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HASTEN_CACHE", str(blocker))  # the cache root is a file: nothing can be written
    code = main(["train", "--steps", "1", f"--output.dir={tmp_path / 'runs'}", "--output.progress=off"])
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the "converting ..." log line
    assert code == 2, error
    assert error.startswith("model error: converting SmolLM2-135M-Instruct.Q4_1.gguf") and "NotADirectoryError" in error
    assert not (tmp_path / "runs").exists()


def test_two_grpo_steps_through_the_cli(tmp_path, capsys):
    code = main([
        "train", "--model", "smollm2-135m", "--task", "unit-conversion", "--steps", "2",
        "--train.prompts_per_step=2", "--generation.num_generations=2", "--generation.max_new_tokens=8",
        "--eval.num_examples=2", "--eval.max_new_tokens=8", "--train.lr=1e-5",
        f"--output.dir={tmp_path}", "--output.name=smoke", "--output.progress=off",
    ])
    assert code == 0, capsys.readouterr().err
    run = tmp_path / "smoke"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["completion_length"] > 0 and r["loss"] == r["loss"] for r in records)
    for name in ("config.yaml", "eval.jsonl", "summary.json", "progress.png", "checkpoint/model.safetensors",
                 "checkpoint/config.json", "checkpoint/tokenizer.json"):
        assert (run / name).is_file(), name
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["eval_after"]) >= {"accuracy", "answer_rate", "reward_mean"}


def test_default_model_trains_without_importing_transformers(tmp_path):
    """(From test_native_llama.py: it needs the real model.) `hasten train` on SmolLM2 (one step, eval, checkpoint) never imports transformers or dynamo; the
    checkpoint it writes loads in transformers with the same logits as in the native model."""
    script = """
import json, sys
from hasten.cli import main
code = main(["train", "--model", "smollm2-135m", "--task", "arithmetic", "--steps", "1",
             "--train.prompts_per_step=1", "--generation.num_generations=2", "--generation.max_new_tokens=4",
             "--eval.num_examples=1", "--eval.max_new_tokens=4", "--output.dir=" + sys.argv[1],
             "--output.name=native", "--output.progress=off", "--output.plot=false"])
print(json.dumps({"code": code, "transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
                  "dynamo": "torch._dynamo" in sys.modules}))
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # Nor torch._dynamo (~1 s): torch.optim imports it on first use; kernels/adamw.py does not.
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"code": 0, "transformers": [], "dynamo": False}

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hasten.models.llama import NativeLlamaForCausalLM
    from hasten.models.tokenizer import FastTokenizer

    checkpoint = tmp_path / "native" / "checkpoint"
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    hf_tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    native = NativeLlamaForCausalLM.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert FastTokenizer(checkpoint).apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    ids = torch.tensor([hf_tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():  # transformers' own forward varied by up to 4e-3 between two calls in one process here
        expected, actual = hf_model(ids).logits, native(ids).logits
    assert torch.allclose(expected, actual, atol=1e-2) and torch.equal(expected.argmax(-1), actual.argmax(-1))
