"""`hasten compare`: every speed profile trained on the same data and seeds, side by side.

    hasten compare [--task NAME] [--model NAME] [--config run.yaml] [--steps N]
                   [--profiles baseline,conservative,balanced,aggressive] [--rounds R]
                   [--eval-examples K] [--json-only] [--section.key=value ...]

Each run is `hasten train` with `--profile P` in a fresh process: process-wide
settings (speed.keep_freed_memory's malloc options, torch's thread pools,
compiled graphs) must not leak from one profile into the next, and peak
memory is then the run's own. With --rounds R
the whole profile sequence repeats R times (A B C D, A B C D, ...) and the
speed-up is the median over rounds of baseline seconds / profile seconds, the
pairing docs/benchmarks.md asks for on a noisy shared machine.

Per run: median step seconds over steps 2..N (step 1 pays one-off warm-up),
mean training reward over all steps, held-out accuracy after the last step
(greedy, the first K held-out questions: the same for every profile), and
peak memory on the model's device (resident set on the CPU, allocated GPU
memory on CUDA: device.py). A profile that trades quality says what in the table.
Output: the table, then one JSON line, last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import UserError

PREFIX = "@@hasten-compare "
CHILD = """
import json, sys
from hasten.compare import child_main
child_main(json.loads(sys.argv[1]))
"""


class CompareError(UserError):
    """A bad `hasten compare` argument or a run that failed; str() is one line."""


@dataclass
class RunSpec:
    """One training run: config file, profile, overrides (as strings, like the command line)."""

    label: str
    config: str | None
    profile: str | None
    overrides: list[list[Any]] = field(default_factory=list)


@dataclass
class RunResult:
    label: str
    round: int
    step_seconds: list[float]
    median_step: float
    reward_mean: float
    accuracy: float | None
    peak_mib: float
    settings: dict[str, Any]
    extra: dict[str, float] = field(default_factory=dict)


def typed(pairs: list[list[Any]]) -> list[tuple[str, Any]]:
    """Override pairs with command-line text read by the field it sets (config.Raw), other values as they are."""
    from .config import Raw

    return [(key, Raw(value) if isinstance(value, str) else value) for key, value in pairs]


def child_main(spec: dict[str, Any]) -> None:
    """In the fresh process: train, then print one PREFIX line with the measurements."""
    from .config import load_config, to_dict
    from .device import peak_memory_mib, resolve_device
    from .train.trainer import train

    cfg = load_config(spec["config"], typed(spec["overrides"]), profile=spec["profile"])
    summary = train(cfg, log=lambda text: print(text, file=sys.stderr))
    with open(Path(summary["run_dir"]) / "metrics.jsonl") as lines:
        records = [json.loads(line) for line in lines]
    steps = [r["time/step"] for r in records]
    measured = steps[1:] if len(steps) > 1 else steps
    after = summary.get("eval_after") or {}
    settings = to_dict(cfg)
    peak = peak_memory_mib(resolve_device(cfg.model.device))  # the model's device: its memory is the scarce one
    extra = {key: statistics.mean(r[key] for r in records if key in r)
             for key in ("time/generate", "time/reward", "time/learn", "completion_length", "dynamic/rounds")
             if any(key in r for r in records)}
    message = {
        "step_seconds": steps, "median_step": statistics.median(measured),
        "reward_mean": statistics.mean(r["reward_mean"] for r in records), "accuracy": after.get("accuracy"),
        "peak_mib": peak, "extra": extra,
        "settings": {section: settings[section] for section in ("generation", "algo", "train", "speed")},
    }
    print(PREFIX + json.dumps(message), flush=True)


def run_child(spec: RunSpec, round_index: int, workdir: Path, log: Callable[[str], None]) -> RunResult:
    overrides = spec.overrides + [["output.dir", str(workdir)], ["output.name", f"{spec.label}-{round_index}"],
                                  ["output.progress", "off"], ["output.plot", False]]
    payload = json.dumps({"config": spec.config, "profile": spec.profile, "overrides": overrides})
    root = str(Path(__file__).resolve().parents[1])  # the child imports this same hasten, installed or not
    # Each run starts on the malloc its own config asks for (speed.allocator: baseline glibc, the others auto).
    from .config import load_config
    from .kernels.allocator import environment as allocator_environment, resolve as resolve_allocator

    wanted = resolve_allocator(load_config(spec.config, typed(spec.overrides), profile=spec.profile).speed.allocator)
    env = dict(allocator_environment(wanted), PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    started = time.perf_counter()
    process = subprocess.run([sys.executable, "-c", CHILD, payload], capture_output=True, text=True, env=env)
    for line in process.stdout.splitlines():
        if line.startswith(PREFIX):
            message = json.loads(line[len(PREFIX):])
            log(f"{spec.label} round {round_index + 1}: median step {message['median_step']:.3f} s "
                f"({time.perf_counter() - started:.0f} s in all)")
            return RunResult(spec.label, round_index, message["step_seconds"], message["median_step"],
                             message["reward_mean"], message["accuracy"], message["peak_mib"], message["settings"],
                             message["extra"])
    tail = (process.stderr.strip().splitlines() or ["(no output)"])[-1]
    raise CompareError(f"compare error: the '{spec.label}' run failed (exit {process.returncode}): {tail}")


def run_all(specs: list[RunSpec], rounds: int, log: Callable[[str], None]) -> dict[str, list[RunResult]]:
    results: dict[str, list[RunResult]] = {spec.label: [] for spec in specs}
    with tempfile.TemporaryDirectory(prefix="hasten-compare-") as workdir:
        for round_index in range(rounds):
            for spec in specs:
                log(f"{spec.label}: round {round_index + 1}/{rounds}")
                results[spec.label].append(run_child(spec, round_index, Path(workdir), log))
    return results


def summarize(results: dict[str, list[RunResult]], reference: str) -> list[dict[str, Any]]:
    """One row per label: medians over rounds, and the paired ratio reference / label (> 1 = faster)."""
    rows = []
    for label, runs in results.items():
        pairs = [ref.median_step / run.median_step for ref, run in zip(results[reference], runs)]
        accuracies = [run.accuracy for run in runs if run.accuracy is not None]
        rows.append({
            "label": label,
            "median_step": statistics.median(run.median_step for run in runs),
            "speedup": statistics.median(pairs),
            "reward_mean": statistics.mean(run.reward_mean for run in runs),
            "accuracy": statistics.mean(accuracies) if accuracies else None,
            "peak_mib": max(run.peak_mib for run in runs),
            "rounds": len(runs),
            "step_seconds": [run.step_seconds for run in runs],
            **{key: statistics.mean(run.extra[key] for run in runs if key in run.extra)
               for key in runs[0].extra},
            "settings": runs[0].settings,
        })
    return rows


def format_table(rows: list[dict[str, Any]], notes: dict[str, str], first: str = "profile",
                 ratio: tuple[str, str] = ("speedup", "speed-up"), default_note: str = "same as baseline",
                 footer: str = "") -> str:
    """The human table; `ratio` is (row key, column title) of the ratio column."""
    key, title = ratio
    header = f"{first:<22} {'median step':>12} {title:>9} {'mean reward':>12} {'held-out acc':>13} " \
             f"{'peak MiB':>9}  quality"
    lines = [header, "-" * len(header)]
    for row in rows:
        accuracy = "-" if row["accuracy"] is None else f"{row['accuracy']:.3f}"
        note = notes.get(row["label"], "") or default_note
        lines.append(f"{row['label']:<22} {row['median_step']:>10.3f} s {row[key]:>8.2f}x "
                     f"{row['reward_mean']:>12.3f} {accuracy:>13} {row['peak_mib']:>9.0f}  {note}")
    if footer:
        lines.append(footer)
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from .profiles import PROFILES

    parser = argparse.ArgumentParser(
        prog="hasten compare",
        description="Train with each speed profile on the same data and seeds; print a table, then one JSON line.",
        epilog="Any config key can be overridden as --section.key=value; it applies to every profile.",
    )
    parser.add_argument("--config", help="YAML config file (sections as in hasten/config.py)")
    parser.add_argument("--model", help="smollm2-135m (default), tiny, a model directory, or a hub id")
    parser.add_argument("--task", help="arithmetic, unit-conversion, or jsonl")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per profile (default 5)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma list (default: all four)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the profile sequence (paired speed-ups)")
    parser.add_argument("--eval-examples", type=int, default=32, help="held-out questions after training (0 = none)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    return parser


def main(argv: list[str]) -> int:
    from .config import parse_overrides
    from .config import load_config
    from .profiles import PROFILES, TRADES

    args, extra = _parser().parse_known_args(argv)
    profiles = [name.strip() for name in args.profiles.split(",") if name.strip()]
    unknown = [name for name in profiles if name not in PROFILES]
    if unknown or not profiles:
        raise CompareError(f"compare error: unknown profile {', '.join(unknown) or '(none)'} "
                           f"(choose from {', '.join(PROFILES)})")
    if args.steps < 1 or args.rounds < 1 or args.eval_examples < 0:
        raise CompareError("compare error: --steps and --rounds must be >= 1, --eval-examples >= 0")
    pairs = [["train.steps", args.steps], ["eval.at_start", False], ["eval.num_examples", args.eval_examples]]
    if args.model:
        pairs.append(["model.name", args.model])
    if args.task:
        pairs.append(["task.name", args.task])
    pairs += [[key, str(value)] for key, value in parse_overrides(extra)]
    for profile in profiles:  # every input error surfaces now, before minutes of training
        load_config(args.config, typed(pairs), profile=profile)

    def log(text: str) -> None:
        print(f"[compare {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    specs = [RunSpec(name, args.config, name, pairs) for name in profiles]
    load_before = os.getloadavg()[0]
    results = run_all(specs, args.rounds, log)
    reference = "baseline" if "baseline" in profiles else profiles[0]
    rows = summarize(results, reference)
    notes = {name: TRADES[name] for name in profiles}
    for row in rows:
        row["quality"] = notes[row["label"]]
    payload = {"reference": reference, "steps": args.steps, "rounds": args.rounds, "cpus": os.cpu_count(),
               "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
               "rows": rows}
    if not args.json_only:
        print(format_table(rows, notes, footer=f"speed-up: median over rounds of {reference} step seconds / "
                                               "this row's (above 1 = faster)"))
    print(json.dumps(payload), flush=True)
    return 0


