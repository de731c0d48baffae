"""Run directory (naming, logs, checkpoints, plot) and the terminal progress view."""

from __future__ import annotations

import io
import json
import math

import pytest
import yaml

from hasten.config import Config, to_dict
from hasten.train.outputs import CheckpointError, RunDir
from hasten.train.progress import Progress


def make_config(tmp_path, name: str | None = None) -> Config:
    cfg = Config()
    cfg.output.dir = str(tmp_path / "runs")
    cfg.output.name = name
    return cfg


# ----------------------------------------------------------------- RunDir


def test_create_names_from_time_and_task(tmp_path):
    cfg = make_config(tmp_path)
    cfg.task.name = "arithmetic"
    run = RunDir.create(cfg)
    assert run.path.parent == tmp_path / "runs"
    assert run.path.name.endswith("-arithmetic")
    assert run.path.name[:8].isdigit()
    assert run.metrics_path == run.path / "metrics.jsonl"
    assert run.eval_path == run.path / "eval.jsonl"


def test_create_never_overwrites_a_previous_run(tmp_path):
    cfg = make_config(tmp_path, name="exp")
    first = RunDir.create(cfg)
    second = RunDir.create(cfg)
    third = RunDir.create(cfg)
    assert [first.path.name, second.path.name, third.path.name] == ["exp", "exp-2", "exp-3"]
    # An empty directory holds no run, so it is reused rather than skipped.
    (tmp_path / "runs" / "fresh").mkdir()
    assert RunDir.create(make_config(tmp_path, name="fresh")).path.name == "fresh"


def test_set_aside_moves_an_earlier_run_and_takes_its_name(tmp_path):
    cfg = make_config(tmp_path, name="out")
    cfg.output.earlier_run = "set_aside"
    first = RunDir.create(cfg)
    first.log_step({"step": 1, "loss": 0.5})
    first.lock.release()  # the run ended (create owns the directory, as loop.open_run's runs do)
    second = RunDir.create(cfg)  # TRL's output_dir: the new run writes "out" itself
    second.lock.release()
    third = RunDir.create(cfg)
    root = tmp_path / "runs"
    assert second.path == third.path == root / "out"
    assert sorted(p.name for p in root.iterdir()) == ["out", "out.previous-1", "out.previous-2"]
    assert json.loads((root / "out.previous-1" / "metrics.jsonl").read_text())["loss"] == 0.5  # nothing lost
    assert not (root / "out" / "metrics.jsonl").exists()


def test_set_aside_never_moves_a_live_run_or_files_that_are_not_a_run(tmp_path):
    from hasten.train.integrity import RunInUse, RunLock

    cfg = make_config(tmp_path, name="out")
    cfg.output.earlier_run = "set_aside"
    live = RunDir.create(cfg)  # owned while it runs, as loop.open_run's runs are
    try:
        with pytest.raises(RunInUse, match="in use by process"):
            RunDir.create(cfg)
    finally:
        live.lock.release()
    RunLock(live.path).acquire().release()  # free once released
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["out"]
    mine = tmp_path / "runs" / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    cfg.output.name = "mine"
    assert RunDir.create(cfg).path.name == "mine-2"  # not a run: left alone, the new run goes beside it
    assert (mine / "notes.txt").read_text() == "keep"


def test_config_yaml_round_trips(tmp_path):
    cfg = make_config(tmp_path, name="exp")
    cfg.train.lr = 3e-6
    cfg.rewards.extra = ["my_rewards.py:length"]
    run = RunDir.create(cfg)
    saved = yaml.safe_load((run.path / "config.yaml").read_text())
    assert saved == to_dict(cfg)
    assert saved["train"]["lr"] == 3e-6


def test_logs_are_strict_json(tmp_path):
    torch = pytest.importorskip("torch")
    run = RunDir.create(make_config(tmp_path, name="exp"))
    run.log_step({"step": 1, "loss": float("nan"), "kl": torch.tensor(0.25), "lr": 1e-6})
    run.log_step({"step": 2, "loss": torch.tensor(float("inf")), "rewards/correct": [0.5, float("nan")]})
    run.log_eval(2, {"accuracy": 0.5, "answer_rate": float("nan")})

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))

    lines = [strict(line) for line in run.metrics_path.read_text().splitlines()]
    assert lines == [
        {"step": 1, "loss": None, "kl": 0.25, "lr": 1e-6},
        {"step": 2, "loss": None, "rewards/correct": [0.5, None]},
    ]
    assert [strict(line) for line in run.eval_path.read_text().splitlines()] == [
        {"step": 2, "accuracy": 0.5, "answer_rate": None}
    ]


def test_write_summary(tmp_path):
    run = RunDir.create(make_config(tmp_path, name="exp"))
    path = run.write_summary({"final_accuracy": 0.75, "reward_delta": math.nan})
    assert path == run.path / "summary.json"
    assert json.loads(path.read_text()) == {"final_accuracy": 0.75, "reward_delta": None}
    assert "\n  " in path.read_text()  # pretty-printed
    assert sorted(p.name for p in run.path.iterdir()) == [".lock", "config.yaml", "summary.json"]


class StandInTokenizer:
    def save_pretrained(self, directory):
        (directory / "tokenizer.json").write_text("{}")


class FailingModel:
    def save_pretrained(self, directory):
        (directory / "model.safetensors").write_text("half")
        raise OSError("disk full")


@pytest.fixture(scope="module")
def tiny_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    return transformers.LlamaForCausalLM(config)


def test_save_checkpoint_is_loadable_and_leaves_no_temp_dirs(tmp_path, tiny_model):
    from transformers import LlamaForCausalLM

    torch = pytest.importorskip("torch")
    run = RunDir.create(make_config(tmp_path, name="exp"))
    assert run.checkpoint_dir(None) == run.path / "checkpoint"
    assert run.checkpoint_dir(50) == run.path / "checkpoint-50"

    saved = run.save_checkpoint(tiny_model, StandInTokenizer(), 50)
    final = run.save_checkpoint(tiny_model, StandInTokenizer(), None)
    assert (saved, final) == (run.checkpoint_dir(50), run.checkpoint_dir(None))
    assert (final / "tokenizer.json").is_file()
    loaded = LlamaForCausalLM.from_pretrained(final)
    for name, tensor in tiny_model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    # Saving again to the same name replaces the old directory.
    (final / "stale.txt").write_text("from an older save")
    run.save_checkpoint(tiny_model, StandInTokenizer(), None)
    assert not (final / "stale.txt").exists()
    assert sorted(p.name for p in run.path.iterdir()) == [".lock", "checkpoint", "checkpoint-50", "config.yaml"]


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, tiny_model):
    run = RunDir.create(make_config(tmp_path, name="exp"))
    previous = run.save_checkpoint(tiny_model, StandInTokenizer(), None)
    before = sorted(p.name for p in previous.iterdir())
    with pytest.raises(CheckpointError, match="could not write .*checkpoint: disk full"):
        run.save_checkpoint(FailingModel(), StandInTokenizer(), None)
    assert sorted(p.name for p in previous.iterdir()) == before
    assert sorted(p.name for p in run.path.iterdir()) == [".lock", "checkpoint", "config.yaml"]


def test_plot_writes_png(tmp_path):
    run = RunDir.create(make_config(tmp_path, name="exp"))
    assert run.plot() is None  # nothing logged yet
    for step in range(1, 5):
        run.log_step(
            {
                "step": step,
                "reward_mean": 0.1 * step,
                "reward_std": 0.05,
                "rewards/correct": 0.1 * step,
                "rewards/format": 0.9,
            }
        )
    run.log_eval(0, {"accuracy": 0.1, "answer_rate": 0.5})
    run.log_eval(4, {"accuracy": 0.4, "answer_rate": 0.9})
    path = run.plot()
    assert path == run.path / "progress.png"
    assert path.read_bytes().startswith(b"\x89PNG")
    assert path.stat().st_size > 1000


def test_plot_with_only_eval_and_a_torn_line(tmp_path):
    run = RunDir.create(make_config(tmp_path, name="exp"))
    run.log_eval(0, {"accuracy": 0.2})
    with run.metrics_path.open("a") as handle:
        handle.write('{"step": 1, "reward_me')  # a run killed mid-write
    path = run.plot()
    assert path is not None and path.read_bytes().startswith(b"\x89PNG")


# --------------------------------------------------------------- Progress

RECORD = {
    "reward_mean": 0.5123,
    "reward_std": 0.3012,
    "rewards/correct": 0.41,
    "rewards/format": 0.9,
    "completion_length": 42.13,
    "loss": 0.012345,
    "entropy": 1.234,
    "lr": 3.25e-7,
    "time/generate": 1.234,
    "time/reward": 0.0123,
    "time/learn": 2.345,
    "time/step": 3.6,
    "tokens_per_second": 1234.5,
}


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_plain():
    stream = io.StringIO()
    progress = Progress(total_steps=10, mode="auto", stream=stream)
    assert progress.mode == "plain"  # a StringIO is not a terminal
    progress.set_eval(0, {"accuracy": 0.25, "answer_rate": 0.875})
    progress.update(1, RECORD)
    progress.update(2, {"loss": 0.5})
    progress.message("saved checkpoint-2")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "eval step 0: accuracy 0.25  answer_rate 0.875"
    assert lines[1] == (
        "step 1/10  reward 0.512±0.301 (correct 0.41, format 0.9)  len 42.1  loss 0.0123  "
        "entropy 1.23  lr 3.25e-7  3.6s/step (gen 1.23s, reward 0.0123s, learn 2.35s)  "
        "tok/s 1234  eval acc 0.25"
    )  # one step is no settled rate: no ETA yet (tests/test_first_hour.py)
    assert "kl" not in lines[1]  # missing keys are left out
    assert lines[2] == "step 2/10  loss 0.5  eval acc 0.25"
    assert lines[3] == "saved checkpoint-2"
    assert len(lines) == 4


def test_progress_off_prints_nothing():
    stream = FakeTerminal()
    progress = Progress(total_steps=3, mode="off", stream=stream)
    progress.set_eval(0, {"accuracy": 0.5})
    progress.update(1, RECORD)
    progress.message("hello")
    progress.close()
    assert stream.getvalue() == ""


def test_progress_live_redraws_in_place():
    stream = FakeTerminal()
    progress = Progress(total_steps=4, mode="auto", stream=stream)
    assert progress.mode == "live"
    progress.update(1, RECORD)
    first = stream.getvalue()
    assert first.startswith("step 1/4 [######" + "." * 18 + "]  25%")
    assert "\x1b[" not in first  # nothing to erase before the first draw
    assert "lr 3.25e-7" in first and "tok/s 1234" in first
    block_lines = first.count("\n") + 1

    progress.update(2, {"reward_mean": 0.75})
    redraw = stream.getvalue()[len(first) :]
    assert redraw.startswith(f"\r\x1b[{block_lines - 1}A\x1b[J")
    assert redraw.endswith("step 2/4 [" + "#" * 12 + "." * 12 + "]  50%\nreward 0.75")

    progress.set_eval(2, {"accuracy": 0.5, "answer_rate": 1.0})
    assert stream.getvalue().endswith("eval (step 2): accuracy 0.5  answer rate 1")

    before = len(stream.getvalue())
    progress.message("saved checkpoint-2")
    shown = stream.getvalue()[before:]
    assert shown.startswith("\r\x1b[2A\x1b[Jsaved checkpoint-2\nstep 2/4")

    progress.close()
    assert stream.getvalue().endswith("answer rate 1\n")
    progress.close()  # closing twice adds nothing
    assert stream.getvalue().endswith("answer rate 1\n")


def test_progress_rejects_unknown_mode():
    with pytest.raises(ValueError, match="live"):
        Progress(total_steps=1, mode="fancy")
