"""Records and output of `hasten bench`: measured rows, ratios, limits and MFU, the table and the JSON line.

A `Row` is one engine or peer on one workload: its wall-clock seconds per
measured run, in the order they were taken. Rows of one workload are measured
in alternation (round r of every row runs before round r+1 of any), so a peer
row and the hasten row it is compared with form pairs by index, and a ratio
is the median over pairs of peer seconds / hasten seconds: above 1 means
hasten is faster. Pairs, not medians of each side, because the machine is
shared and its speed drifts; a pair saw the same drift.

The "limit" column is the fraction of the hardware limit a run reached: its
floor (cost.py, docs/cost-model.md: FLOPs at the best matmul rate measured at
the run's precision, bytes at the measured memory bandwidth, the larger of
the two per phase, summed over phases) divided by its seconds. It cannot
exceed 100% unless a denominator is wrong: such a figure is flagged ("!"),
never shown as if it meant something. MFU (JSON only) is model FLOPs /
seconds / that same best peak. Model FLOPs count the work a workload needs, not what an engine chooses to do (a peer
that prefills a prompt once per sample gets no credit for the repeats):
- N_body = every weight applied at every position, i.e. all parameters but
  the input embedding (a lookup) and the LM head; N_head = the LM head's
  weight (tied to the embedding in SmolLM2, counted once, where applied).
  SmolLM2-135M: N_body = 106.2M, N_head = 28.3M.
- generation: 2 N_body per prompt token, prefilled once per prompt, plus
  2 (N_body + N_head) per generated token;
- learning (forward + backward): 6 N_body per prompt token, once per group,
  plus 6 (N_body + N_head) per completion token;
- a GRPO step (B1) = generation + learning. Attention scores (~4% at these
  lengths), norms, sampling and the optimizer are left out.

Output: a table for people, then exactly one JSON line, last, for tools; a
--quick run's ratios say "paths checked, not a measurement" in both, and a
busy box (machine.busy_reasons) is a warning above the table. --report's page
is results_page.py.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from . import cost


@dataclass(frozen=True)
class Work:
    """The model work of one phase of one run, which its floor is computed from (cost.py)."""

    flops: float
    moved: float = 0.0  # bytes it must move (decode: weights + KV cache per step)
    precision: str = "fp32"
    fp32_flops: float = 0.0  # the share of `flops` that runs in fp32 whatever `precision` is (bf16_fp32head's head)

    def floor(self, limits: cost.Limits) -> float:
        """Its roofline floor: the fp32 share at the fp32 peak, the rest at `precision`'s."""
        if not self.fp32_flops:
            return cost.floor_seconds(limits, self.flops, self.moved, self.precision)
        compute = ((self.flops - self.fp32_flops) / limits.peak(self.precision)
                   + self.fp32_flops / limits.peak("fp32")) / 1e9
        return max(compute, cost.floor_seconds(limits, 0.0, self.moved, self.precision))


@dataclass
class Row:
    """One engine or peer on one workload."""

    name: str
    side: str  # "hasten" | "peer"
    unit: str  # "s/step", "s" (lower is better) or "tok/s" (work / seconds, higher is better)
    seconds: list[float]  # one per measured run, in round order
    work: list[float] | None = None  # tokens per run, for tok/s
    flops: list[float] | None = None  # model FLOPs per run, for MFU
    phases: list[dict[str, Work]] | None = None  # per run, each phase's work: the floor (the "limit" column)
    precision: str = "fp32"  # the learning precision: MFU's peak when `phases` is absent
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

    def hasten_rows(self) -> list[Row]:
        return [row for row in self.rows if row.side == "hasten"]

    def peer_rows(self) -> list[Row]:
        return [row for row in self.rows if row.side == "peer"]

    def baseline_of(self, peer: Row) -> Row | None:
        candidates = [row for row in self.hasten_rows() if row.unit == peer.unit]  # B7: minutes and s/step rows
        if peer.baseline is not None:
            candidates = [row for row in candidates if row.name == peer.baseline]
        return candidates[0] if candidates else None


# ------------------------------------------------------------------ model FLOPs and the matmul peak


@dataclass(frozen=True)
class ModelSize:
    body: int  # parameters applied at every position
    head: int  # LM head parameters, applied where logits are needed


def model_size(model) -> ModelSize:
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head)
    return ModelSize(body, head.numel())


def generation_flops(size: ModelSize, prompt_tokens: float, generated_tokens: float) -> float:
    """cost.generation_flops without attention: 2 N_body per position + 2 N_head per generated token."""
    return 2 * size.body * (prompt_tokens + generated_tokens) + 2 * size.head * generated_tokens


def learning_flops(size: ModelSize, prompt_tokens: float, completion_tokens: float, lora: bool = False) -> float:
    """cost.learning_flops without attention: 6N per token (4N with LoRA)."""
    return cost.learning_multiplier(lora) * generation_flops(size, prompt_tokens, completion_tokens)


def matmul_peak(size: int, repeats: int) -> float:
    """Best fp32 (size x size) @ (size x size) rate on all torch threads, in GFLOP/s."""
    import torch

    left, right = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
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


def as_limits(limits: cost.Limits | float) -> cost.Limits:
    """A bare number is an fp32 peak with no bandwidth measured (older callers, tests)."""
    return limits if isinstance(limits, cost.Limits) else cost.Limits({"fp32": float(limits)}, 0.0)


def mfu(row: Row, limits: cost.Limits | float) -> float | None:
    """Median over runs of (model FLOPs / seconds) / the best peak at the row's precision."""
    limits = as_limits(limits)
    if not row.flops or limits.gflops.get(row.precision, 0) <= 0:
        return None
    rates = [flops / seconds for flops, seconds in zip(row.flops, row.seconds) if seconds > 0]
    return statistics.median(rates) / (limits.peak(row.precision) * 1e9) if rates else None


def run_floor(limits: cost.Limits, work: dict[str, Work]) -> float:
    return sum(part.floor(limits) for part in work.values())


def limit(row: Row, limits: cost.Limits | float) -> float | None:
    """Median over runs of floor seconds / measured seconds; rows without `phases` use their FLOPs
    at the row's precision. Over 1 means a wrong denominator: `limit_flag` says so."""
    limits = as_limits(limits)
    works = row.phases or ([{"all": Work(flops, 0.0, row.precision)} for flops in row.flops] if row.flops else None)
    if not works or any(limits.gflops.get(part.precision, 0) <= 0 for work in works for part in work.values()):
        return None
    fractions = [run_floor(limits, work) / seconds for work, seconds in zip(works, row.seconds) if seconds > 0]
    return statistics.median(fractions) if fractions else None


def phase_limits(row: Row, limits: cost.Limits | float) -> dict[str, float]:
    """Per phase whose median seconds the row carries in `extra` (B1: generate, learn): median floor / that."""
    limits = as_limits(limits)
    out = {}
    for phase in (row.phases or [{}])[0]:
        seconds = row.extra.get(phase)
        parts = [work[phase] for work in row.phases or [] if phase in work]
        if isinstance(seconds, (int, float)) and seconds > 0 and limits.gflops.get(parts[0].precision, 0) > 0:
            floors = [part.floor(limits) for part in parts]
            out[phase] = statistics.median(floors) / seconds
    return out


def limit_flag(value: float | None) -> str:
    """The limit column's text: over 100% is flagged, never shown as a result."""
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" + ("!" if value > 1.0 else "")


# ------------------------------------------------------------------ the table


def _number(value: float | None, width: int = 9) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-".rjust(width)
    if abs(value) >= 1000:
        return f"{value:,.0f}".rjust(width)
    if abs(value) >= 100:
        return f"{value:.1f}".rjust(width)
    return f"{value:.3g}".rjust(width) if abs(value) < 1 else f"{value:.2f}".rjust(width)


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


QUICK_NOTE = "paths checked, not a measurement"  # beside every ratio of a --quick run


def ratio_text(ratio: float | None, quick: bool) -> str:
    """'3.17x'; a --quick run's ratio says what it is: the tiny random model at toy sizes measures nothing."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x ({QUICK_NOTE})" if quick else f"{ratio:.2f}x"


def warnings(header: dict[str, Any]) -> list[str]:
    """The lines that say a run's figures must not be quoted: a busy box, a --quick run."""
    lines = []
    if header.get("busy_box"):
        lines.append("WARNING: busy box, do not quote these figures: " + "; ".join(header["busy_box"]))
    if header.get("quick"):
        lines.append(f"--quick: the tiny random model at toy sizes: {QUICK_NOTE}; every ratio says so")
    return lines


def format_table(results: list[Result], limits: cost.Limits | float, header: dict[str, Any]) -> str:
    """The human-readable report: one table over all workloads, then settings and notes."""
    quick = bool(header.get("quick"))
    scalars = {key: value for key, value in header.items() if not isinstance(value, dict) and key != "busy_box"}
    lines = warnings(header) + ["hasten bench  " + "  ".join(f"{key}={value}" for key, value in scalars.items())]
    for key, value in header.items():  # nested figures (OpenMP variables, matmul rates per shape): a line each
        if isinstance(value, dict) and value and all(isinstance(item, dict) for item in value.values()):
            for part, items in value.items():
                lines.append(f"{key} {part}: " + "  ".join(f"{name} {_compact(item)}" for name, item in items.items()))
        elif isinstance(value, dict):
            lines.append(f"{key}: {_compact(value) or '(none set)'}")
    limits = as_limits(limits)
    lines += [
        "hardware limit: best matmul " + ", ".join(f"{precision} {rate:.1f}" for precision, rate in
                                                   limits.gflops.items()) + " GFLOP/s (over MKL, oneDNN, bf16 at "
        f"the model's shapes), memory {limits.bandwidth_gbs:.1f} GB/s; limit = floor / seconds (docs/cost-model.md)",
        "ratio = median over A B pairs of peer seconds / hasten seconds (> 1: hasten faster)",
        "",
        f"{'workload':<8} {'engine/peer':<34} {'median':>9} {'min':>9} {'max':>9} {'unit':<7} "
        f"{'ratio':>7} {'vs':<22} {'limit':>7}  notes",
    ]
    flagged = 0
    for result in results:
        for row in result.rows:
            values = row.values()
            shown, versus, quick_note = "", "", ""
            if row.side == "peer":
                base = result.baseline_of(row)
                ratio = pair_ratio(row, base) if base else None
                shown = f"{ratio:.2f}x" if ratio is not None else "-"
                quick_note = f"ratio: {QUICK_NOTE}" if quick and ratio is not None else ""
                versus = base.name if base else "-"
            reached, by_phase = limit(row, limits), phase_limits(row, limits)
            flagged += sum(value > 1.0 for value in [reached or 0.0, *by_phase.values()])
            phase_text = " ".join(f"limit_{phase}={limit_flag(value)}" for phase, value in by_phase.items())
            lines.append(
                f"{result.workload:<8} {row.name:<34} {_number(statistics.median(values))} {_number(min(values))} "
                f"{_number(max(values))} {row.unit:<7} {shown:>7} {versus:<22} "
                f"{limit_flag(reached):>7}  {' '.join(filter(None, [quick_note, phase_text, _extra_text(row.extra)]))}"
            )
        if not result.rows:
            lines.append(f"{result.workload:<8} (no rows: see notes)")
    lines.append("")
    if flagged:
        lines.append(f"WARNING: {flagged} limit figure(s) over 100% (marked !): a peak or the bandwidth measured "
                     "here is below what a run did, so those fractions mean nothing")
    for result in results:
        all_pairs = all_ratios(result)
        if len(all_pairs) > 1:
            pairs = ", ".join(f"{key} {ratio_text(value, quick)}" for key, value in all_pairs.items())
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
        bases = [result.baseline_of(peer)] if peer.baseline else [row for row in result.hasten_rows()
                                                                   if row.unit == peer.unit]
        for base in filter(None, bases):
            ratio = pair_ratio(peer, base)
            if ratio is not None:
                ratios[f"{peer.name}/{base.name}"] = ratio
    return ratios


# ------------------------------------------------------------------ the JSON line


def _row_json(result: Result, row: Row, limits: cost.Limits, quick: bool = False) -> dict[str, Any]:
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
        "limit": limit(row, limits),
        "phase_limits": phase_limits(row, limits),
    }
    if row.side == "peer":
        base = result.baseline_of(row)
        out["baseline"] = base.name if base else None
        out["ratio"] = pair_ratio(row, base) if base else None
        if quick:
            out["ratio_note"] = QUICK_NOTE
    if row.work is not None:
        out["work"] = row.work
    out.update(row.extra)
    return out


def to_json(results: list[Result], limits: cost.Limits | float, header: dict[str, Any]) -> str:
    """One line: every number of the run, keyed by workload."""
    limits = as_limits(limits)
    payload = {
        **header,
        **({"ratio_note": QUICK_NOTE} if header.get("quick") else {}),
        "peak_gflops": limits.gflops.get("fp32"),
        "limits": {"gflops": limits.gflops, "bandwidth_gbs": limits.bandwidth_gbs},
        "workloads": {
            result.workload: {
                "title": result.title,
                "rows": [_row_json(result, row, limits, bool(header.get("quick"))) for row in result.rows],
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
