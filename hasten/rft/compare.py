"""`hasten rft compare`: every SFT profile on the same records, side by side.

Each profile trains in its own fresh process (`hasten sft --profile NAME`),
so one profile's compiled code, allocator state or threads never help the
next; same records, seed, learning rate, epochs and batch size for all.
With `--rounds N` the profiles run N times, in reverse order on odd
rounds (A B C, C B A, ...), and each speed-up is the median over rounds of
(plain's time / the profile's time in the same round): the machine is
shared, so only ratios of neighbouring runs mean much (docs/benchmarks.md).
Time is the optimizer steps only (no model load, no eval). Each profile's
own checkpoint is then tested on the held-out questions: since profiles
only change how the same training runs, their accuracies should agree up
to float rounding, and a profile that learned less shows it here.

Output: a table, then one JSON line, last.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from .profiles import PROFILES
from ..errors import UserError

BASELINE = "plain"


class CompareError(UserError):
    """A bad `hasten rft compare` argument or a profile run that failed; one line."""


def run_profile(profile: str, sft_args: list[str], output_dir: Path, log: Callable[[str], None]) -> dict:
    """One `hasten sft --profile` run in a fresh process; its report dict."""
    command = [sys.executable, "-m", "hasten.cli", "sft", "--profile", profile, "--json", *sft_args,
               f"--output.dir={output_dir}", "--output.progress=off"]
    log(f"compare: {profile} ...")
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CompareError(f"compare error: profile {profile} failed (exit {done.returncode}): {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(profiles: list[str], rounds: int, sft_args: list[str], output_dir: Path,
            log: Callable[[str], None] = print) -> dict:
    unknown = [name for name in profiles if name not in PROFILES]
    if unknown or not profiles:
        raise CompareError(f"compare error: unknown profile {', '.join(unknown) or '(none)'} "
                           f"(available: {', '.join(PROFILES)})")
    if rounds < 1:
        raise CompareError(f"compare error: --rounds must be >= 1 (got {rounds})")
    if BASELINE not in profiles:
        profiles = [BASELINE, *profiles]
    runs: dict[str, list[dict]] = {name: [] for name in profiles}
    for round_index in range(rounds):
        order = profiles if round_index % 2 == 0 else list(reversed(profiles))
        for name in order:
            runs[name].append(run_profile(name, sft_args, output_dir / f"round{round_index + 1}", log))
    rows = []
    for name in profiles:
        times = [run["train_seconds"] for run in runs[name]]
        ratios = [base["train_seconds"] / run["train_seconds"] for base, run in zip(runs[BASELINE], runs[name])]
        last = runs[name][-1]
        rows.append({
            "profile": name, "description": PROFILES[name].description,
            "train_seconds": statistics.median(times), "speedup": statistics.median(ratios),
            "tokens_per_second": statistics.median(run["tokens_per_second"] for run in runs[name]),
            "final_loss": last["final_loss"], "accuracy": last["eval"].get("accuracy"),
            "answer_rate": last["eval"].get("answer_rate"),
            "weights_mb": last.get("adapter_mb", last.get("model_mb")),  # LoRA adapters or the whole model
            "settings": last["settings"], "checkpoint": last["checkpoint"],
        })
    first = runs[BASELINE][-1]
    return {"rounds": rounds, "examples": first["examples"], "optimizer_steps": first["optimizer_steps"],
            "trained_tokens": first["trained_tokens"], "profiles": rows}


def _number(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(result: dict) -> str:
    header = ("profile", "train s", "speed-up", "tok/s", "final loss", "accuracy", "answer rate", "MB", "what")
    lines = [header]
    for row in result["profiles"]:
        lines.append((row["profile"], _number(row["train_seconds"], 1), _number(row["speedup"], 2) + "x",
                      _number(row["tokens_per_second"], 0), _number(row["final_loss"], 4),
                      _number(row["accuracy"], 3), _number(row["answer_rate"], 3), _number(row["weights_mb"], 1),
                      row["description"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(text) + (f"\n{result['examples']} examples, {result['optimizer_steps']} optimizer steps, "
                              f"{result['trained_tokens']} trained tokens per run; "
                              f"speed-up = median over {result['rounds']} round(s) of plain time / profile time")


def default_output_dir() -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-rft-compare"
