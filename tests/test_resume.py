"""Full-state checkpoints, resume and signals (train/loop.py), on the tiny model.

The contract: a run killed at any point and resumed from its last checkpoint
continues bit-identically to the run that was never interrupted (same
rewards, losses and final weights, step by step), for GRPO (full and LoRA),
the game policy and SFT; SIGINT / SIGTERM save a loadable checkpoint and
exit 130 / 143; a second signal exits at once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hasten.config import Config, load_config, parse_overrides
from hasten.train import loop
from hasten.train.outputs import STATE_FILE, RunDir
from hasten.rft.sft import SFTJob
from hasten.train.policy_loop import GameJob
from hasten.train.trainer import GRPOJob, train

# A learnable reward that can also stop its own process at a chosen training step:
# HASTEN_TEST_SIGNAL=<signal number> (9 = SIGKILL), sent HASTEN_TEST_SIGNAL_COUNT times
# (default 1) when the HASTEN_TEST_AT-th training batch (8 completions; evals score 3) is scored.
REWARDS = '''
import os, signal
from pathlib import Path

def letters(prompts, completions, **kwargs):
    if len(completions) == 8 and os.environ.get("HASTEN_TEST_AT"):
        counter = Path(os.environ["HASTEN_TEST_COUNTER"])
        calls = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(calls))
        if calls == int(os.environ["HASTEN_TEST_AT"]):
            for _ in range(int(os.environ.get("HASTEN_TEST_SIGNAL_COUNT", "1"))):
                os.kill(os.getpid(), int(os.environ["HASTEN_TEST_SIGNAL"]))
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
'''

VOLATILE = ("time/", "memory/", "tokens_per_second", "seconds", "games_per_second")


@pytest.fixture
def data(tmp_path):
    rows = [{"prompt": f"write letters {i}:", "answer": "abc"} for i in range(40)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def grpo_overrides(data: Path, name: str, **extra) -> list[str]:
    pairs = {"model.name": "tiny", "task.name": "jsonl", "task.path": data / "data.jsonl",
             "rewards.extra": f"['{data / 'rewards.py'}:letters']", "train.steps": 5, "train.prompts_per_step": 2,
             "train.lr": 3e-3, "train.num_threads": 1, "generation.num_generations": 4,
             "generation.max_new_tokens": 8, "eval.num_examples": 3, "eval.every": 2, "eval.max_new_tokens": 6,
             "output.dir": data / "runs", "output.name": name, "output.progress": "plain", "output.plot": False,
             "output.save_every": 1, "output.save_total_limit": 0, **extra}
    return [f"--{key}={value}" for key, value in pairs.items()]


def hasten(args: list[str], data: Path, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HASTEN_TEST_COUNTER": str(data / f"calls-{random.random()}"),
                   **{key: str(value) for key, value in env.items()}}
    return subprocess.run([sys.executable, "-m", "hasten.cli", *args], cwd=data, env=environment,
                          capture_output=True, text=True, timeout=600)


def records(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    lines = (run / name).read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE) and k not in VOLATILE}
            for line in lines]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    return {key: value for file in files for key, value in load_file(str(file)).items()}


def differences(actual: list[dict], expected: list[dict]) -> list[str]:
    """'step N key: actual != expected' for every value that differs (an empty list: the same run)."""
    found = [f"{len(actual)} records != {len(expected)}"] if len(actual) != len(expected) else []
    for a, e in zip(actual, expected):
        found += [f"step {e.get('step')} {key}: {a.get(key)!r} != {e.get(key)!r}"
                  for key in sorted(set(a) | set(e)) if a.get(key) != e.get(key)]
    return found


def assert_same_run(resumed: Path, reference: Path) -> None:
    assert differences(records(resumed), records(reference)) == []  # every step's rewards, losses, lr, grad norm
    assert records(resumed, "eval.jsonl") == records(reference, "eval.jsonl")
    expected, actual = weights(reference / "checkpoint"), weights(resumed / "checkpoint")
    assert expected.keys() == actual.keys() and expected
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key


@pytest.fixture
def uninterrupted(data):
    done = hasten(["train", *grpo_overrides(data, "reference")], data)
    assert done.returncode == 0, done.stderr[-2000:]
    return data / "runs" / "reference"


def test_kill_9_at_a_random_point_then_resume_equals_the_uninterrupted_run(data, uninterrupted):
    kill_at = random.Random(os.getpid()).randint(2, 4)
    process = subprocess.Popen([sys.executable, "-m", "hasten.cli", "train", *grpo_overrides(data, "killed")],
                               cwd=data, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = data / "runs" / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:  # kill -9 wherever it is once k steps logged
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= kill_at:
            process.kill()
            break
        time.sleep(0.01)
    assert process.wait() == -signal.SIGKILL
    run = data / "runs" / "killed"
    resumed = hasten(["train", "--resume", str(run)], data)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr
    assert_same_run(run, uninterrupted)
    assert not [p for p in run.iterdir() if ".tmp-" in p.name or ".old-" in p.name]  # killed saves cleaned up


def test_kill_9_inside_a_step_loses_only_that_step(data, uninterrupted):
    killed = hasten(["train", *grpo_overrides(data, "killed")], data, HASTEN_TEST_AT=4, HASTEN_TEST_SIGNAL=9)
    assert killed.returncode == -signal.SIGKILL
    run = data / "runs" / "killed"
    assert RunDir(run).latest_checkpoint() == run / "checkpoint-3"  # steps 1-3 saved, step 4 lost
    resumed = hasten(["train", "--resume", str(run / "checkpoint-2")], data)  # an older one works too
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(run, uninterrupted)


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_a_checkpoint_and_exits_128_plus_signal(data, uninterrupted, signum, code):
    stopped = hasten(["train", *grpo_overrides(data, "stopped", **{"output.save_every": 0})], data,
                     HASTEN_TEST_AT=2, HASTEN_TEST_SIGNAL=int(signum))
    run = data / "runs" / "stopped"
    assert stopped.returncode == code, stopped.stderr[-2000:]
    assert f"interrupted at step 2; resume with: hasten train --resume {run}" in stopped.stderr
    assert "Traceback" not in stopped.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 2 and summary["exit_code"] == code
    checkpoint = run / "checkpoint-2"
    assert (checkpoint / STATE_FILE).is_file() and (checkpoint / "tokenizer.json").is_file()
    evaluated = hasten(["eval", "--model", str(checkpoint), "--task", "jsonl", f"--task.path={data / 'data.jsonl'}",
                        "--num-examples", "2", "--json", "--eval.max_new_tokens=4",
                        f"--rewards.extra=['{data / 'rewards.py'}:letters']"], data)
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]  # the checkpoint loads as a model
    resumed = hasten(["train", "--resume", str(run)], data)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_same_run(run, uninterrupted)


def test_a_second_sigint_stops_at_once(data):
    stopped = hasten(["train", *grpo_overrides(data, "stopped", **{"output.save_every": 0})], data,
                     HASTEN_TEST_AT=2, HASTEN_TEST_SIGNAL=int(signal.SIGINT), HASTEN_TEST_SIGNAL_COUNT=2)
    run = data / "runs" / "stopped"
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    assert "stopped by SIGINT; stopped at once" in stopped.stderr and "Traceback" not in stopped.stderr
    assert not list(run.glob("checkpoint*"))  # no save after the second signal
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1  # step 2 abandoned


def test_resume_refuses_a_finished_run_and_changed_settings(data, uninterrupted, capsys, monkeypatch):
    from hasten.cli import main

    monkeypatch.chdir(data)  # in this process: a refusal comes before anything a fresh process would change

    def refused(args: list[str]) -> str:
        code = main(args)
        error = capsys.readouterr().err
        assert code == 2, error
        return error

    assert "finished at step 5; nothing to resume" in refused(["train", "--resume", str(uninterrupted)])
    assert "drop --train.lr" in refused(["train", "--resume", str(uninterrupted / "checkpoint-3"), "--train.lr=1"])
    assert "no full-state checkpoint" in refused(["train", "--resume", str(data)])
    assert not (data / ".lock").exists()  # not a run directory: nothing written there


# ------------------------------------------------------------- in-process crashes: LoRA, game, SFT


class Crash(Exception):
    pass


def crash_at(monkeypatch, job_class: type, at: int) -> None:
    """Make `job_class.step` raise at step `at`: a crash mid-run."""
    original = job_class.step

    def step(self, number):
        if number == at:
            raise Crash(f"crash at step {number}")
        return original(self, number)

    monkeypatch.setattr(job_class, "step", step)


def in_process(overrides: dict) -> object:
    return load_config(overrides=list(overrides.items()))


def crash_and_resume(monkeypatch, make_cfg, target: type, at: int, entry) -> tuple[Path, Path]:
    reference = entry(make_cfg("reference"), None)
    with monkeypatch.context() as patch:
        crash_at(patch, target, at)
        with pytest.raises(Crash):
            entry(make_cfg("crashed"), None)
    run = Path(reference["run_dir"]).parent / "crashed"
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"
    entry(load_config(run / "config.yaml"), run)
    return run, Path(reference["run_dir"])


@pytest.mark.parametrize("precision", ["auto", "bf16_fp32head"])  # bf16: the base held in bf16 (frozen_base.py)
def test_lora_grpo_resumes_bit_identically(data, monkeypatch, precision):
    def make(name):  # the CLI's own parsing of the same overrides
        return load_config(overrides=parse_overrides(grpo_overrides(data, name, **{
            "model.lora": True, "model.lora_r": 4, "algo.beta": 0.05, "output.progress": "off",
            "train.precision": precision})))

    lines = []
    run, reference = crash_and_resume(monkeypatch, make, GRPOJob, 4,
                                      lambda cfg, resume: train(cfg, log=lines.append, resume=resume))
    assert (run / "checkpoint" / "adapter_model.safetensors").is_file()
    assert_same_run(run, reference)
    held = [line for line in lines if line.startswith("plan:") and "LoRA base held in bf16" in line]
    assert len(held) == (3 if precision == "bf16_fp32head" else 0)  # the reference, the crashed run, its resume


@pytest.mark.parametrize("extra", [{"generation.precision": "int8"}, {"train.optimizer_moments": "bf16"}],
                         ids=["int8-sampling", "bf16-moments"])
def test_low_precision_runs_resume_bit_identically(data, monkeypatch, extra):
    # int8 sampling smooths each step's quantization by the activations the last step saw (the engine's
    # state, in the checkpoint); bf16 moments round with the optimizer's own generator (its state too).
    from hasten.kernels import int8

    if "generation.precision" in extra and int8.unavailable_reason() is not None:
        pytest.skip("no int8 kernels in this torch build")

    def make(name):
        return load_config(overrides=parse_overrides(grpo_overrides(data, name, **{
            "output.progress": "off", **extra})))

    run, reference = crash_and_resume(monkeypatch, make, GRPOJob, 4,
                                      lambda cfg, resume: train(cfg, log=lambda _: None, resume=resume))
    assert_same_run(run, reference)


def test_game_policy_resumes_bit_identically(tmp_path, monkeypatch):
    def make(name):
        return in_process({"task.name": "fruit-catcher", "train.steps": 4, "game.num_starts": 3,
                           "game.games_per_start": 4, "game.episode_steps": 20, "game.eval_games": 16,
                           "eval.every": 2, "output.dir": str(tmp_path), "output.name": name,
                           "output.progress": "off", "output.plot": False, "output.save_every": 1})

    run, reference = crash_and_resume(monkeypatch, make, GameJob, 3,
                                      lambda cfg, resume: train(cfg, log=lambda _: None, resume=resume))
    assert records(run) == records(reference) and records(run, "eval.jsonl") == records(reference, "eval.jsonl")
    expected = torch.load(reference / "checkpoint" / "policy.pt", weights_only=True)["state_dict"]
    actual = torch.load(run / "checkpoint" / "policy.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(expected[key], actual[key]) for key in expected)


def test_sft_resumes_bit_identically(tmp_path, monkeypatch):
    from hasten.rft.sft import run_sft

    records_file = tmp_path / "rft.json"
    records_file.write_text(json.dumps([[f"What is {i} + {i}?", str(2 * i), f"{i} + {i} = {2 * i}. "
                                         f"<answer>{2 * i}</answer>"] for i in range(12)]))

    def make(name):
        return in_process({"model.name": "tiny", "model.lora": True, "model.lora_r": 4, "task.name": "arithmetic",
                           "rft.data": str(records_file), "sft.epochs": 2, "sft.batch_size": 4,
                           "sft.gradient_accumulation_steps": 2, "sft.lr": 1e-2, "eval.num_examples": 0,
                           "output.dir": str(tmp_path / "runs"), "output.name": name, "output.progress": "off",
                           "output.plot": False, "output.save_every": 2})

    def entry(cfg, resume):
        report = run_sft(cfg, log=lambda _: None, resume=resume)
        return {"run_dir": report.run_dir}

    run, reference = crash_and_resume(monkeypatch, make, SFTJob, 5, entry)
    assert records(run) == records(reference)
    assert_same_run_weights(run, reference)


def assert_same_run_weights(run: Path, reference: Path) -> None:
    expected, actual = weights(reference / "checkpoint"), weights(run / "checkpoint")
    assert expected and all(torch.equal(expected[key], actual[key]) for key in expected)


# ------------------------------------------------------------- checkpoint files


def test_stale_temporaries_of_killed_saves_are_removed_on_resume(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / ".checkpoint-3.tmp-abc").mkdir()
    (tmp_path / ".checkpoint.old-def").mkdir()
    (tmp_path / ".summary.json.tmp-123").write_text("{")
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / STATE_FILE).write_bytes(b"x")
    opened, found = loop.open_run(Config(), tmp_path)
    opened.lock.release()
    assert opened.path == run.path and found == checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "checkpoint-2", "config.yaml"]


def test_save_total_limit_keeps_the_newest(tmp_path):
    run = RunDir(tmp_path)
    for step in (1, 2, 3, 4):
        run.save_files(lambda directory: (directory / STATE_FILE).write_bytes(b"x"), step)
        run.prune(2)
    assert [step for step, _ in run.numbered_checkpoints()] == [3, 4]


def game_config(tmp_path: Path, name: str, **extra):
    return in_process({"task.name": "fruit-catcher", "train.steps": 3, "game.num_starts": 2,
                       "game.games_per_start": 4, "game.episode_steps": 10, "game.eval_games": 0,
                       "output.dir": str(tmp_path), "output.name": name, "output.progress": "off",
                       "output.plot": False, **extra})


def test_a_run_failing_in_its_first_step_leaves_no_directory(tmp_path, monkeypatch):
    crash_at(monkeypatch, GameJob, 1)
    with pytest.raises(Crash):
        train(game_config(tmp_path, "doomed"), log=lambda _: None)
    assert not (tmp_path / "doomed").exists()


def test_a_run_failing_later_is_kept_and_marked_failed(tmp_path, monkeypatch):
    crash_at(monkeypatch, GameJob, 3)
    with pytest.raises(Crash):
        train(game_config(tmp_path, "late", **{"output.save_every": 1}), log=lambda _: None)
    summary = json.loads((tmp_path / "late" / "summary.json").read_text())
    assert summary == {"run_dir": str(tmp_path / "late"), "status": "failed", "steps": 2,
                       "error": "Crash: crash at step 3"}
    assert RunDir(tmp_path / "late").latest_checkpoint() == tmp_path / "late" / "checkpoint-2"


@pytest.mark.parametrize("minutes, expected", [(0.0, []), (1e-9, [1, 2])])
def test_wall_clock_checkpoints(tmp_path, minutes, expected):
    """save_every=0: a checkpoint-<N>/ only when save_minutes passed since the last (never, or every step)."""
    summary = train(game_config(tmp_path, f"clock{minutes}", **{"output.save_minutes": minutes,
                                                                  "output.save_total_limit": 0}),
                    log=lambda _: None)
    run = RunDir(summary["run_dir"])
    assert [step for step, _ in run.numbered_checkpoints()] == expected
    assert run.latest_checkpoint() == run.checkpoint_dir(None)  # the final one is full state too
