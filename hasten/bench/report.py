"""Records and output of `hasten bench`: measured rows, ratios, MFU, the table and the JSON line.

A `Row` is one engine or peer on one workload: its wall-clock seconds per
measured run, in the order they were taken. Rows of one workload are measured
in alternation (round r of every row runs before round r+1 of any), so a peer
row and the hasten row it is compared with form pairs by index, and a ratio
is the median over pairs of peer seconds / hasten seconds: above 1 means
hasten is faster. Pairs, not medians of each side, because the machine is
shared and its speed drifts; a pair saw the same drift.

Distance to the limit (bench/cost.py has the counting): MFU is a row's model FLOPs / seconds / the
best matmul rate measured in the same run at the row's precision (fp32 or bf16, over the kernels hasten
uses: MKL, oneDNN, and the large square product); `limit` is the row's floor seconds (compute- or
memory-bound, per phase) / its seconds. Both are <= 100% when the denominators are right; a row above
it is flagged in the notes rather than printed as a win.

Output: a table for people, then exactly one JSON line, last, for tools.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .cost import Limits


@dataclass
class Row:
    """One engine or peer on one workload."""

    name: str
    side: str  # "hasten" | "peer"
    unit: str  # "s/step", "s" (lower is better) or "tok/s" (work / seconds, higher is better)
    seconds: list[float]  # one per measured run, in round order
    work: list[float] | None = None  # tokens per run, for tok/s
    flops: list[float] | None = None  # model FLOPs per run, for MFU
    floor: list[float] | None = None  # per run, the seconds the machine's limits allow (bench/cost.py)
    precision: str = "fp32"  # the matmul precision the row's FLOPs run at: MFU's denominator
    # Floors need the limits, which are measured after the rows: limits -> {"total": per run, phase: per run}
    # (phases named as the row's extra times: generate, learn). Result.apply_limits fills `floor` from it.
    floors_of: Callable[[Limits], dict[str, list[float]]] | None = field(default=None, repr=False)
    baseline: str | None = None  # peer rows: the hasten row they are compared with (None = the first)
    extra: dict[str, Any] = field(default_factory=dict)  # split times, reward, first step, ...

    def values(self) -> list[float]:
        """The numbers shown, in `unit`: seconds, or tokens per second."""
        if self.unit == "tok/s":
            assert self.work is not None
            return [work / seconds for work, seconds in zip(self.work, self.seconds)]
        return list(self.seconds)


@dataclass
class Result:
    """One workload: its rows, the exact settings both sides used, and notes."""

    workload: str
    title: str
    rows: list[Row] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def apply_limits(self, limits: Limits) -> None:
        """Each row's floor per run, and `<phase>_limit` beside a phase's median seconds in its extra."""
        for row in self.rows:
            if row.floors_of is None:
                continue
            floors = row.floors_of(limits)
            row.floor = floors.pop("total")
            for phase, values in floors.items():
                seconds = row.extra.get(phase)
                if isinstance(seconds, (int, float)) and seconds > 0 and values:
                    row.extra[f"{phase}_limit"] = round(statistics.median(values) / seconds, 4)

    def hasten_rows(self) -> list[Row]:
        return [row for row in self.rows if row.side == "hasten"]

    def peer_rows(self) -> list[Row]:
        return [row for row in self.rows if row.side == "peer"]

    def baseline_of(self, peer: Row) -> Row | None:
        candidates = self.hasten_rows()
        if peer.baseline is not None:
            candidates = [row for row in candidates if row.name == peer.baseline]
        return candidates[0] if candidates else None


# ------------------------------------------------------------------ the matmul peak


def matmul_peak(size: int, repeats: int, dtype=None) -> float:
    """Best (size x size) @ (size x size) rate on all torch threads, in GFLOP/s (fp32 unless `dtype`)."""
    import torch

    dtype = dtype or torch.float32
    left, right = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(left, right, out=out)  # warm-up: thread pool, page faults
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(left, right, out=out)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def pair_ratio(peer: Row, hasten: Row) -> float | None:
    """Median over rounds of peer seconds / hasten seconds (> 1: hasten is faster)."""
    # B5's minutes are inf where a run never got there: a pair where neither did says nothing
    pairs = [p / h for p, h in zip(peer.seconds, hasten.seconds) if h > 0 and not (math.isinf(p) and math.isinf(h))]
    return statistics.median(pairs) if pairs else None


def mfu(row: Row, limits: Limits) -> float | None:
    """Median over runs of (model FLOPs / seconds) / the best matmul rate at the row's precision."""
    peak = limits.flops_per_second(row.precision)
    if not row.flops or peak <= 0:
        return None
    rates = [flops / seconds for flops, seconds in zip(row.flops, row.seconds) if seconds > 0]
    return statistics.median(rates) / peak if rates else None


def limit_fraction(row: Row) -> float | None:
    """Median over runs of floor seconds / seconds: how close the row came to what the machine allows."""
    if not row.floor:
        return None
    fractions = [floor / seconds for floor, seconds in zip(row.floor, row.seconds) if seconds > 0]
    return statistics.median(fractions) if fractions else None


def over_the_limit(results: list[Result], limits: Limits) -> list[str]:
    """Rows whose MFU or limit fraction exceeds 100%: a wrong denominator, said so instead of shown as a win."""
    flagged = []
    for result in results:
        for row in result.rows:
            for name, value in (("MFU", mfu(row, limits)), ("limit", limit_fraction(row))):
                if value is not None and value > 1.0:
                    flagged.append(f"{result.workload} {row.name}: {name} {100 * value:.0f}% > 100% "
                                   "(a limit measured low, or work counted twice)")
    return flagged


# ------------------------------------------------------------------ the table


def _number(value: float | None, width: int = 9) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    if abs(value) >= 1000:
        return f"{value:,.0f}".rjust(width)
    if abs(value) >= 100:
        return f"{value:.1f}".rjust(width)
    return f"{value:.3g}".rjust(width) if abs(value) < 1 else f"{value:.2f}".rjust(width)


def _percent(value: float | None) -> str:
    return f"{'-' if value is None else f'{100 * value:.1f}%':>6}"


def _extra_text(extra: dict[str, Any]) -> str:
    parts = []
    for key, value in extra.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.3g}")
        elif isinstance(value, (int, str, bool)):
            parts.append(f"{key}={value}")
    return " ".join(parts)


def _compact(value: Any) -> str:
    return " ".join(f"{key}={item}" for key, item in value.items()) if isinstance(value, dict) else str(value)


def format_table(results: list[Result], limits: Limits, header: dict[str, Any]) -> str:
    """The human-readable report: one table over all workloads, then settings and notes."""
    scalars = {key: value for key, value in header.items() if not isinstance(value, dict)}
    lines = ["hasten bench  " + "  ".join(f"{key}={value}" for key, value in scalars.items())]
    for key, value in header.items():  # nested figures (OpenMP variables, matmul rates per shape): a line each
        if isinstance(value, dict) and value and all(isinstance(item, dict) for item in value.values()):
            for part, items in value.items():
                lines.append(f"{key} {part}: " + "  ".join(f"{name} {_compact(item)}" for name, item in items.items()))
        elif isinstance(value, dict):
            lines.append(f"{key}: {_compact(value) or '(none set)'}")
    lines += [
        f"limits: fp32 {limits.fp32_gflops:.1f} GFLOP/s, bf16 {limits.bf16_gflops:.1f} GFLOP/s (best matmul over "
        f"MKL, oneDNN and the square product, all threads: MFU's denominator), memory {limits.bandwidth_gbs:.1f} "
        "GB/s (triad); limit = floor / seconds (bench/cost.py)",
        "ratio = median over A B pairs of peer seconds / hasten seconds (> 1: hasten faster)",
        "",
        f"{'workload':<8} {'engine/peer':<34} {'median':>9} {'min':>9} {'max':>9} {'unit':<7} "
        f"{'ratio':>7} {'vs':<22} {'MFU':>6} {'limit':>6}  notes",
    ]
    for result in results:
        for row in result.rows:
            values = row.values()
            ratio_text, versus = "", ""
            if row.side == "peer":
                base = result.baseline_of(row)
                ratio = pair_ratio(row, base) if base else None
                ratio_text = f"{ratio:.2f}x" if ratio is not None else "-"
                versus = base.name if base else "-"
            utilisation, fraction = mfu(row, limits), limit_fraction(row)
            lines.append(
                f"{result.workload:<8} {row.name:<34} {_number(statistics.median(values))} {_number(min(values))} "
                f"{_number(max(values))} {row.unit:<7} {ratio_text:>7} {versus:<22} "
                f"{_percent(utilisation)} {_percent(fraction)}  {_extra_text(row.extra)}"
            )
        if not result.rows:
            lines.append(f"{result.workload:<8} (no rows: see notes)")
    lines.append("")
    lines += [f"note: {flag}" for flag in over_the_limit(results, limits)]
    for result in results:
        all_pairs = all_ratios(result)
        if len(all_pairs) > 1:
            pairs = ", ".join(f"{key} {value:.2f}x" for key, value in all_pairs.items())
            lines.append(f"{result.workload} ratios: {pairs}")
    for result in results:
        lines.append(f"{result.workload} - {result.title}")
        for side, settings in result.settings.items():
            lines.append(f"  settings {side}: {json.dumps(settings, sort_keys=True, default=str)}")
        for note in result.notes:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


def all_ratios(result: Result) -> dict[str, float]:
    """Each peer row against its named baseline, or else every hasten row: {"peer/hasten": ratio}."""
    ratios = {}
    for peer in result.peer_rows():
        bases = [result.baseline_of(peer)] if peer.baseline else result.hasten_rows()
        for base in filter(None, bases):
            ratio = pair_ratio(peer, base)
            if ratio is not None:
                ratios[f"{peer.name}/{base.name}"] = ratio
    return ratios


# ------------------------------------------------------------------ the JSON line


def _row_json(result: Result, row: Row, limits: Limits) -> dict[str, Any]:
    values = row.values()
    out: dict[str, Any] = {
        "name": row.name,
        "side": row.side,
        "unit": row.unit,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "seconds": row.seconds,
        "mfu": mfu(row, limits),
        "limit": limit_fraction(row),
        "precision": row.precision,
    }
    if row.side == "peer":
        base = result.baseline_of(row)
        out["baseline"] = base.name if base else None
        out["ratio"] = pair_ratio(row, base) if base else None
    if row.work is not None:
        out["work"] = row.work
    out.update(row.extra)
    return out


def to_json(results: list[Result], limits: Limits, header: dict[str, Any]) -> str:
    """One line: every number of the run, keyed by workload."""
    payload = {
        **header,
        "limits": {"fp32_gflops": limits.fp32_gflops, "bf16_gflops": limits.bf16_gflops,
                   "bandwidth_gbs": limits.bandwidth_gbs},
        "over_the_limit": over_the_limit(results, limits),
        "workloads": {
            result.workload: {
                "title": result.title,
                "rows": [_row_json(result, row, limits) for row in result.rows],
                "ratios": all_ratios(result),
                "settings": result.settings,
                "notes": result.notes,
            }
            for result in results
        },
    }
    return json.dumps(_finite(payload), default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    """NaN and infinities become null, so the line is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
