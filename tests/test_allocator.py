"""speed.allocator: the CLI re-executes itself on tcmalloc where installed; results do not change.

The end-to-end tests need libtcmalloc_minimal on the machine (Debian: libtcmalloc-minimal4) and
are skipped without it; the choice, error and environment logic is tested everywhere.
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
from hasten.speed import allocator

HAVE_TCMALLOC = allocator.find_tcmalloc() is not None
needs_tcmalloc = pytest.mark.skipif(not HAVE_TCMALLOC, reason="libtcmalloc_minimal is not installed")
VOLATILE = ("time/", "memory/", "tokens_per_second")


def test_resolve_auto_and_missing_library(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert allocator.resolve("auto") == "glibc"
    assert allocator.resolve("glibc") == "glibc"
    with pytest.raises(ConfigError, match=r"speed.allocator=tcmalloc: libtcmalloc_minimal.so not found.*apt install"):
        allocator.resolve("tcmalloc")
    with pytest.raises(ConfigError, match="speed.allocator='jemalloc'"):
        allocator.resolve("jemalloc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    assert allocator.resolve("auto") == "tcmalloc"


def test_not_linux_means_no_tcmalloc(monkeypatch):
    """No LD_PRELOAD switch off Linux: auto keeps the system malloc instead of re-executing in vain."""
    monkeypatch.setattr(sys, "platform", "darwin")
    assert allocator.find_tcmalloc() is None
    assert allocator.resolve("auto") == "glibc"


def test_environment_adds_and_strips_only_tcmalloc(monkeypatch):
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    base = {"PATH": "/bin", "LD_PRELOAD": "/opt/libfoo.so:/usr/lib/libtcmalloc_minimal.so.4"}
    assert allocator.environment("glibc", base)["LD_PRELOAD"] == "/opt/libfoo.so"
    on_tcmalloc = allocator.environment("tcmalloc", base)
    assert on_tcmalloc["LD_PRELOAD"] == "libtcmalloc_minimal.so.4 /opt/libfoo.so"
    assert int(on_tcmalloc["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no stack trace per 1 GB tensor
    assert "LD_PRELOAD" not in allocator.environment("glibc", {"LD_PRELOAD": "libtcmalloc.so.4"})
    assert base["LD_PRELOAD"] == "/opt/libfoo.so:/usr/lib/libtcmalloc_minimal.so.4"  # a copy, not in place


def test_in_process_cannot_switch(monkeypatch):
    """The Python API cannot re-execute: auto reports what runs, a named other allocator is an error."""
    monkeypatch.setattr(allocator, "loaded", lambda: "glibc")
    assert allocator.check_in_process("auto") == "glibc"
    assert allocator.check_in_process("glibc") == "glibc"
    with pytest.raises(ConfigError, match="runs on glibc and cannot switch.*LD_PRELOAD=libtcmalloc_minimal"):
        allocator.check_in_process("tcmalloc")


def test_no_second_reexec(monkeypatch):
    """Re-executed once and still not on tcmalloc (a preload that failed): an error, not a loop."""
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator, "loaded", lambda: "glibc")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("re-executed a second time"))
    monkeypatch.setenv(allocator.MARKER, "tcmalloc")
    with pytest.raises(ConfigError, match="did not give this process tcmalloc"):
        allocator.ensure("auto", ["train"])


def test_bad_value_exits_2(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--steps", "1", "--speed.allocator=jemalloc",
                 f"--output.dir={tmp_path}", "--output.name=r"])
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "speed.allocator" in error[0] and "jemalloc" in error[0]
    assert not (tmp_path / "r").exists()


def _train(tmp_path: Path, name: str, setting: str, env: dict[str, str]) -> tuple[dict, list[dict]]:
    process = subprocess.run(
        [sys.executable, "-m", "hasten.cli", "train", "--model", "tiny", "--steps", "3", f"--speed.allocator={setting}",
         f"--output.dir={tmp_path}", f"--output.name={name}", "--output.progress=off", "--output.plot=false",
         "--eval.num_examples=8"],
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
