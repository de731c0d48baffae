"""speed.adaptive_threads (kernels/threads.py): intra-op threads follow the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from hasten.kernels import threads as threads_module
from hasten.kernels.threads import ThreadGovernor, busy_neighbours


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_busy_neighbour_is_counted():
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # spinning, not starting: on a box whose cores are busy (the suite's own workers) Python's start-up
        # reads files for longer than a fixed sleep, and a process waiting on a read is not runnable
        stat = f"/proc/{burner.pid}/stat"
        deadline = time.monotonic() + 60
        while int(open(stat).read().rsplit(")", 1)[1].split()[11]) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)  # utime (field 14) under 10 ticks: not yet spinning
        assert busy_neighbours() >= 1
    finally:
        burner.kill()
        burner.wait()


def test_own_threads_are_not_neighbours(monkeypatch):
    monkeypatch.setattr(threads_module, "_running_total", lambda: 3)
    monkeypatch.setattr(threads_module, "_running_own", lambda: 3)  # e.g. OpenMP workers still spinning
    assert busy_neighbours(samples=2, gap_s=0) == 0
    samples = iter([4, 2, 5])  # the minimum over samples: a blip does not count
    monkeypatch.setattr(threads_module, "_running_total", lambda: next(samples))
    monkeypatch.setattr(threads_module, "_running_own", lambda: 1)
    monkeypatch.setattr(threads_module, "_running_user_others", lambda: 5)  # the scan confirms user processes
    assert busy_neighbours(samples=3, gap_s=0) == 1


def test_governor_gives_up_the_busy_cores_and_takes_them_back(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    governor = ThreadGovernor(True, cores=2)
    monkeypatch.setattr(threads_module, "busy_neighbours", lambda: 1)
    assert governor.adjust() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(threads_module, "busy_neighbours", lambda: 5)
    assert governor.adjust() == 1  # never below one
    monkeypatch.setattr(threads_module, "busy_neighbours", lambda: 0)
    assert governor.adjust() == 2 and torch.get_num_threads() == 2  # never above what the run started with
    monkeypatch.setattr(threads_module, "busy_neighbours", lambda: None)  # no /proc/stat: leave all threads
    assert governor.adjust() == 2
    monkeypatch.setattr(threads_module, "busy_neighbours", lambda: 1)
    governor.adjust()
    governor.restore()  # the run is over: the process gets its threads back
    assert torch.get_num_threads() == 2


def test_disabled_governor_never_touches_threads(monkeypatch, restore_threads):
    torch.set_num_threads(2)
    monkeypatch.setattr(threads_module, "busy_neighbours", lambda: 1)
    assert ThreadGovernor(False, cores=2).adjust() == 2 and torch.get_num_threads() == 2
    torch.set_num_threads(1)
    assert not ThreadGovernor(True, cores=2).enabled  # one thread: nothing to give up


def test_training_records_the_threads_only_when_the_governor_decides(tmp_path, restore_threads):
    import json
    from pathlib import Path

    from hasten.config import load_config
    from hasten.train.trainer import train

    torch.set_num_threads(2)

    def run(name, **extra):
        pairs = {"model.name": "tiny", "task.name": "arithmetic", "train.steps": 2, "train.prompts_per_step": 2,
                 "generation.num_generations": 2, "generation.max_new_tokens": 4, "eval.num_examples": 0,
                 "output.dir": str(tmp_path), "output.name": name, "output.progress": "off", "output.plot": False,
                 **extra}
        summary = train(load_config(overrides=list(pairs.items())), log=lambda _: None)
        return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]

    for record in run("auto"):
        assert record["threads/generate"] in (1, 2) and record["threads/learn"] in (1, 2)
    assert not any(key.startswith("threads/") for key in run("pinned", **{"train.num_threads": 1})[0])
    assert not any(key.startswith("threads/") for key in run("off", **{"speed.adaptive_threads": False})[0])


def _task(root, pid, tid, state, flags):
    stat = root / str(pid) / "task" / str(tid) / "stat"
    stat.parent.mkdir(parents=True, exist_ok=True)
    stat.write_text(f"{tid} (some (odd) name) {state} 1 {pid} {pid} 0 -1 {flags} 0 0 0 0 5 3\n")


def test_kernel_threads_and_own_threads_are_not_neighbours(tmp_path):
    _task(tmp_path, 45, 45, "R", 0x00200040)  # kswapd0 reclaiming: PF_KTHREAD set
    _task(tmp_path, 77, 77, "R", 0x00208040)  # kdamond
    _task(tmp_path, 500, 500, "S", 0x00400100)  # a sleeping user process
    _task(tmp_path, 500, 501, "R", 0x00400040)  # one of its threads runs
    _task(tmp_path, 600, 600, "R", 0x00400100)  # another user process runs
    _task(tmp_path, 900, 900, "R", 0x00400100)  # this process
    _task(tmp_path, 900, 901, "R", 0x00400040)
    (tmp_path / "901").mkdir()  # a pid whose tasks vanished mid-scan
    (tmp_path / "self").mkdir()
    assert threads_module._running_user_others(str(tmp_path), own=900) == 2


def test_a_busy_kernel_is_not_a_busy_neighbour(monkeypatch):
    monkeypatch.setattr(threads_module, "_running_total", lambda: 3)  # procs_running counts kswapd too
    monkeypatch.setattr(threads_module, "_running_own", lambda: 1)
    monkeypatch.setattr(threads_module, "_running_user_others", lambda: 0)
    assert busy_neighbours(samples=2, gap_s=0) == 0
    monkeypatch.setattr(threads_module, "_running_user_others", lambda: 1)
    assert busy_neighbours(samples=2, gap_s=0) == 1
