"""The real default model: conversion from the packaged GGUF, and two GRPO steps
of SmolLM2-135M through the CLI with a complete run directory.

This is the one test that loads real weights (~30 s the first time, while the
GGUF is converted into $HASTEN_CACHE; seconds afterwards).
"""

from __future__ import annotations

import json

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
