"""B6 in its quick configuration: every row runs and the output holds the ratio (no timing asserts)."""

from __future__ import annotations

import json

import torch

from hasten.bench.games import run_b6
from hasten.bench.report import format_table, to_json
from hasten.bench.workloads import BenchOptions


def test_b6_quick_runs_and_reports_the_compile_fallback(monkeypatch):
    def unavailable(module, **kwargs):
        raise RuntimeError("inductor needs a C++ compiler")

    monkeypatch.setattr(torch, "compile", unavailable)  # compiling takes minutes on CPU; the fallback is the test
    logged = []
    opts = BenchOptions(workloads=["B6"], peers=[], model="tiny", quick=True, repeats=2, log=logged.append)
    result = run_b6(opts)
    names = [row.name for row in result.rows]
    assert names == ["hasten vectorized", "reference per-step"]
    assert any("inductor needs a C++ compiler" in note for note in result.notes)
    assert all(len(row.seconds) == 2 and "score" in row.extra for row in result.rows)
    payload = json.loads(to_json([result], 1.0, {}))
    assert "reference per-step/hasten vectorized" in payload["workloads"]["B6"]["ratios"]
    assert "B6" in format_table([result], 1.0, {})
