"""Bad input, through the front door: `hasten.cli.main` returns 2, stderr's last line names the
culprit, and nothing is left behind (no run directory, no records file, no probe file).

Every case runs on the tiny model; the ones caught before the model loads take well under a second.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from hasten.cli import main
from hasten.config import AlgoConfig, SpeedConfig
from hasten.rewards import RewardError, RewardFunction
from hasten.rewards.scoring import RewardScorer

SMALL = ["--steps", "1", "--train.prompts_per_step=2", "--generation.num_generations=2",
         "--generation.max_new_tokens=4", "--eval.num_examples=0", "--output.progress=off", "--output.plot=false"]

REWARDS = '''
import sys

def raises(prompts, completions, **kwargs):
    raise ValueError("cannot score this")

def short(prompts, completions, **kwargs):
    return [0.0] * (len(completions) - 1)

def strings(prompts, completions, **kwargs):
    return ["high"] * len(completions)

def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)

def exits(prompts, completions, **kwargs):
    sys.exit(3)

async def exits_async(prompts, completions, **kwargs):
    sys.exit(4)
'''


def fails(capsys, argv: list[str]) -> str:
    """Run the CLI, require exit 2, return stderr's last line (the one-line error)."""
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    return err[-1]


@pytest.fixture
def data(tmp_path):
    rows = [{"prompt": f"write letters {i}:"} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A complete tiny checkpoint written by a 1-step run: the base the broken copies start from."""
    root = tmp_path_factory.mktemp("checkpoint")
    assert main(["train", "--model", "tiny", "--task", "arithmetic", *SMALL, f"--output.dir={root}",
                 "--output.name=base"]) == 0
    return root / "base" / "checkpoint"


def copy_of(checkpoint: Path, destination: Path) -> Path:
    destination.mkdir()
    for file in checkpoint.iterdir():
        (destination / file.name).write_bytes(file.read_bytes())
    return destination


# ------------------------------------------------------------------ reward functions


@pytest.mark.parametrize("function, message", [
    ("raises", "function 'raises' failed on sample 0 (prompt \"write letters ... \"): ValueError: cannot score this"),
    ("short", "function 'short' returned 3 values (expected a list of 4 floats or None)"),
    ("strings", "function 'strings' returned str at sample 0"),
    ("nan", "function 'nan' returned nan at sample 0 (rewards must be finite; return None to skip a sample)"),
    ("exits", "function 'exits' called sys.exit(3)"),
    ("exits_async", "function 'exits_async' called sys.exit(4)"),
])
def test_a_broken_reward_is_one_line_naming_it(data, capsys, function, message):
    error = fails(capsys, ["train", "--model", "tiny", "--task", "jsonl", f"--task.path={data / 'data.jsonl'}",
                           "--reward", f"{data / 'rewards.py'}:{function}", *SMALL, f"--output.dir={data / 'runs'}"])
    assert error.startswith("reward error: ") and all(part in error for part in message.split(" ... ")), error


def test_a_reward_failing_at_step_1_leaves_no_run_directory(data, capsys):
    code = main(["train", "--model", "tiny", "--task", "jsonl", f"--task.path={data / 'data.jsonl'}",
                 "--reward", f"{data / 'rewards.py'}:raises", *SMALL, f"--output.dir={data / 'runs'}",
                 "--output.progress=plain"])
    assert code == 2
    assert not (data / "runs").exists() or not any((data / "runs").iterdir())
    assert "run directory" not in capsys.readouterr().err  # never named: it is gone


def exits_in_worker(prompts, completions, **kwargs):
    sys.exit(5)


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_sys_exit_in_the_reward_pool_is_a_reward_error(pool):
    """The pool's futures re-raise SystemExit in the trainer; it must arrive as RewardError instead."""
    slow = RewardFunction("exits_in_worker", exits_in_worker, slow=True)
    scorer = RewardScorer([slow], SpeedConfig(reward_workers=2, reward_pool=pool, reward_cache=False))
    try:
        with pytest.raises(RewardError, match=r"function 'exits_in_worker' called sys.exit\(5\)"):
            scorer.start(["p"] * 4, ["c"] * 4, {}, [[1]] * 4).join()
    finally:
        scorer.close()


def test_sys_exit_in_a_gated_reward_is_a_reward_error():
    gate = RewardFunction("exits_in_worker", exits_in_worker)
    scorer = RewardScorer([gate], SpeedConfig(reward_cache=False),
                          AlgoConfig(gate_reward="exits_in_worker"))
    with pytest.raises(RewardError, match=r"function 'exits_in_worker' called sys.exit\(5\)"):
        scorer.start(["p"] * 2, ["c"] * 2, {}, [[1]] * 2).join()


# ------------------------------------------------------------------ model directories


def test_truncated_safetensors(checkpoint, tmp_path, capsys):
    broken = copy_of(checkpoint, tmp_path / "model")
    weights = broken / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    for impl in ("auto", "hf"):  # the native loader and transformers' both check first
        error = fails(capsys, ["train", "--model", str(broken), "--task", "arithmetic", *SMALL,
                               f"--speed.model_impl={impl}", f"--output.dir={tmp_path / 'runs'}"])
        assert error.startswith(f"model error: {weights} is truncated"), error
    assert not (tmp_path / "runs").exists()


def test_corrupt_config_json(checkpoint, tmp_path, capsys):
    broken = copy_of(checkpoint, tmp_path / "model")
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    for impl in ("auto", "hf"):
        error = fails(capsys, ["train", "--model", str(broken), "--task", "arithmetic", *SMALL,
                               f"--speed.model_impl={impl}", f"--output.dir={tmp_path / 'runs'}"])
        assert error.startswith(f"model error: {broken / 'config.json'} is not valid JSON"), error
    assert not (tmp_path / "runs").exists()


def test_checkpoint_without_tokenizer_files(checkpoint, tmp_path, capsys):
    broken = copy_of(checkpoint, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (broken / name).unlink()
    error = fails(capsys, ["eval", "--model", str(broken), "--task", "arithmetic", "--eval.num_examples=1"])
    assert error.startswith(f"model error: {broken} has no tokenizer files (tokenizer.json)"), error


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_model_directory_without_weights(checkpoint, tmp_path, capsys, command):
    broken = copy_of(checkpoint, tmp_path / "model")
    (broken / "model.safetensors").unlink()
    error = fails(capsys, [command, "--model", str(broken), "--task", "arithmetic", "--eval.num_examples=1",
                           f"--output.dir={tmp_path / 'runs'}"])
    assert error == f"model error: {broken} has no weights (model.safetensors); copy them from where the model " \
                    "was saved", error
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ output paths


def test_output_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    for target, message in ((tmp_path / "taken", "is a file, not a directory"),
                            (tmp_path / "taken" / "runs", f"cannot be created: '{tmp_path / 'taken'}' is a file")):
        error = fails(capsys, ["train", "--model", "tiny", "--task", "arithmetic", *SMALL, f"--output.dir={target}"])
        assert error == f"config error: output.dir '{target}' {message}"


def unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: chmod for a normal user; root ignores modes,
    so there /sys (sysfs refuses new files even to root)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked
    if not Path("/sys").is_dir():
        pytest.skip("running as root without /sys: no directory refuses writes")
    return Path("/sys")


def test_unwritable_output_dir_fails_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import hasten.train.trainer

    monkeypatch.setattr(hasten.train.trainer, "load_policy", lambda *a, **k: pytest.fail("loaded the model"))
    target = unwritable_dir(tmp_path) / "runs"
    for command in (["train", "--task", "arithmetic"], ["train", "--task", "fruit-catcher"]):
        error = fails(capsys, [*command, "--model", "tiny", *SMALL, f"--output.dir={target}"])
        assert error.startswith(f"config error: output.dir '{target}' is not writable"), error


def test_sft_checks_its_output_dir_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import hasten.rft.sft

    monkeypatch.setattr(hasten.rft.sft, "load_policy", lambda *a, **k: pytest.fail("loaded the model"))
    records = tmp_path / "rft.json"
    records.write_text(json.dumps([["What is 1 + 1?", "2", "<answer>2</answer>"]]))
    (tmp_path / "taken").write_text("")
    error = fails(capsys, ["sft", "--model", "tiny", "--task", "arithmetic", "--data", str(records),
                           f"--output.dir={tmp_path / 'taken'}"])
    assert error == f"config error: output.dir '{tmp_path / 'taken'}' is a file, not a directory"


@pytest.mark.parametrize("where", ["unwritable", "directory"])
def test_rft_datagen_data_path_is_checked_before_sampling(tmp_path, capsys, monkeypatch, where):
    import hasten.rft.datagen

    monkeypatch.setattr(hasten.rft.datagen, "load_generator", lambda *a, **k: pytest.fail("loaded the model"))
    target = unwritable_dir(tmp_path) / "rft.json" if where == "unwritable" else tmp_path
    error = fails(capsys, ["rft", "datagen", "--model", "tiny", "--task", "arithmetic", "--data", str(target)])
    expected = "is not writable" if where == "unwritable" else "is a directory, not a file"
    assert error.startswith(f"config error: rft.data '{target}' {expected}"), error
    assert not any(name.startswith(".hasten-write-check-") for name in os.listdir(tmp_path))


def test_a_writable_output_dir_is_left_as_it_was(tmp_path):
    from hasten.config import load_config
    from hasten.train.preflight import check_output_dir

    check_output_dir(load_config(overrides=[("output.dir", str(tmp_path / "new" / "runs"))]))
    assert list(tmp_path.iterdir()) == []  # neither the probe file nor the missing parents


# ------------------------------------------------------------------ task data paths


@pytest.mark.parametrize("task", [["--task", "jsonl"], ["--task", "code", "--code.source=mbpp"]])
def test_task_path_naming_a_directory(tmp_path, capsys, task):
    error = fails(capsys, ["train", "--model", "tiny", *task, f"--task.path={tmp_path}", *SMALL,
                           f"--output.dir={tmp_path / 'runs'}"])
    assert error.startswith(f"data error: '{tmp_path}' is a directory, not a data file")
    assert not (tmp_path / "runs").exists()
