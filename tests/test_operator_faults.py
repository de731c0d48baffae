"""Operator faults of issue 40 around a run directory: a disk already full when the run starts, modes that
honour the umask (another user evaluates a checkpoint; a resume of a run one cannot write is one line),
SIGHUP, a kill during checkpoint pruning, a resume hint with spaces in its path, and the API's
save_total_limit. The game policy trains in a second, so the runs here are real ones."""

from __future__ import annotations

import errno
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hasten.cli import main
from hasten.config import load_config
from hasten.train import outputs
from hasten.train.integrity import verify
from hasten.train.policy_loop import GameJob
from hasten.train.trainer import train

ROOT = Path(__file__).parents[1]
NOBODY = 65534


def game_config(root: Path, name: str, **extra):
    return load_config(overrides=list({
        "task.name": "fruit-catcher", "train.steps": 3, "game.num_starts": 2, "game.games_per_start": 4,
        "game.episode_steps": 10, "game.eval_games": 0, "output.dir": str(root), "output.name": name,
        "output.progress": "off", "output.plot": False, "output.save_every": 1, **extra}.items()))


def game_args(root: Path, name: str, *extra: str) -> list[str]:
    return ["train", "--task", "fruit-catcher", "--steps", "3", "--game.num_starts=2", "--game.games_per_start=4",
            "--game.episode_steps=10", "--game.eval_games=0", f"--output.dir={root}", f"--output.name={name}",
            "--output.progress=off", "--output.plot=false", "--output.save_every=1", *extra]


@pytest.fixture
def umask():
    """Set the process umask for one test; the previous one comes back after."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield lambda value: os.umask(value)
    os.umask(previous)


def modes(root: Path) -> dict[str, int]:
    return {path.relative_to(root).as_posix(): stat.S_IMODE(path.stat().st_mode) for path in [root, *root.rglob("*")]}


# ------------------------------------------------------------------ a disk already full


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["lock", "config"])
def test_a_disk_full_when_the_run_starts_is_one_line_and_leaves_no_directory(tmp_path, capsys, monkeypatch, where):
    if where == "lock":  # the pid written into .lock (integrity.RunLock)
        monkeypatch.setattr(os, "pwrite", _full)
    else:  # config.yaml, the first file of a fresh run
        monkeypatch.setattr(outputs, "save_config", _full)
    code = main(game_args(tmp_path / "runs", "full"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("run error: no space left on the disk of") and str(tmp_path / "runs") in lines[0]
    assert not (tmp_path / "runs" / "full").exists()


# ------------------------------------------------------------------ modes and other users


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_a_run_directory_honours_the_umask(tmp_path, umask, mask):
    umask(mask)
    summary = train(game_config(tmp_path, "modes", **{"train.steps": 3}), log=lambda _: None)
    found = modes(Path(summary["run_dir"]))
    assert "checkpoint-2" in found and "checkpoint/manifest.json" in found
    for name, mode in found.items():
        directory = (Path(summary["run_dir"]) / name).is_dir()
        assert mode == (0o777 if directory else 0o666) & ~mask, (name, oct(mode))


def test_a_resume_of_a_run_one_cannot_write_is_one_line(tmp_path, capsys, monkeypatch):
    run = Path(train(game_config(tmp_path, "theirs", **{"train.steps": 2}), log=lambda _: None)["run_dir"])
    (run / "summary.json").unlink()  # killed after its final save: a resume has work to do
    real_open = os.open

    def refused(path, flags, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    code = main(["train", "--resume", str(run)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"run error: cannot resume {run}: permission denied writing {run / '.lock'}")
    assert f"owned by uid {os.getuid()}" in lines[0]


def as_nobody(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                           "-m", "hasten.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(cwd)})


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as a second user")
def test_another_user_evaluates_a_checkpoint_and_gets_one_line_resuming_it(umask):
    """Real users: the run is root's (umask 022); uid nobody evaluates its checkpoint and cannot resume it."""
    umask(0o022)
    shared = Path(tempfile.mkdtemp(prefix="hasten-shared-"))
    try:
        shared.chmod(0o755)
        run = Path(train(game_config(shared, "team", **{"train.steps": 2}), log=lambda _: None)["run_dir"])
        (run / "summary.json").unlink()
        evaluated = as_nobody("eval", "--task", "fruit-catcher", "--model", str(run / "checkpoint"),
                              "--game.eval_games=4", "--game.episode_steps=10", "--json", cwd=shared)
        assert evaluated.returncode == 0, evaluated.stderr
        assert "score_mean" in json.loads(evaluated.stdout.strip().splitlines()[-1])
        resumed = as_nobody("train", "--resume", str(run), cwd=shared)
        lines = resumed.stderr.strip().splitlines()
        assert resumed.returncode == 2 and len(lines) == 1, resumed.stderr
        assert lines[0].startswith(f"run error: cannot resume {run}: permission denied") and "uid 0" in lines[0]
        (run / "checkpoint").chmod(0o700)  # as an older hasten saved it: still one line, not a traceback
        hidden = as_nobody("eval", "--task", "fruit-catcher", "--model", str(run / "checkpoint"),
                           "--game.eval_games=4", "--game.episode_steps=10", "--json", cwd=shared)
        lines = hidden.stderr.strip().splitlines()
        assert hidden.returncode == 2 and len(lines) == 1 and "permission denied" in lines[0], hidden.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# ------------------------------------------------------------------ signals and files


HUNG_UP = """
import os, signal, sys
from hasten.cli import main
from hasten.train.policy_loop import GameJob

original = GameJob.step
def step(self, number):
    if number == 2:
        os.kill(os.getpid(), signal.SIGHUP)  # the terminal closed
    return original(self, number)
GameJob.step = step
sys.exit(main(sys.argv[1:]))
"""


def test_sighup_saves_a_checkpoint_and_the_summary_as_sigterm_does(tmp_path):
    done = subprocess.run([sys.executable, "-c", HUNG_UP, *game_args(tmp_path, "hup", "--steps", "5")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 128 + signal.SIGHUP, done.stderr
    summary = json.loads((tmp_path / "hup" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGHUP" and summary["steps"] == 2
    assert (tmp_path / "hup" / "checkpoint-2" / outputs.STATE_FILE).is_file()
    assert f"resume with: hasten train --resume {tmp_path / 'hup'}" in done.stderr
    resumed = main(["train", "--resume", str(tmp_path / "hup")])
    assert resumed == 0 and json.loads((tmp_path / "hup" / "summary.json").read_text())["steps"] == 5


def test_closing_the_terminal_stops_the_run_with_a_checkpoint_and_exit_129(tmp_path):
    """A real hang-up: the run's controlling terminal (a pty) closes, so SIGHUP comes and every later
    write to the terminal fails with EIO (the live progress view's, the final summary line's)."""
    import pty

    pid, terminal = pty.fork()
    if pid == 0:  # the child: `hasten train` on the pty, as in a terminal window
        os.environ["PYTHONPATH"] = str(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "hasten.cli", *game_args(tmp_path, "window", "--steps",
                                  "100000", "--output.progress=auto", "--output.save_every=1000")])
    seen = b""
    while b"run directory" not in seen:  # step 1 is done
        try:
            seen += os.read(terminal, 4096)
        except OSError:
            break
    os.close(terminal)  # the window closes
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGHUP, seen.decode(errors="replace")[-2000:]
    summary = json.loads((tmp_path / "window" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGHUP"
    assert (tmp_path / "window" / f"checkpoint-{summary['steps']}" / outputs.STATE_FILE).is_file()


class Killed(BaseException):
    """kill -9 in the middle of deleting a directory (nothing after it runs)."""


def test_a_kill_during_pruning_leaves_no_half_deleted_checkpoint_after_the_resume(tmp_path, monkeypatch):
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        weights = sorted(Path(path).glob("*.pt"))
        if weights and "checkpoint-1" in Path(path).name:
            for name in ("policy.pt", "manifest.json"):
                (Path(path) / name).unlink(missing_ok=True)  # some files gone, the rest still there
            raise Killed
        return real_rmtree(path, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(shutil, "rmtree", killed_midway)
        with pytest.raises(Killed):
            train(game_config(tmp_path, "pruned", **{"output.save_total_limit": 1}), log=lambda _: None)
    run = tmp_path / "pruned"
    assert not (run / "checkpoint-1").exists()  # never visible half-deleted, even before the resume
    summary = train(load_config(run / "config.yaml"), log=lambda _: None, resume=run)
    assert summary["status"] == "finished"
    left = sorted(path.name for path in run.iterdir() if "checkpoint" in path.name)
    assert left == ["checkpoint", "checkpoint-2"], left  # the leftover of the killed prune is gone
    for checkpoint in left:
        verify(run / checkpoint)


def test_the_printed_resume_command_quotes_a_path_with_spaces(tmp_path, monkeypatch):
    original = GameJob.step

    def step(self, number):
        if number == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, number)

    monkeypatch.setattr(GameJob, "step", step)
    told = []
    summary = train(game_config(tmp_path / "my runs", "first try", **{"train.steps": 5}), log=told.append)
    run = tmp_path / "my runs" / "first try"
    command = f"hasten train --resume {shlex.quote(str(run))}"
    assert summary["status"] == "interrupted" and f"interrupted at step 2; resume with: {command}" in told
    saved = json.loads((run / "checkpoint-2" / outputs.STATE_SUMMARY).read_text())["resume"]
    assert shlex.split(saved) == ["hasten", "train", "--resume", str(run / "checkpoint-2")]


# ------------------------------------------------------------------ the API's save_total_limit


@pytest.mark.parametrize("save_only_model", [False, True])
def test_save_total_limit_on_the_api_path_keeps_that_many_checkpoints(tmp_path, save_only_model):
    from hasten import GRPOConfig, GRPOTrainer

    def reward_len(completions, **kwargs):
        return [float(len(completion)) for completion in completions]

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=5, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, logging_steps=1, disable_tqdm=True, save_steps=1, save_total_limit=2,
                      save_only_model=save_only_model)
    rows = [{"prompt": f"Tell me about {word}:"} for word in ("cats", "dogs", "owls", "bees")]
    GRPOTrainer(model="tiny", reward_funcs=reward_len, args=args, train_dataset=rows).train()
    numbered = sorted(path.name for path in (tmp_path / "run").glob("checkpoint-*"))
    assert numbered == ["checkpoint-3", "checkpoint-4"], numbered
