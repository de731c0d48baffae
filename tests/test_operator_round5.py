"""Operator scenarios of issue 54 (reliability, round 5): a trained step is never lost to the terminal, the
disk or the model cache. Output closed, full or gone never ends a run; the model cache proves its weights;
a full disk or a failed allocation is one line, a failed summary and the last whole checkpoint; any bytes
in a run's path save and resume; checks that need no model come before it; one run per directory.

The game policy trains in a second, so the runs here are real ones; `tiny` where a language model's
files (the tokenizer) matter. tests/test_operator_cache.py's small fake conversion stands in for the
GGUF's."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hasten.cli import main
from hasten.models import model_directory, smollm2
from hasten.models.smollm2 import WEIGHTS, converted_dir
from hasten.train import outputs
from hasten.train.integrity import verify
from hasten.train.outputs import RunDir

from test_operator_cache import cache, fake_save_plain  # noqa: F401  (the fixture, and what it converts)

ROOT = Path(__file__).parents[1]


def game_args(root: Path, name: str, *extra: str) -> list[str]:
    return ["train", "--task", "fruit-catcher", "--steps", "3", "--game.num_starts=2", "--game.games_per_start=4",
            "--game.episode_steps=10", "--game.eval_games=0", f"--output.dir={root}", f"--output.name={name}",
            "--output.plot=false", "--output.save_every=1", *extra]


def tiny_args(root: Path, name: str, *extra: str) -> list[str]:
    """A GRPO run of the tiny model: its model load and plan are log lines on stderr."""
    return ["train", "--model", "tiny", "--task", "arithmetic", "--steps", "2", "--train.prompts_per_step=2",
            "--generation.num_generations=2", "--generation.max_new_tokens=4", "--eval.num_examples=0",
            f"--output.dir={root}", f"--output.name={name}", "--output.plot=false", "--output.save_every=1", *extra]


def shell(command: str, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`hasten ARGS` run by sh with `command`'s redirections ("$@" stands for hasten's command line)."""
    hasten = [sys.executable, "-m", "hasten.cli", *args]
    return subprocess.run(["sh", "-c", command, "sh", *hasten], capture_output=True, timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def finished(run: Path, steps: int = 3) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == steps, summary
    assert (run / "checkpoint" / outputs.STATE_FILE).is_file()
    return summary


# ------------------------------------------------------------------ 1. output can never end a run


@pytest.mark.parametrize("redirection", ['exec "$@" >&-', 'exec "$@" 2>&-', 'exec "$@" >&- 2>&-',
                                         'exec "$@" 2>/dev/full', 'exec "$@" >/dev/full 2>/dev/full'])
def test_a_closed_or_full_stdout_or_stderr_never_ends_a_run(tmp_path, redirection):
    """The allocator's re-execution included (`python -m hasten.cli` is the process entry)."""
    done = shell(redirection, *game_args(tmp_path, "run"))
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    summary = finished(tmp_path / "run")
    if ">" in redirection.split("2>")[0]:  # stdout closed or full: its final lines are in the run's log
        record = (tmp_path / "run" / "output.log").read_text().splitlines()
        assert f"run directory: {tmp_path / 'run'}" in record and json.loads(record[-1]) == summary


@pytest.mark.parametrize("redirection", ['exec "$@" 2>/dev/full', 'exec "$@" >&- 2>&-'])
def test_a_language_model_run_with_stderr_full_or_closed_trains_and_keeps_its_log_lines(tmp_path, redirection):
    """A GRPO run says what it loads on stderr before its directory exists: those lines reach output.log."""
    done = shell(redirection, *tiny_args(tmp_path, "tiny"))
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    finished(tmp_path / "tiny", steps=2)
    record = (tmp_path / "tiny" / "output.log").read_text()
    assert record.startswith("loading model tiny ...") and "training 2 steps" in record


@pytest.mark.parametrize("read_lines", [0, 3])
def test_a_pipe_whose_reader_left_never_ends_a_run(tmp_path, read_lines):
    """`hasten train ... 2>&1 | head -3`: the reader leaves (at once, or after 3 lines); the run trains to its
    end, exits 0, and what it would have printed after is in output.log."""
    process = subprocess.Popen([sys.executable, "-m", "hasten.cli", *game_args(tmp_path, "piped", "--steps", "20")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    for _ in range(read_lines):
        process.stdout.readline()
    process.stdout.close()
    assert process.wait(timeout=300) == 0
    summary = finished(tmp_path / "piped", steps=20)
    if read_lines == 0:  # nothing could be shown: the final line is in the record
        assert json.loads((tmp_path / "piped" / "output.log").read_text().splitlines()[-1]) == summary


def test_a_command_whose_product_is_its_output_still_exits_141_on_a_closed_pipe():
    process = subprocess.Popen([sys.executable, "-m", "hasten.cli", "models"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141 and b"Traceback" not in err, err


# ------------------------------------------------------------------ 4. the model cache proves what it loads


def flip(path: Path, offset: int) -> None:
    """Change one byte of `path` in place (a bit flipped on the disk, an editor's slip)."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_cached_weights_is_converted_again_in_one_line(cache):
    converted_dir(log=lambda _: None)
    weights = cache / WEIGHTS
    flip(weights, weights.stat().st_size - 3)  # a tensor's value: size and header unchanged
    told = []
    assert model_directory("smollm2-135m", log=told.append) == cache and len(cache.conversions) == 2
    assert len(told) == 2 and told[0] == (f"the cached model in {cache} is damaged ({WEIGHTS} is damaged (its sha256 "
                                          "differs from the converted one)); converting it again ...")
    assert smollm2.cache_damage(cache, full=True) == ""


@pytest.mark.parametrize("change", [(b'"F32"', b'"I32"'), (b'"weight"', b'"weighu"')])
def test_a_changed_safetensors_header_is_converted_again_never_a_wrong_dtype(cache, change):
    converted_dir(log=lambda _: None)
    weights = cache / WEIGHTS
    data = weights.read_bytes()
    assert change[0] in data[:200]
    weights.write_bytes(data.replace(change[0], change[1], 1))  # same length: the header still parses
    told = []
    model_directory("smollm2-135m", log=told.append)
    assert len(cache.conversions) == 2 and "is damaged (model.safetensors is damaged" in told[0]
    from safetensors.torch import load_file

    assert str(load_file(cache / WEIGHTS)["weight"].dtype) == "torch.float32"


def test_the_weights_are_hashed_once_per_change_of_the_file(cache, monkeypatch):
    converted_dir(log=lambda _: None)
    hashed = []
    real = smollm2.sha256_file
    monkeypatch.setattr(smollm2, "sha256_file", lambda path, *a: (hashed.append(Path(path).name), real(path, *a))[1])
    converted_dir(log=lambda _: None)
    converted_dir(log=lambda _: None)
    assert WEIGHTS not in hashed  # proven at conversion, in this very file state
    weights = cache / WEIGHTS
    before = weights.stat()
    flip(weights, before.st_size - 3)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # its mtime set back: the ctime still moved
    told = []
    converted_dir(log=told.append)
    assert hashed.count(WEIGHTS) >= 1 and len(cache.conversions) == 2 and "is damaged" in told[0]


def test_hasten_models_shows_the_cached_model_state(cache, capsys):
    def shown() -> str:
        assert main(["models"]) == 0
        return capsys.readouterr().out.splitlines()[0]

    assert shown().endswith(f"cached at {cache}: not converted yet (the first run converts it)")
    converted_dir(log=lambda _: None)
    assert shown().endswith(f"cached at {cache}: whole (every file's sha256 matches its manifest)")
    flip(cache / WEIGHTS, (cache / WEIGHTS).stat().st_size - 3)
    assert "damaged: model.safetensors is damaged" in shown() and smollm2.cache_damage(cache).startswith(WEIGHTS)


# ------------------------------------------------------------------ 3. resource exhaustion


def failed_run(run: Path, capsys, code: int, resource: str) -> str:
    """The run ended in one line naming `resource`, exit 2, summary.json "failed", its last checkpoint whole."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert resource in lines[0] and "Traceback" not in lines[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and resource in summary["error"], summary
    last = RunDir(run).latest_checkpoint()
    verify(last)  # whole: its manifest matches
    assert str(last) in lines[0] or "checkpoint-" in lines[0]
    assert not (run / outputs.RESERVE).exists()
    return lines[0]


def no_space(path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


@pytest.mark.parametrize("where", ["metrics.jsonl", "summary.json", "checkpoint-3"])
def test_a_disk_that_fills_between_checkpoints_is_one_line_a_failed_summary_and_exit_2(tmp_path, capsys, monkeypatch,
                                                                                       where):
    if where == "metrics.jsonl":  # step 3's line
        real_append, lines = outputs._append_json_line, []

        def append(path, record):
            lines.append(path.name)
            if lines.count("metrics.jsonl") == 3 and path.name == "metrics.jsonl":
                raise no_space(path)
            real_append(path, record)

        monkeypatch.setattr(outputs, "_append_json_line", append)
    elif where == "summary.json":  # the end's summary: the failed one is written in its place
        real_write, writes = outputs._write_atomically, []

        def write(path, data):
            writes.append(path.name)
            if writes.count("summary.json") == 1 and path.name == "summary.json":
                raise no_space(path)
            real_write(path, data)

        monkeypatch.setattr(outputs, "_write_atomically", write)
    else:  # torch.save of step 3's trainer state
        real_save = torch.save

        def save(state, target, *args, **kwargs):
            if "checkpoint-3" in str(target):
                raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                                   "file data/0: file write failed")
            real_save(state, target, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)
    code = main(game_args(tmp_path, "full", "--steps", "4", "--output.progress=off"))
    failed_run(tmp_path / "full", capsys, code, "no space left on the disk of")


@pytest.mark.parametrize("failure", [RuntimeError("could not create a primitive"), MemoryError(),
                                     RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                                                  "can't allocate memory: you tried to allocate 8589934592 bytes.")],
                         ids=["onednn", "MemoryError", "torch"])
def test_an_allocation_failure_mid_run_is_one_line_a_failed_summary_and_exit_2(tmp_path, capsys, monkeypatch, failure):
    from hasten.train.policy_loop import GameJob

    real_step = GameJob.step

    def step(self, number):
        if number == 3:
            raise failure
        return real_step(self, number)

    monkeypatch.setattr(GameJob, "step", step)
    code = main(game_args(tmp_path, "oom", "--steps", "4", "--output.progress=off"))
    line = failed_run(tmp_path / "oom", capsys, code, "out of memory")
    assert line.endswith(f"resume with: hasten train --resume {tmp_path / 'oom'}") and "checkpoint-2" in line


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_real_small_disk_that_fills_mid_run_keeps_the_last_checkpoint_and_writes_a_failed_summary(
        small_disk, capsys, monkeypatch):
    """A tmpfs that another writer fills during step 3: whichever write of the run meets it first."""
    from hasten.train.policy_loop import GameJob

    real_step = GameJob.step

    def step(self, number):
        if number == 3:  # someone else takes every free byte
            with open(small_disk / "filler", "wb") as filler:
                try:
                    while True:
                        filler.write(bytes(1 << 16))
                        filler.flush()
                except OSError:
                    pass
        return real_step(self, number)

    monkeypatch.setattr(GameJob, "step", step)
    code = main(game_args(small_disk, "run", "--steps", "6", "--output.progress=off"))
    failed_run(small_disk / "run", capsys, code, "no space left on the disk of")
