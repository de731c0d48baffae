"""`hasten bench --ablate`: each speed feature switched off alone from the `balanced` profile.

    hasten bench --ablate [--steps N] [--rounds R] [--model NAME] [--config configs/b1.yaml] [--json-only]

The features are the keys where `balanced` differs from `baseline`
(hasten/profiles.py), so a new switch joins the ablation by joining the
profiles. Each variant is `balanced` plus that one key set to its baseline
value, trained for N steps on the B1 workload in a fresh process (as
`hasten compare` does, so process-wide switches such as
speed.keep_freed_memory cannot leak between variants). A key that does
nothing on this machine (tf32 without CUDA, speed.allocator where
neither tcmalloc nor mimalloc loads) is listed, not run.

The ratio column is variant seconds / balanced seconds, paired by round: how
much slower the step gets without that feature, i.e. its own contribution
(above 1 = the feature helps). Features that change what is learned show it
in the mean reward. Output: the table, then one JSON line, last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..compare import RunSpec, format_table, run_all, summarize
from ..errors import UserError

CUDA_ONLY = {"train.tf32", "speed.compile"}  # inert or harmful on this CPU; see docs/speedups.md


def inert_reason(key: str, cuda: bool) -> str | None:
    """Why switching `key` off would measure nothing on this machine, or None."""
    from ..kernels.allocator import resolve

    if key in CUDA_ONLY and not cuda:
        return "CUDA only"
    if key == "speed.allocator" and resolve("auto") == "glibc":
        return "neither tcmalloc nor mimalloc loads here: auto is glibc"
    return None


def features(cuda: bool) -> tuple[dict[str, object], list[str]]:
    """(key -> its baseline value for every feature balanced switches on here, keys listed but not run)."""
    from ..config import Config
    from ..profiles import resolve

    balanced, baseline = resolve("balanced", Config()), resolve("baseline", Config())
    differing = {key: baseline[key] for key in balanced if key in baseline and balanced[key] != baseline[key]}
    inert = [key for key in differing if inert_reason(key, cuda)]
    return {key: value for key, value in differing.items() if key not in inert}, inert


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hasten bench --ablate",
                                     description="Each speed feature switched off alone from the balanced profile.")
    parser.add_argument("--ablate", action="store_true", required=True)
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps per variant (median over 2..N; default 3)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the variant sequence (paired ratios)")
    parser.add_argument("--model", default="smollm2-135m", help="model name, as for hasten train")
    parser.add_argument("--config", help="workload config (default: configs/b1.yaml)")
    parser.add_argument("--quick", action="store_true", help="tiny model, toy sizes, first two features only")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    return parser


def main(argv: list[str]) -> int:
    import torch

    from .workloads import CONFIG_PATH, QUICK_OVERRIDES

    args = _parser().parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        raise UserError("bench error: --steps and --rounds must be >= 1")
    config = args.config or str(CONFIG_PATH)
    if not os.path.isfile(config):
        raise UserError(f"bench error: config file '{config}' does not exist")
    cuda = torch.cuda.is_available()
    switched, inert = features(cuda)
    if args.quick:
        switched = dict(list(switched.items())[:2])
    base = [["train.steps", args.steps], ["eval.num_examples", 0], ["model.name", args.model]]
    base += [[key, value] for key, value in QUICK_OVERRIDES] if args.quick else []
    specs = [RunSpec("balanced", config, "balanced", base)]
    specs += [RunSpec(f"-{key.split('.', 1)[1]}", config, "balanced", base + [[key, value]])
              for key, value in switched.items()]

    def log(text: str) -> None:
        print(f"[ablate {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()[0]
    rows = summarize(run_all(specs, args.rounds, log), "balanced")
    for row in rows:  # the ratio here is variant / balanced: what the missing feature costs
        row["slowdown"] = 1 / row.pop("speedup")
    notes = {f"-{key.split('.', 1)[1]}": f"{key}={value!r} (its baseline value)" for key, value in switched.items()}
    payload = {"reference": "balanced", "steps": args.steps, "rounds": args.rounds, "model": args.model,
               "config": config, "not_run": {key: inert_reason(key, cuda) for key in inert}, "cpus": os.cpu_count(),
               "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
               "rows": rows}
    if not args.json_only:
        print(format_table(rows, notes, first="variant", ratio=("slowdown", "slowdown"),
                           default_note="all of balanced",
                           footer="slowdown: median over rounds of this row's step seconds / balanced's "
                                  "(above 1 = the feature helps here)"))
        if inert:
            print("not run here: " + ", ".join(f"{key} ({inert_reason(key, cuda)})" for key in inert))
    print(json.dumps(payload), flush=True)
    return 0
