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
import shutil
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
            "--output.plot=false", "--output.save_every=1", "--json", *extra]


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
    # progress off: the run directory's line goes to stdout too (a view names it on stderr otherwise)
    done = shell(redirection, *game_args(tmp_path, "run", "--output.progress=off"))
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
                                                  "can't allocate memory: you tried to allocate 8589934592 bytes."),
                                     None],
                         ids=["onednn", "MemoryError", "torch", "a real allocation"])
def test_an_allocation_failure_mid_run_is_one_line_a_failed_summary_and_exit_2(tmp_path, capsys, monkeypatch, failure):
    from hasten.train.policy_loop import GameJob

    real_step = GameJob.step

    def step(self, number):
        if number == 3:
            if failure is None:  # more than any address space: torch's allocator itself refuses
                torch.empty((1 << 60,), dtype=torch.uint8)
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


# ------------------------------------------------------------------ 2. paths and environments


def test_a_run_name_that_is_not_utf8_saves_and_resumes_under_the_c_locale(tmp_path):
    """Any byte but '/' may be in a name; the tokenizer's save (Rust) took only UTF-8 paths."""
    name = b"run-\xff\xfe"
    locale = {"LC_ALL": "C", "LANG": "C"}
    args = [arg.encode() for arg in tiny_args(tmp_path, "NAME", "--output.progress=off")]
    args = [b"--output.name=" + name if arg == b"--output.name=NAME" else arg for arg in args]
    first = shell('exec "$@"', *args, env=locale)
    assert first.returncode == 0, first.stderr.decode(errors="replace")[-2000:]
    run = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), name)))
    assert (run / "checkpoint-1" / "tokenizer.json").is_file() and (run / "checkpoint" / "tokenizer.json").is_file()
    shutil.rmtree(run / "checkpoint")  # killed before its final save: the resume runs step 2 again from checkpoint-1
    (run / "summary.json").unlink()
    resumed = shell('exec "$@"', b"train", b"--resume", os.fsencode(run), b"--output.progress=off", env=locale)
    assert resumed.returncode == 0, resumed.stderr.decode(errors="replace")[-2000:]
    assert b"Traceback" not in resumed.stderr
    finished(run, steps=2)


@pytest.fixture
def read_only_home(tmp_path):
    """A HOME on a read-only file system (root is refused writes there, unlike a chmod 555 directory)."""
    home = tmp_path / "home"
    home.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(home)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield home
    finally:
        subprocess.run(["umount", "-l", str(home)], capture_output=True)


@pytest.mark.parametrize("home", ["read-only", "missing"])
def test_a_read_only_or_missing_home_trains_lora_on_tiny(tmp_path, read_only_home, home):
    environment = dict(os.environ, HOME=str(read_only_home if home == "read-only" else read_only_home / "missing"),
                       PYTHONPATH=str(ROOT))
    environment.pop("HASTEN_CACHE", None)
    done = subprocess.run([sys.executable, "-m", "hasten.cli", *tiny_args(tmp_path, "lora", "--model.lora=true",
                                                                           "--output.progress=off")],
                          capture_output=True, text=True, timeout=600, env=environment, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    finished(tmp_path / "lora", steps=2)
    assert (tmp_path / "lora" / "checkpoint" / "adapter_model.safetensors").is_file()


def forbid_model_load(monkeypatch) -> None:
    """Loading the model fails the test: what is checked here must be checked before it."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before a check that needs no model")

    monkeypatch.setattr("hasten.train.trainer.load_policy", loaded)


def test_a_resume_one_may_not_write_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from hasten.train.trainer import train
    from hasten.config import load_config

    config = load_config(overrides=list({"model.name": "tiny", "task.name": "arithmetic", "train.steps": 2,
                                         "train.prompts_per_step": 2, "generation.num_generations": 2,
                                         "generation.max_new_tokens": 4, "eval.num_examples": 0,
                                         "output.dir": str(tmp_path), "output.name": "theirs",
                                         "output.progress": "off", "output.plot": False,
                                         "output.save_every": 1}.items()))
    run = Path(train(config, log=lambda _: None)["run_dir"])
    (run / "summary.json").unlink()
    real_open = os.open

    def refused(path, flags, *args, **kwargs):  # another user's run: its lock cannot be opened for writing
        if str(path).endswith(".lock"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    forbid_model_load(monkeypatch)
    code = main(["train", "--resume", str(run)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"run error: cannot resume {run}: permission"), lines


def test_a_run_name_too_long_for_the_file_system_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    forbid_model_load(monkeypatch)
    code = main(tiny_args(tmp_path, "x" * 256))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == ["config error: output.name is 256 bytes long; a name on this file system may "
                                   "have at most 255"], lines
    assert list(tmp_path.iterdir()) == []


def test_an_unusable_bench_report_directory_is_refused_before_measuring(tmp_path, capsys, monkeypatch):
    import hasten.bench as bench

    monkeypatch.setattr(bench, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("measured first")))
    (tmp_path / "file").write_text("")
    code = main(["bench", "--workloads", "B1", "--quick", "--report", str(tmp_path / "file" / "report")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("bench error: --report"), lines


# ------------------------------------------------------------------ 7. one output directory, one run


@pytest.mark.parametrize("earlier_run", ["set_aside", "beside"])
def test_a_run_stalled_before_its_config_still_owns_its_directory(tmp_path, monkeypatch, earlier_run):
    """The first run stalls (a slow disk) before config.yaml; a second one started meanwhile with the same
    output directory never writes into it: refused through the API's set_aside, the next name otherwise."""
    import threading

    from hasten.config import load_config
    from hasten.train import loop
    from hasten.train.integrity import RunInUse

    def config(seed: int):
        return load_config(overrides=[("task.name", "fruit-catcher"), ("output.dir", str(tmp_path)),
                                      ("output.name", "out"), ("output.earlier_run", earlier_run),
                                      ("train.seed", seed)])

    stalled, go_on = threading.Event(), threading.Event()
    real_save = outputs.save_config

    def slow_disk(cfg, path):
        if cfg.train.seed == 1:
            stalled.set()
            go_on.wait(60)
        real_save(cfg, path)

    monkeypatch.setattr(outputs, "save_config", slow_disk)
    opened = {}
    first = threading.Thread(target=lambda: opened.update(first=loop.open_run(config(1), None)[0]))
    first.start()
    try:
        assert stalled.wait(60)
        if earlier_run == "set_aside":
            with pytest.raises(RunInUse):
                loop.open_run(config(2), None)
        else:
            second = loop.open_run(config(2), None)[0]
            assert second.path == tmp_path / "out-2"
            second.lock.release()
    finally:
        go_on.set()
        first.join(60)
    opened["first"].lock.release()
    assert opened["first"].path == tmp_path / "out"
    assert load_config(tmp_path / "out" / "config.yaml").train.seed == 1
