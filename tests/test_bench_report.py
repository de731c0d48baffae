"""Bench reports that explain themselves: results.md has a legend, the machine and its load, and a PNG for
every workload (B1 included); a busy box is flagged; --quick ratios say they measure nothing. No test
here asserts a time."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hasten.bench import main
from hasten.bench.cost import Limits
from hasten.bench.machine import busy_reasons, earlier_probes, record_probes
from hasten.bench.report import QUICK_NOTE, Result, Row, Work, format_table, to_json
from hasten.bench.results_page import write_report

HEADER = {"model": "smollm2-135m", "quick": False, "cpu": "Test CPU", "cores": 2, "cpus": 2, "torch_threads": 2,
          "load_average_before": 0.5, "load_average_after": 0.7, "peak_gflops_start": 100.0,
          "peak_gflops_end": 110.0, "memory_gbs": {"read": 10.0, "best": 12.0}, "busy_box": []}
LIMITS = Limits({"fp32": 110.0}, 12.0)


def step_work() -> dict[str, Work]:
    return {"generate": Work(2e10, 5e8), "learn": Work(6e10)}


def results() -> list[Result]:
    b1 = Result("B1", "one GRPO step")
    b1.rows = [Row("hasten", "hasten", "s/step", [4.0, 4.2], phases=[step_work()] * 2,
                   extra={"generate": 2.5, "reward": 0.1, "learn": 1.5}),
               Row("trl gc=off", "peer", "s/step", [9.0, 9.5], phases=[step_work()] * 2, baseline="hasten",
                   extra={"generate": 6.0, "learn": 3.2})]
    b2 = Result("B2", "decode")
    b2.rows = [Row("lean", "hasten", "tok/s", [2.0, 2.1], work=[512, 512], flops=[1e10, 1e10]),
               Row("hf generate", "peer", "tok/s", [4.0, 4.4], work=[512, 512], flops=[1e10, 1e10])]
    b4 = Result("B4", "startup")
    b4.rows = [Row("hasten --help", "hasten", "s", [0.1, 0.12])]
    return [b1, b2, b4]


def test_results_md_has_a_legend_the_machine_and_a_png_for_every_workload(tmp_path):
    measured = results()
    page = write_report(tmp_path, format_table(measured, LIMITS, HEADER), to_json(measured, LIMITS, HEADER),
                        measured, HEADER, LIMITS).read_text()
    assert "## How to read this" in page
    assert "**ratio**" in page and "peer seconds / hasten seconds" in page
    assert "**limit**" in page and "floor seconds / measured seconds" in page
    assert "## Machine and load" in page and "Test CPU" in page and "0.5 before the run" in page
    for workload in ("B1", "B2", "B4"):
        assert f"## {workload}: " in page
        assert f"![{workload}]({workload.lower()}.png)" in page
        assert (tmp_path / f"{workload.lower()}.png").stat().st_size > 0
    b1 = page.split("## B1: ")[1].split("## B2: ")[0]
    assert "| trl gc=off |" in b1 and "2.2" in b1  # the ratio: median of the pairs 9/4, 9.5/4.2
    assert "generate " in b1 and "learn " in b1  # the per-phase limit fractions
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(to_json(measured, LIMITS, HEADER))
    assert QUICK_NOTE not in page.split("## How to read this")[0] and "busy box, do not quote" not in page


def test_a_load_above_the_cores_is_a_busy_box():
    assert busy_reasons(HEADER) == []
    reasons = busy_reasons({**HEADER, "load_average_before": 9.5})
    assert len(reasons) == 1 and "load average 9.50" in reasons[0] and "2 cores" in reasons[0]
    assert "moved" in busy_reasons({**HEADER, "peak_gflops_end": 300.0})[0]


def test_probes_far_below_the_machines_earlier_figures_are_a_busy_box(tmp_path):
    record = tmp_path / "probes.json"
    assert earlier_probes(HEADER, record) == {}
    record_probes(HEADER, record)
    assert busy_reasons(HEADER, earlier_probes(HEADER, record)) == []
    slow = {**HEADER, "peak_gflops_start": 30.0, "peak_gflops_end": 31.0, "memory_gbs": {"best": 0.12}}
    reasons = busy_reasons(slow, earlier_probes(slow, record))
    assert any("matmul peak 31" in reason for reason in reasons)
    assert any("memory bandwidth 0.12" in reason for reason in reasons)
    other_machine = {**slow, "cpu": "Another CPU"}
    assert busy_reasons(other_machine, earlier_probes(other_machine, record)) == []


def test_a_busy_quick_run_says_so_in_the_table_the_json_and_results_md(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    report = tmp_path / "report"
    assert main(["--quick", "--workloads", "B3", "--peers", "none", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    table, line = out.rsplit("\n", 2)[0], out.strip().splitlines()[-1]
    assert table.startswith("WARNING: busy box, do not quote these figures: load average 99.00")
    ratio_rows = [row for row in table.splitlines() if row.startswith("B3 ") and "x " in row]
    assert ratio_rows and all(f"ratio: {QUICK_NOTE}" in row for row in ratio_rows)
    payload = json.loads(line)
    assert payload["busy_box"] and payload["ratio_note"] == QUICK_NOTE
    peers = [row for row in payload["workloads"]["B3"]["rows"] if row["side"] == "peer"]
    assert peers and all(row["ratio_note"] == QUICK_NOTE for row in peers)
    page = (report / "results.md").read_text()
    assert "busy box, do not quote" in page.split("## How to read this")[0]
    b3 = page.split("## B3: ")[1]
    assert f"x ({QUICK_NOTE})" in b3 and "![B3](b3.png)" in b3 and (report / "b3.png").is_file()
    assert Path(tmp_path / "cache" / "bench" / "probes.json").is_file()  # the probes joined the record
