"""speed.allocator: the CLI re-executes itself on tcmalloc where installed, else on mimalloc (the
cmeel-mimalloc wheel); results do not change.

The end-to-end tests need the library they switch to: libtcmalloc_minimal (Debian: libtcmalloc-minimal4)
or a loadable libmimalloc (a default dependency on Linux x86-64), and are skipped without it; the choice,
error and environment logic is tested everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hasten.cli import main
from hasten.config import ConfigError
from hasten.kernels import allocator

HAVE_TCMALLOC = allocator.find("tcmalloc") is not None
needs_tcmalloc = pytest.mark.skipif(not HAVE_TCMALLOC, reason="libtcmalloc_minimal is not installed")
HAVE_MIMALLOC = allocator.find("mimalloc") is not None
needs_mimalloc = pytest.mark.skipif(not HAVE_MIMALLOC, reason="no loadable libmimalloc (pip install cmeel-mimalloc)")
AUTO = allocator.resolve("auto")


def _libraries(monkeypatch, **found: str | None) -> None:
    """find() answers `found` (name -> library or None) instead of looking at this machine."""
    monkeypatch.setattr(allocator, "find", lambda name: found.get(name))
VOLATILE = ("time/", "memory/", "tokens_per_second")


def test_resolve_auto_and_missing_library(monkeypatch):
    _libraries(monkeypatch)
    monkeypatch.setattr(allocator, "_candidates", lambda name: [])
    assert allocator.resolve("auto") == "glibc"
    assert allocator.resolve("glibc") == "glibc"
    with pytest.raises(ConfigError, match=r"speed.allocator=tcmalloc: libtcmalloc_minimal.so not found.*apt install"):
        allocator.resolve("tcmalloc")
    with pytest.raises(ConfigError, match="speed.allocator='jemalloc'"):
        allocator.resolve("jemalloc")
    with pytest.raises(ConfigError, match=r"speed.allocator=mimalloc: libmimalloc.so not found.*pip install cmeel-mim"):
        allocator.resolve("mimalloc")
    _libraries(monkeypatch, mimalloc="/venv/cmeel.prefix/lib/libmimalloc.so")
    assert allocator.resolve("auto") == "mimalloc"  # no tcmalloc (a fresh machine): the wheel's mimalloc
    _libraries(monkeypatch, tcmalloc="libtcmalloc_minimal.so.4", mimalloc="/venv/cmeel.prefix/lib/libmimalloc.so")
    assert allocator.resolve("auto") == "tcmalloc"  # measured longest, so first where both are there


def test_a_mimalloc_that_does_not_load_is_passed_over_by_auto_and_named_by_the_error(monkeypatch, tmp_path):
    """The wheel's library needs libatomic.so.1: where a new process cannot preload it (here: a file that is
    no ELF at all), auto stays on glibc and speed.allocator=mimalloc is a one-line error quoting the loader."""
    broken = tmp_path / "libmimalloc.so"
    broken.write_text("not a shared object")
    monkeypatch.setattr(allocator, "_wheel_mimalloc", lambda: str(broken))
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert allocator.preload_error(str(broken))  # the loader's complaint
    assert allocator.find("mimalloc") is None and allocator.resolve("auto") == "glibc"
    with pytest.raises(ConfigError) as error:
        allocator.resolve("mimalloc")
    message = str(error.value)
    assert "\n" not in message and str(broken) in message and "libatomic1" in message and "ld.so" in message


@needs_mimalloc
def test_the_wheels_mimalloc_loads_and_is_seen(monkeypatch):
    """What find() returns is what a new process runs on once preloaded (loaded() reads its maps)."""
    library = allocator.find("mimalloc")
    assert allocator.preload_error(library) is None
    env = allocator.environment("mimalloc", {key: value for key, value in os.environ.items() if key != "LD_PRELOAD"})
    assert env["LD_PRELOAD"] == library and env["MIMALLOC_PURGE_DELAY"] == "-1"
    seen = subprocess.run([sys.executable, "-c", "from hasten.kernels.allocator import loaded; print(loaded())"],
                          env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert seen.stdout.strip() == "mimalloc", seen.stderr[-2000:]


def test_not_linux_means_no_preloaded_allocator(monkeypatch):
    """No LD_PRELOAD switch off Linux: auto keeps the system malloc instead of re-executing in vain."""
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator.find("tcmalloc") is None and allocator.find("mimalloc") is None
    assert allocator.resolve("auto") == "glibc"
    with pytest.raises(ConfigError, match="speed.allocator=mimalloc: it is switched by LD_PRELOAD, on Linux only"):
        allocator.resolve("mimalloc")


def test_environment_adds_and_strips_only_allocators(monkeypatch):
    _libraries(monkeypatch, tcmalloc="libtcmalloc_minimal.so.4", mimalloc="/venv/lib/libmimalloc.so")
    base = {"PATH": "/bin", "LD_PRELOAD": "/opt/libfoo.so:/usr/lib/libtcmalloc_minimal.so.4"}
    assert allocator.environment("glibc", base)["LD_PRELOAD"] == "/opt/libfoo.so"
    on_tcmalloc = allocator.environment("tcmalloc", base)
    assert on_tcmalloc["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4 /opt/libfoo.so"  # the user's, first
    assert allocator.environment("tcmalloc", {"LD_PRELOAD": "/opt/libfoo.so"})["LD_PRELOAD"] == \
        "libtcmalloc_minimal.so.4 /opt/libfoo.so"
    assert int(on_tcmalloc["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no stack trace per 1 GB tensor
    assert "LD_PRELOAD" not in allocator.environment("glibc", {"LD_PRELOAD": "libtcmalloc.so.4"})
    assert base["LD_PRELOAD"] == "/opt/libfoo.so:/usr/lib/libtcmalloc_minimal.so.4"  # a copy, not in place
    on_mimalloc = allocator.environment("mimalloc", base)  # one allocator at a time: tcmalloc goes
    assert on_mimalloc["LD_PRELOAD"] == "/venv/lib/libmimalloc.so /opt/libfoo.so"
    assert on_mimalloc["MIMALLOC_PURGE_DELAY"] == "-1"  # freed pages stay (docs/results/speedups-notes.md)
    assert allocator.environment("mimalloc", {"MIMALLOC_PURGE_DELAY": "10"})["MIMALLOC_PURGE_DELAY"] == "10"
    assert allocator.environment("tcmalloc", on_mimalloc)["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 /opt/libfoo.so"
    assert "LD_PRELOAD" not in allocator.environment("glibc", {"LD_PRELOAD": "/x/libmimalloc.so.3"})


def test_in_process_cannot_switch(monkeypatch):
    """The Python API cannot re-execute: it reports what runs, and says so in one line where that is not
    what was asked (speed and memory differ, results do not)."""
    monkeypatch.setattr(allocator, "loaded", lambda: "glibc")
    lines = []
    assert allocator.check_in_process("auto", lines.append) == "glibc"
    assert allocator.check_in_process("glibc", lines.append) == "glibc"
    assert lines == []
    assert allocator.check_in_process("tcmalloc", lines.append) == "glibc"
    assert len(lines) == 1 and "speed.allocator=tcmalloc: this process runs on glibc and cannot switch" in lines[0]
    with pytest.raises(ConfigError, match="speed.allocator='jemalloc'"):
        allocator.check_in_process("jemalloc", lines.append)


def test_a_preloaded_tcmalloc_counts_even_where_ldconfig_does_not_know_it(monkeypatch):
    """A tcmalloc the user preloaded by path (conda, a build of their own) is used, never stripped."""
    monkeypatch.setattr(allocator.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setenv("LD_PRELOAD", "/opt/conda/lib/libtcmalloc.so.4")
    assert allocator.find("tcmalloc") == "/opt/conda/lib/libtcmalloc.so.4"
    assert allocator.resolve("auto") == "tcmalloc"
    assert allocator.environment("tcmalloc")["LD_PRELOAD"] == "/opt/conda/lib/libtcmalloc.so.4"


def test_no_second_reexec(monkeypatch):
    """Re-executed once and still not on tcmalloc (a preload that failed): an error, not a loop."""
    _libraries(monkeypatch, tcmalloc="libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator, "loaded", lambda: "glibc")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed a second time"))
    monkeypatch.setenv(allocator.MARKER, f"tcmalloc:{os.getpid()}")  # this very process, re-executed
    with pytest.raises(ConfigError, match="still runs on glibc; set speed.allocator=glibc"):
        allocator.ensure("auto")


def test_the_marker_is_never_passed_on(monkeypatch):
    """A re-executed `hasten bench` or `hasten train` starts workers and `hasten train` children; they must
    not take the parent's re-execution for their own (that made B4's child exit 2)."""
    monkeypatch.setattr(allocator, "loaded", lambda: "glibc")
    monkeypatch.setenv(allocator.MARKER, "glibc")
    assert allocator.ensure("glibc") == "glibc"
    assert allocator.MARKER not in os.environ  # what this process starts next inherits no marker
    assert allocator.MARKER not in allocator.environment("glibc", {allocator.MARKER: "tcmalloc"})


def test_ensure_reexecutes_the_original_command_line(monkeypatch):
    """sys.orig_argv: interpreter flags (torchrun's -u) and the console script or -m form are kept."""
    _libraries(monkeypatch, tcmalloc="libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator, "loaded", lambda: "glibc")
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-u", "-m", "hasten.cli", "train", "--steps", "2"])
    monkeypatch.delenv(allocator.MARKER, raising=False)
    calls = []

    def fake_execve(path, args, env):
        calls.append((path, args, env))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", fake_execve)
    with pytest.raises(SystemExit):
        allocator.ensure("auto")
    (path, args, env), = calls
    assert path == sys.executable and args == [sys.executable, "-u", "-m", "hasten.cli", "train", "--steps", "2"]
    assert env["LD_PRELOAD"].startswith("libtcmalloc_minimal.so.4") and env[allocator.MARKER] == f"tcmalloc:{os.getpid()}"


def test_compare_starts_each_run_on_its_profiles_allocator(monkeypatch, tmp_path):
    """`hasten compare` and `bench --ablate` runs cannot switch in their own process: the parent starts each
    on the malloc its config asks for (baseline glibc, the others auto)."""
    from hasten import compare

    _libraries(monkeypatch, tcmalloc="libtcmalloc_minimal.so.4")
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc_minimal.so.4")
    monkeypatch.setenv(allocator.MARKER, "tcmalloc")  # as in a re-executed parent that never popped it
    seen = {}

    def fake_run(command, env, **kwargs):
        seen[json.loads(command[-1])["profile"]] = env
        return subprocess.CompletedProcess(command, 1, "", "stopped by the test")

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    for profile in ("baseline", "conservative"):
        with pytest.raises(compare.CompareError):
            compare.run_child(compare.RunSpec(profile, None, profile), 0, tmp_path, lambda text: None)
    assert "libtcmalloc" not in seen["baseline"].get("LD_PRELOAD", "")
    assert seen["conservative"]["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert allocator.MARKER not in seen["baseline"] and allocator.MARKER not in seen["conservative"]


def test_bad_value_exits_2(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--steps", "1", "--speed.allocator=jemalloc",
                 f"--output.dir={tmp_path}", "--output.name=r"])
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "speed.allocator" in error[0] and "jemalloc" in error[0]
    assert not (tmp_path / "r").exists()


ROOT = str(Path(__file__).resolve().parents[1])


def _train(tmp_path: Path, name: str, setting: str, env: dict[str, str], *extra: str) -> tuple[dict, list[dict]]:
    env = {**env, "PYTHONPATH": ROOT}  # this checkout's hasten, installed or not
    process = subprocess.run(
        [sys.executable, "-m", "hasten.cli", "train", "--model", "tiny", "--steps", "3", f"--speed.allocator={setting}",
         "--train.num_threads=1",  # one thread: neighbours cannot change the reduction order between the runs
         f"--output.dir={tmp_path}", f"--output.name={name}", "--output.progress=off", "--output.plot=false",
         "--eval.num_examples=8", *extra],
        env=env, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-2000:]
    run = tmp_path / name
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
               for line in (run / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run / "summary.json").read_text()), metrics


@needs_tcmalloc
def test_cli_reexecutes_and_results_do_not_change(tmp_path):
    """`hasten train` started on glibc re-executes itself on tcmalloc (and back), and both runs log the same
    losses, rewards and gradient norms: the allocator places memory, it does not compute."""
    plain = allocator.environment("glibc")
    preloaded = allocator.environment("tcmalloc")
    on_tcmalloc, metrics_tcmalloc = _train(tmp_path, "t", "tcmalloc", plain)  # glibc -> re-exec onto tcmalloc
    on_glibc, metrics_glibc = _train(tmp_path, "g", "glibc", preloaded)  # tcmalloc preloaded -> re-exec onto glibc
    assert on_tcmalloc["allocator"] == "tcmalloc" and on_glibc["allocator"] == "glibc"
    assert len(metrics_tcmalloc) == len(metrics_glibc) == 3
    assert metrics_tcmalloc == metrics_glibc
    assert on_tcmalloc["eval_after"]["accuracy"] == on_glibc["eval_after"]["accuracy"]


@needs_mimalloc
def test_cli_reexecutes_onto_mimalloc_and_results_do_not_change(tmp_path):
    """The same on mimalloc, the fresh machine's `auto`: started on glibc (or on tcmalloc), `hasten train`
    re-executes onto the wheel's mimalloc and logs what glibc logs."""
    on_mimalloc, metrics_mimalloc = _train(tmp_path, "m", "mimalloc", allocator.environment("glibc"))
    on_glibc, metrics_glibc = _train(tmp_path, "g", "glibc", allocator.environment("mimalloc"))
    assert on_mimalloc["allocator"] == "mimalloc" and on_glibc["allocator"] == "glibc"
    assert len(metrics_mimalloc) == len(metrics_glibc) == 3
    assert metrics_mimalloc == metrics_glibc
    assert on_mimalloc["eval_after"]["accuracy"] == on_glibc["eval_after"]["accuracy"]


@pytest.mark.skipif(AUTO == "glibc", reason="neither tcmalloc nor mimalloc loads here: auto is glibc")
def test_a_child_of_a_reexecuted_process_trains(tmp_path):
    """`hasten train` started from a process that was itself re-executed (its environment as B4's and
    compare's children get it) re-executes on its own and trains."""
    inherited = {**allocator.environment("glibc"), allocator.MARKER: "tcmalloc:1"}  # a parent's marker, leaked
    summary, metrics = _train(tmp_path, "c", "auto", inherited)
    assert summary["allocator"] == AUTO and len(metrics) == 3


def _sft(tmp_path: Path, name: str, env: dict[str, str], *extra: str) -> dict:
    """`hasten sft` as its own process (the CLI entry, so it may re-execute) on the tiny model; its report."""
    from hasten.rft.data import RFTRecord, write_records
    from hasten.rft.profiles import load_rft_config
    from hasten.tasks import make_task

    task = make_task(load_rft_config("sft", None, [("task.num_train", 4)]).task)
    records = [RFTRecord(r["question"], r["answer"], f"<answer>{r['answer']:g}</answer>") for r in task.train_rows]
    data = write_records(tmp_path / f"{name}.json", records)
    process = subprocess.run(
        [sys.executable, "-m", "hasten.cli", "sft", "--model", "tiny", "--data", str(data), "--json",
         "--task.num_train=4", "--sft.epochs=1", "--sft.batch_size=2", "--eval.num_examples=0",
         "--train.num_threads=1", f"--output.dir={tmp_path}", f"--output.name={name}", "--output.progress=off",
         *extra],
        env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-2000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


@needs_tcmalloc
def test_sft_reexecutes_per_profile_and_losses_do_not_change(tmp_path):
    """`hasten sft` picks its malloc as `hasten train` does: the default (auto) re-executes onto tcmalloc, the
    plain profile (the reference) onto glibc, and the same settings give the same losses on either."""
    on_tcmalloc = _sft(tmp_path, "t", allocator.environment("glibc"))
    on_glibc = _sft(tmp_path, "g", allocator.environment("tcmalloc"), "--speed.allocator=glibc")
    plain = _sft(tmp_path, "p", allocator.environment("tcmalloc"), "--profile", "plain")
    assert on_tcmalloc["settings"]["allocator"] == "tcmalloc"
    assert on_glibc["settings"]["allocator"] == "glibc" and plain["settings"]["allocator"] == "glibc"
    assert (on_tcmalloc["first_loss"], on_tcmalloc["final_loss"]) == (on_glibc["first_loss"], on_glibc["final_loss"])
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["allocator"] == "tcmalloc"
