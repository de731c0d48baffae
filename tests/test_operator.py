"""What an operator meets around a run (issue 30): one owner per run directory, damaged checkpoints,
a full disk, a run killed between its final save and its summary. The game policy trains in a second,
so the runs here are real ones."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hasten.config import load_config
from hasten.train import loop
from hasten.train.integrity import MANIFEST, DamagedCheckpoint, RunInUse, RunLock
from hasten.train.outputs import STATE_FILE, OutOfSpace, RunDir
from hasten.train.policy_loop import GameJob
from hasten.train.trainer import train


def game_config(root: Path, name: str, **extra):
    return load_config(overrides=list({
        "task.name": "fruit-catcher", "train.steps": 3, "game.num_starts": 2, "game.games_per_start": 4,
        "game.episode_steps": 10, "game.eval_games": 0, "output.dir": str(root), "output.name": name,
        "output.progress": "off", "output.plot": False, "output.save_every": 1, **extra}.items()))


def crashed_run(root: Path, monkeypatch, at: int = 3) -> Path:
    """A run that failed at step `at`: checkpoint-1 ... checkpoint-<at - 1>, resumable."""
    original = GameJob.step

    def step(self, number):
        if number == at:
            raise RuntimeError("crash")
        return original(self, number)

    with monkeypatch.context() as patch:
        patch.setattr(GameJob, "step", step)
        with pytest.raises(RuntimeError):
            train(game_config(root, "crashed"), log=lambda _: None)
    return root / "crashed"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hasten.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


# ------------------------------------------------------------------ one owner


HOLDER = """
import sys, time
from hasten.train.integrity import RunLock
RunLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_writer_of_a_run_exits_2_naming_the_owner_and_writes_nothing(tmp_path, monkeypatch):
    run = crashed_run(tmp_path, monkeypatch)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {path: path.stat().st_mtime_ns for path in run.rglob("*")}
        second = cli("train", "--resume", str(run), cwd=tmp_path)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert lines == [lines[-1]] and str(run) in lines[0] and f"process {holder.pid}" in lines[0]
        assert {path: path.stat().st_mtime_ns for path in run.rglob("*")} == before  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the kernel dropped the dead owner's lock: the run resumes and finishes
    resumed = cli("train", "--resume", str(run), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_two_resumes_of_one_run_at_once_leave_each_step_once(tmp_path, monkeypatch):
    """The issue's double-submitted job: whichever comes second exits 2 (owned, or already finished)."""
    run = crashed_run(tmp_path, monkeypatch, at=2)
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    both = [subprocess.Popen([sys.executable, "-m", "hasten.cli", "train", "--resume", str(run)], cwd=tmp_path,
                             env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    errors = [process.communicate(timeout=300)[1] for process in both]
    outcomes = sorted((process.returncode, error) for process, error in zip(both, errors))
    assert [code for code, _ in outcomes] == [0, 2], outcomes
    assert "in use by process" in outcomes[1][1] or "nothing to resume" in outcomes[1][1]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_the_lock_is_held_for_the_run_and_released_after(tmp_path):
    seen = []

    class Probe(loop.Hook):
        def on_step(self, step, record):
            with pytest.raises(RunInUse, match="in use by process"):
                RunLock(self.run.path).acquire()
            seen.append(step)

        def on_begin(self, run, start):
            self.run = run

    cfg = game_config(tmp_path, "held")
    run, _ = loop.open_run(cfg, None)
    from hasten.train.policy_loop import prepare_game

    loop.run(GameJob(prepare_game(cfg, lambda _: None)), cfg, run, lambda _: None, callbacks=[Probe()])
    assert seen == [1, 2, 3]
    RunLock(run.path).acquire().release()  # free again


# ------------------------------------------------------------------ damaged checkpoints


def test_checkpoints_carry_a_manifest_and_a_damaged_newest_falls_back(tmp_path, monkeypatch):
    run = crashed_run(tmp_path, monkeypatch)
    newest = run / "checkpoint-2"
    assert set(json.loads((newest / MANIFEST).read_text())["files"]) >= {STATE_FILE, "policy.pt"}
    weights = newest / "policy.pt"
    data = bytearray(weights.read_bytes())
    data[-64:] = os.urandom(64)  # random bytes over the end: the same size, other weights
    weights.write_bytes(bytes(data))
    told = []
    found = loop.find_checkpoint(run, told.append)
    assert found[1] == run / "checkpoint-1"
    assert len(told) == 1 and str(weights) in told[0]
    assert f"resuming from the previous complete checkpoint {run / 'checkpoint-1'}" in told[0]
    with pytest.raises(DamagedCheckpoint, match="policy.pt is damaged"):
        loop.find_checkpoint(newest)  # named explicitly: no silent substitute


def test_an_empty_trainer_state_falls_back_and_never_crashes_the_error_path(tmp_path, monkeypatch):
    run = crashed_run(tmp_path, monkeypatch)
    (run / "checkpoint-2" / STATE_FILE).write_bytes(b"")
    (run / "checkpoint-2" / MANIFEST).unlink()  # as an older hasten saved it: no manifest
    told = []
    assert loop.find_checkpoint(run, told.append)[1] == run / "checkpoint-1"
    assert "is empty" in told[0]
    resumed = cli("train", "--resume", str(run / "checkpoint-2"), cwd=tmp_path)
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr
    assert resumed.stderr.strip().splitlines()[-1].startswith("resume error:")


def test_a_restore_of_an_unreadable_state_says_why_in_one_line(tmp_path):
    (tmp_path / STATE_FILE).write_bytes(b"")

    with pytest.raises(loop.CheckpointError, match=r"cannot read .*trainer_state.pt \(.*\)$"):
        loop.restore(None, RunDir(tmp_path.parent), tmp_path)


# ------------------------------------------------------------------ a full disk


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_complete_checkpoints(tmp_path, monkeypatch):
    run = crashed_run(tmp_path, monkeypatch)
    original = torch.save

    def full(obj, target, *args, **kwargs):
        original(obj, target, *args, **kwargs)
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 1088 vs 1024")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OutOfSpace) as caught:
        train(load_config(run / "config.yaml"), log=lambda _: None, resume=run)
    message = str(caught.value)
    assert "\n" not in message and str(run) in message and "needs about" in message and "free" in message
    assert not (run / "checkpoint").exists() and not list(run.glob(".checkpoint*"))  # nothing half-written
    assert loop.find_checkpoint(run)[1] == run / "checkpoint-2"  # the complete ones are untouched
    monkeypatch.setattr(torch, "save", original)  # space freed: the resume works
    summary = train(load_config(run / "config.yaml"), log=lambda _: None, resume=run)
    assert summary["status"] == "finished" and summary["steps"] == 3


def test_a_disk_full_at_the_first_save_leaves_no_run_directory(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OutOfSpace, match="no space left"):
        train(game_config(tmp_path, "full"), log=lambda _: None)
    assert not (tmp_path / "full").exists()


# ------------------------------------------------------------------ the end of a run


def test_a_run_killed_between_its_final_save_and_summary_resumes_to_write_it(tmp_path):
    summary = train(game_config(tmp_path, "ended", **{"game.eval_games": 8}), log=lambda _: None)
    run = Path(summary["run_dir"])
    (run / "summary.json").unlink()  # killed right after the final save
    metrics = (run / "metrics.jsonl").read_text()
    again = train(load_config(run / "config.yaml"), log=lambda _: None, resume=run)
    assert again["status"] == "finished" and json.loads((run / "summary.json").read_text())["steps"] == 3
    assert (run / "metrics.jsonl").read_text() == metrics  # no step ran again; the final eval did
    timeless = [{k: v for k, v in s["eval_after"].items() if k != "seconds"} for s in (again, summary)]
    assert timeless[0] == timeless[1]
    with pytest.raises(loop.CheckpointError, match="nothing to resume"):
        loop.find_checkpoint(run)


def test_an_interrupted_summary_does_not_copy_the_start_eval_as_the_end(tmp_path):
    class Stop(loop.Hook):
        def on_step(self, step, record):
            return True

    cfg = game_config(tmp_path, "stopped", **{"game.eval_games": 8, "eval.every": 0})
    run, _ = loop.open_run(cfg, None)
    from hasten.train.policy_loop import prepare_game

    summary = loop.run(GameJob(prepare_game(cfg, lambda _: None)), cfg, run, lambda _: None, callbacks=[Stop()])
    assert summary["status"] == "stopped" and "eval_before" in summary and "eval_after" not in summary


# ------------------------------------------------------------------ signals


def sigint_after(job_class: type, method: str, when):
    """Patch job_class.method to send this process SIGINT when `when(args)` holds (before the call)."""
    original = getattr(job_class, method)

    def patched(self, *args):
        if when(*args):
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args)

    return patched


def test_with_progress_off_a_signal_still_says_how_to_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(GameJob, "step", sigint_after(GameJob, "step", lambda step: step == 2))
    told = []
    summary = train(game_config(tmp_path, "quiet", **{"train.steps": 5}), log=told.append)
    assert summary["status"] == "interrupted" and summary["steps"] == 2
    assert f"interrupted at step 2; resume with: hasten train --resume {tmp_path / 'quiet'}" in told
    assert any(line.startswith("SIGINT: stopping after this step") for line in told)


def test_sft_says_how_to_resume_after_a_signal(tmp_path, monkeypatch):
    from hasten.errors import Interrupted
    from hasten.rft.sft import SFTJob, run_sft

    records_file = tmp_path / "rft.json"
    records_file.write_text(json.dumps([[f"What is {i} + {i}?", str(2 * i), f"<answer>{2 * i}</answer>"]
                                        for i in range(8)]))
    cfg = load_config(overrides=list({
        "model.name": "tiny", "model.lora": True, "model.lora_r": 4, "task.name": "arithmetic",
        "rft.data": str(records_file), "sft.epochs": 2, "sft.batch_size": 4, "eval.num_examples": 0,
        "output.dir": str(tmp_path / "runs"), "output.name": "sft", "output.progress": "off",
        "output.plot": False}.items()))
    monkeypatch.setattr(SFTJob, "step", sigint_after(SFTJob, "step", lambda step: step == 1))
    told = []
    with pytest.raises(Interrupted) as stop:
        run_sft(cfg, log=told.append)
    assert stop.value.saved and stop.value.exit_code == 130
    assert f"interrupted at step 1; resume with: hasten sft --resume {tmp_path / 'runs' / 'sft'}" in told


def test_a_signal_during_the_final_eval_interrupts_it_and_resume_finishes(tmp_path, monkeypatch):
    cfg = game_config(tmp_path, "final", **{"game.eval_games": 8, "eval.every": 0})
    with monkeypatch.context() as patch:
        patch.setattr(GameJob, "evaluate", sigint_after(GameJob, "evaluate", lambda step, run: step == 3))
        told = []
        summary = train(cfg, log=told.append)
    assert summary["status"] == "interrupted" and summary["exit_code"] == 130 and "eval_after" not in summary
    assert any(line.startswith("interrupted during the final eval") for line in told)
    run = tmp_path / "final"
    assert not [line for line in (run / "eval.jsonl").read_text().splitlines() if '"step": 3' in line]
    resumed = train(load_config(run / "config.yaml"), log=lambda _: None, resume=run)
    assert resumed["status"] == "finished" and set(resumed["eval_after"]) >= {"score_mean"}


@pytest.mark.parametrize("where", ["hasten.train.policy_loop.prepare_game", "hasten.train.policy_loop.make_trackers"])
def test_ctrl_c_during_startup_is_one_line_exit_130_and_leaves_no_directory(tmp_path, capsys, monkeypatch, where):
    from hasten.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(where, interrupted)
    code = main(["train", "--task", "fruit-catcher", f"--output.dir={tmp_path}", "--output.name=started"])
    assert code == 130 and capsys.readouterr().err.strip().splitlines() == ["interrupted (SIGINT); stopped at once"]
    assert not (tmp_path / "started").exists()


def test_a_closed_stdout_is_no_traceback(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "hasten.cli", "config"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    process.stdout.close()  # `| head` gone before the first line is written
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err and process.returncode == 141, err


# ------------------------------------------------------------------ threads chosen from the load


@pytest.fixture
def two_threads():
    """The governor moves between 1 thread and the threads the run starts with: 2 here."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_adaptive_threads_resume_bit_identically_where_the_choices_match(tmp_path, monkeypatch, two_threads):
    """Not pinned: speed.adaptive_threads picks 1 or 2 threads per phase from a scripted load (busy on odd
    steps), the same in both runs; the resumed run then equals the uninterrupted one bit for bit."""
    from hasten.kernels import threads as thread_module
    from hasten.train.trainer import GRPOJob

    step_now = [0]
    monkeypatch.setattr(thread_module, "busy_neighbours", lambda: 10_000 if step_now[0] % 2 else 0)
    original_step = GRPOJob.step

    def step(self, number):
        step_now[0] = number
        return original_step(self, number)

    monkeypatch.setattr(GRPOJob, "step", step)

    def make(name):
        return load_config(overrides=list({
            "model.name": "tiny", "task.name": "arithmetic", "train.steps": 4, "train.prompts_per_step": 2,
            "generation.num_generations": 2, "generation.max_new_tokens": 6, "eval.num_examples": 0,
            "output.dir": str(tmp_path), "output.name": name, "output.progress": "off", "output.plot": False,
            "output.save_every": 1, "speed.adaptive_threads": True}.items()))

    told = []
    reference = train(make("reference"), log=told.append)
    chosen = [json.loads(line)["threads/generate"] for line in (tmp_path / "reference" / "metrics.jsonl")
              .read_text().splitlines()]
    assert chosen == [1, 2, 1, 2]  # the threads followed the load: nothing pinned them
    with monkeypatch.context() as patch:
        patch.setattr(GRPOJob, "step", lambda self, number: (_ for _ in ()).throw(RuntimeError("killed"))
                      if number == 3 else step(self, number))
        with pytest.raises(RuntimeError):
            train(make("crashed"), log=lambda _: None)
    run = tmp_path / "crashed"
    told = []
    train(load_config(run / "config.yaml"), log=told.append, resume=run)
    assert any("speed.adaptive_threads" in line and "train.num_threads" in line for line in told)
    volatile = ("time/", "memory/", "tokens_per_second")
    strip = lambda path: [{k: v for k, v in json.loads(line).items() if not k.startswith(volatile)}
                          for line in path.read_text().splitlines()]
    assert strip(run / "metrics.jsonl") == strip(Path(reference["run_dir"]) / "metrics.jsonl")
    from safetensors.torch import load_file

    expected = load_file(Path(reference["run_dir"]) / "checkpoint" / "model.safetensors")
    actual = load_file(run / "checkpoint" / "model.safetensors")
    assert all(torch.equal(expected[key], actual[key]) for key in expected)
