"""train.distributed=fsdp (train/fsdp.py) and signals under torchrun.

Real torchrun processes on the CPU (gloo) with the tiny model: 2 FSDP ranks
learn what 1 process learns (losses and weights within 1e-5), an FSDP
checkpoint resumes under FSDP and in one process and loads in `hasten eval`,
and a torchrun run stopped by a signal (a scheduler's SIGTERM to torchrun, or
a Ctrl-C to the whole process group) saves, exits and resumes to the
uninterrupted run's result.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_distributed import ROOT, hasten, launch, records, weights

from hasten.cli import main
from hasten.config import ConfigError, load_config
from hasten.train import distributed, fsdp

FSDP = "--train.distributed=fsdp"


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert sorted(first) == sorted(second)
    return max(float((first[key] - second[key]).abs().max()) for key in first)


def test_what_does_not_run_sharded_is_one_config_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key, value, culprit in [("speed.engine", "hf", "speed.engine=hf"), ("model.lora", True, "model.lora"),
                                ("speed.token_budget", 64, "speed.token_budget"),
                                ("algo.async_steps", 1, "algo.async_steps")]:
        # config.validate_ranks: loading the config under torchrun already says so, before any work
        with pytest.raises(ConfigError, match=f"train.distributed=fsdp does not run with {culprit}"):
            load_config(overrides=[("train.distributed", "fsdp"), (key, value)])
    distributed.check_config(load_config(overrides=[("train.distributed", "ddp"), ("speed.engine", "hf")]))
    with pytest.raises(ConfigError, match="train.distributed must be one of ddp, fsdp"):
        load_config(overrides=[("train.distributed", "zero3")])
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: nothing to shard, the switch is inert
    assert not fsdp.wanted(load_config(overrides=[("train.distributed", "fsdp")]))


@pytest.mark.parametrize("options", [
    ["--train.steps=4", "--algo.loss=dapo"],
    ["--train.steps=3", "--algo.loss=grpo", "--algo.beta=0.05", "--algo.num_iterations=2",
     "--algo.scale_rewards=batch", "--train.gradient_accumulation_steps=2", "--speed.packed_learning=false",
     "--train.lr=1e-3"],
], ids=["dapo-packed", "grpo-kl-mu2-batchscale-accum-padded"])
def test_two_fsdp_ranks_learn_what_one_process_learns(tmp_path, options):
    # FSDP runs every sample through the pass (speed.skip_zero_advantage is off there), so the one-process
    # run does too: with it on, `entropy` would average fewer tokens.
    one = launch(tmp_path, "one", 1, [*options, "--speed.skip_zero_advantage=false"])
    two = launch(tmp_path, "two", 2, [*options, FSDP])
    single, double = records(one), records(two)
    assert len(single) == len(double) >= 3
    for a, b in zip(single, double):
        for key in ("loss", "reward_mean", "reward_std", "completion_length", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5, rel=1e-5), (a["step"], key)
    assert all(record["grad_norm"] > 0 for record in single)  # there was something to learn
    assert max_difference(weights(one), weights(two)) < 1e-5
    # rank 0 alone wrote the run, with the one-process checkpoint's files and optimizer layout
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    files = [sorted(p.name for p in (run / "checkpoint").iterdir()) for run in (one, two)]
    assert files[0] == files[1]
    states = [torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=True)["job"]["optimization"]
              ["optimizer"]["state"] for run in (one, two)]
    assert sorted(states[0]) == sorted(states[1])
    for index, entry in states[0].items():
        for key, value in entry.items():
            assert value.shape == states[1][index][key].shape  # whole moments, not one rank's rows
            assert float((value - states[1][index][key]).abs().max()) < 1e-4, (index, key)


def test_an_fsdp_checkpoint_resumes_sharded_or_in_one_process_and_evaluates(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = launch(tmp_path, "fsdp", 2, ["--train.steps=4", "--output.save_every=2", "--output.save_total_limit=0",
                                       FSDP])
    straight_weights, straight_records = weights(run), records(run)
    copy = tmp_path / "runs" / "copy"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)

    hasten(2, ["train", "--resume", str(run / "checkpoint-2")])  # FSDP -> FSDP: each rank takes its rows
    resumed = records(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight_records, resumed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["reward_mean"] == b["reward_mean"]
    assert max_difference(straight_weights, weights(run)) < 1e-6

    hasten(1, ["train", "--resume", str(copy / "checkpoint-2")])  # FSDP -> one process: the same files
    for a, b in zip(straight_records, records(copy)):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5) and a["reward_mean"] == b["reward_mean"]
    assert max_difference(straight_weights, weights(copy)) < 1e-5

    # plain `hasten eval`, one process, loads the FSDP run's final model
    assert main(["eval", "--model", str(run / "checkpoint"), "--task", "arithmetic", "--eval.num_examples=4",
                 "--eval.max_new_tokens=6", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["num_examples"] == 4


# ----------------------------------------------------------------- signals under torchrun


def start_torchrun(tmp_path: Path, name: str, extra: list[str]) -> subprocess.Popen:
    """torchrun with 2 FSDP ranks as the leader of its own process group (as a shell runs a foreground job)."""
    data = tmp_path / "data.jsonl"
    launch_args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "-m", "hasten.cli", "train", "--model", "tiny", "--task", "jsonl", f"--task.path={data}",
                   "--reward", f"{tmp_path / 'rewards.py'}:letters", "--train.prompts_per_step=4",
                   "--generation.num_generations=4", "--generation.max_new_tokens=10", "--train.lr=3e-3",
                   "--eval.num_examples=4", "--eval.max_new_tokens=6", "--train.num_threads=1",
                   f"--output.dir={tmp_path / 'runs'}", f"--output.name={name}", "--output.progress=off",
                   "--output.plot=false", FSDP, *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.Popen(launch_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def group_members(group: int) -> list[int]:
    found = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


@pytest.mark.parametrize("sender", ["scheduler-sigterm-to-torchrun", "ctrl-c-sigint-to-group"])
def test_a_signal_under_torchrun_saves_stops_every_worker_and_resumes(tmp_path, sender):
    steps = ["--train.steps=10"]
    straight = launch(tmp_path, "straight", 2, [*steps, FSDP])  # also writes data.jsonl and rewards.py
    process = start_torchrun(tmp_path, "stopped", steps)
    run = tmp_path / "runs" / "stopped"
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
            time.sleep(0.1)
        if sender.startswith("scheduler"):
            process.send_signal(signal.SIGTERM)  # torchrun alone; it forwards SIGTERM to its workers
            expected = signal.SIGTERM
        else:
            os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: torchrun and every worker
            expected = signal.SIGINT
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    # torchrun re-raises the signal as its SignalException after its workers exited: exit status 1.
    assert process.returncode == 1, output[-3000:]
    assert f"got signal: {int(expected)}" in output
    assert group_members(process.pid) == []  # no worker survives
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == expected.name
    assert summary["exit_code"] == 128 + int(expected)  # what each worker exited with
    stopped_at = summary["steps"]
    assert 1 <= stopped_at < 10
    checkpoint = run / f"checkpoint-{stopped_at}"
    assert {"model.safetensors", "trainer_state.pt", "trainer_state.json", "config.json"} <= \
        {p.name for p in checkpoint.iterdir()}
    assert f"hasten train --resume {checkpoint}" in (checkpoint / "trainer_state.json").read_text()

    hasten(2, ["train", "--resume", str(run)])  # under torchrun again, to the end
    resumed, expected_records = records(run), records(straight)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for a, b in zip(expected_records, resumed):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and a["reward_mean"] == b["reward_mean"]
    assert max_difference(weights(straight), weights(run)) < 1e-6
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"


def test_a_second_signal_under_torchrun_stops_every_worker_at_once(tmp_path):
    launch(tmp_path, "setup", 1, ["--train.steps=1", "--eval.num_examples=0"])  # writes data.jsonl and rewards.py
    process = start_torchrun(tmp_path, "twice", ["--train.steps=50"])
    run = tmp_path / "runs" / "twice"
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0][-3000:]
            time.sleep(0.1)
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True,
                                                      text=True).stdout.split()]
        process.send_signal(signal.SIGINT)  # torchrun forwards each one to every worker's process group
        time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 1, output[-3000:]
    assert len(workers) == 2 and not [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not (run / "checkpoint").exists()  # stopped mid-run, not finished
    summary = run / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["status"] != "finished"
