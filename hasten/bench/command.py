"""`hasten bench`: hasten against its peers, measured side by side on this machine.

    hasten bench [--workloads B1,B2,B3,B4,B6] [--repeats N] [--peers trl,hf,vllm] [--model NAME]
                 [--quick] [--json-only] [--config configs/b1.yaml] [--contention 0,1]
                 [--speculative ngram,layers:8] [--speculative-tokens K] [--batch-sizes 1,4,16,64]
    hasten bench --workloads B5 [--b5-config configs/demo.yaml] [--seeds 0,1,2] [--profiles balanced]
                 [--b5-minutes 15] [--b5-mark-minutes 1] [--b5-dir DIR]     (time to accuracy; b5.py)
    hasten bench --workloads B7 [--b7-model NAME|DIR] [--seeds 0,1,2] [--b7-minutes 30] [--b7-dir DIR]
                 (agentic GRPO against TRL's tools=: the calculator task, B5's procedure; b7.py)
    hasten bench --workloads B8 [--b8-lengths 64,256,1024] [--b8-models smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b]
                 [--b8-steps 3] [--b8-step-cap 600] [--b8-memory-gib G]   (scaling grid; scaling.py)
    hasten bench ... --report DIR      (also write DIR/results.md, DIR/results.json and the PNGs)
    hasten bench --ablate [--steps N] [--rounds R]      (each speed feature off alone; ablate.py)

The workloads and rules are docs/benchmarks.md's: B1 one GRPO step against
TRL's GRPOTrainer, B2 decode against transformers' generate (and vLLM), B3
the learning pass packed against padded, B4 startup against TRL's import and
construction, B5 time to accuracy against TRL (b5.py, not in the default
set: it trains for --b5-minutes per side), B7 the same on a tool task against
TRL's tools= (b7.py, asked for by name too). Runs of hasten and its peer alternate (A B A B) and every ratio
is a median over such pairs, because the machines are shared and noisy; the
fp32 matmul peak is measured in the same run (start and end, the better one
kept), with the rates at the model's shapes and the memory bandwidth, so the
`limit` column (fraction of the hardware limit, bench/cost.py and
docs/cost-model.md) means something here. Output: a table, the exact settings of
both sides, then one JSON line, last.

--contention 0,1 measures with 0, then 1 busy neighbour process
(contention.py) beside both sides: B1 alternates the levels step by step
(rows "hasten +1 busy", "trl gc=off +1 busy") and reports each side's
slowdown; any other workload runs once per level ("B2 +1 busy"). The header
carries what explains a number (machine.py): CPU and flags, oneDNN's ISA,
threads and OpenMP wait variables, matmul rates at the model's own shapes
(MKL, oneDNN, bf16), load average before and after, peak RSS.

Defaults: every workload but B5; the peers that import; 5 B1 steps (median over
steps 2..5) and 3 rounds elsewhere. `--quick` runs the tiny model at toy
sizes (2 prompts x 4 samples x 8 tokens), for tests. `--speculative` adds
B2 rows for the lean engine with speed.speculative (`lean+ngram`,
`lean+draft(layers:8)`); `--batch-sizes` adds B2-batch: decode tokens/s per
batch size, sampled and greedy, lean with and without those drafters.

This module parses the command; measure.py holds the table of workloads
(WORKLOADS) and runs them. B1 lives in b1.py, B3 (and the setup B1-B3 share) in
workloads.py, B2 in b2.py, B4 in b4.py, peers in peers.py, rows and output in
report.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import UserError, exit_code
from .contention import parse_levels
from .measure import PEER_MODULES, PEERS, WORKLOADS, run

DEFAULT_WORKLOADS = ("B1", "B2", "B3", "B4", "B6")  # B5 and B7 train for minutes per side: asked for by name


class BenchError(UserError):
    """A bad `hasten bench` argument; str() is the one-line message."""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hasten bench",
        description="Measure hasten against its peers side by side on this machine (docs/benchmarks.md B1-B8).",
        epilog="Prints a table, the settings of both sides, then one JSON line last.",
    )
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                        help=f"comma list of {', '.join(WORKLOADS)} (default: all but B5)")
    parser.add_argument("--repeats", type=int, help="B1 steps (median over 2..N; default 5), rounds elsewhere (3)")
    parser.add_argument("--peers", help="comma list of trl, hf, vllm, or none (default: those that import)")
    parser.add_argument("--trl-checkpointing", default="both", choices=("both", "off", "on"),
                        help="B1's TRL processes: gradient checkpointing off (TRL's CPU best), on (its default) "
                             "or both (default); one alone needs less memory. B7: off or on forces TRL's; both "
                             "= on only where its memory estimate passes what is available")
    parser.add_argument("--trl-bf16", action="store_true",
                        help="TRL with bf16=True (B1, B5, B7): its best on a CPU with AMX or AVX512-BF16")
    parser.add_argument("--model", default="smollm2-135m", help="model name, as for hasten train")
    parser.add_argument("--quick", action="store_true", help="tiny model, toy sizes: checks that every path runs")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    parser.add_argument("--config", help="B1 config file (default: configs/b1.yaml)")
    parser.add_argument("--speculative", default="",
                        help="B2: add lean+speculative rows, a comma list of ngram, layers:N (self-draft) or "
                             "draft model names/paths")
    parser.add_argument("--speculative-tokens", type=int, default=4, help="their k: tokens drafted per verify")
    parser.add_argument("--batch-sizes", default="",
                        help="B2: also decode at these batch sizes (comma list, e.g. 1,4,16,64), sampled and greedy, "
                             "lean with and without --speculative")
    parser.add_argument("--contention", default="0",
                        help="busy neighbour processes beside both sides: N, or a list such as 0,1 to measure "
                             "each level (B1 alternates them step by step and reports each side's slowdown)")
    b5 = parser.add_argument_group("B5, time to accuracy (b5.py)")
    b5.add_argument("--b5-config", help="the task trained (default: configs/demo.yaml)")
    b5.add_argument("--seeds", default="0",
                    help="B5, B7: comma list of train.seed values, one run per side each (default 0)")
    b5.add_argument("--profiles", default="", help="B5, B7: comma list of hasten profiles, one more hasten run each")
    b5.add_argument("--b5-variant", action="append", default=[], metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                    help="one more hasten run per seed with these config keys, e.g. "
                         "bf16:speed.precision=bf16,speed.generation_precision=bf16 (repeatable)")
    _budget_arguments(b5, "b5", 15.0, "default 1; --quick 0 = every step")
    b5.add_argument("--b5-only-profiles", action="store_true",
                    help="hasten runs only for --profiles and --b5-variant, not for the config as it is")
    b7 = parser.add_argument_group("B7, agentic GRPO against TRL's tools= (b7.py; --seeds, --profiles as B5)")
    b7.add_argument("--b7-model", help="the model both sides start from: a name or a local checkpoint directory "
                                       "(default: --model)")
    b7.add_argument("--b7-config", help="the tool task trained (default: configs/agent-demo.yaml)")
    _budget_arguments(b7, "b7", 30.0, "default 0: after every step")
    b8 = parser.add_argument_group("B8, the scaling grid (scaling.py)")
    b8.add_argument("--b8-lengths", help="comma list of completion lengths (default 64,256,1024; --quick 4,8)")
    b8.add_argument("--b8-models", help="comma list of smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b, tiny, qwen-tiny "
                                        "(default the first three; --quick tiny,qwen-tiny)")
    b8.add_argument("--b8-steps", type=int, default=3, help="steps per cell and side (median over 2..N; default 3)")
    b8.add_argument("--b8-step-cap", type=float, default=600.0, help="seconds a step may take (default 600)")
    b8.add_argument("--b8-memory-gib", type=float,
                    help="memory budget for the full-or-LoRA choice and the OOM estimate (default: available now)")
    parser.add_argument("--report", metavar="DIR",
                        help="also write the run's table (results.md), JSON line (results.json) and plots into DIR")
    parser.add_argument("--ablate", action="store_true",
                        help="instead: each speed feature off alone from the balanced profile (see --ablate --help)")
    return parser


def _budget_arguments(group, prefix: str, minutes: float, mark_default: str) -> None:
    """B5's and B7's time budget, checkpoint marks and where their checkpoints go."""
    group.add_argument(f"--{prefix}-minutes", type=float, default=minutes,
                       help=f"training-time budget per run (default {minutes:g})")
    group.add_argument(f"--{prefix}-mark-minutes", type=float,
                       help=f"a checkpoint after the first step past every M training minutes ({mark_default})")
    group.add_argument(f"--{prefix}-dir",
                       help="where checkpoints, curves.json and the PNG go (default: a new temp directory)")
    group.add_argument(f"--{prefix}-keep-checkpoints", action="store_true", help="keep the weight files once scored")


def options(args) -> Any:
    from .workloads import CONFIG_PATH, BenchOptions

    workloads = [name.strip().upper() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in workloads if name not in WORKLOADS]
    if unknown or not workloads:
        raise BenchError(f"bench error: unknown workload {', '.join(unknown) or '(none)'} "
                         f"(available: {', '.join(WORKLOADS)})")
    if args.repeats is not None and args.repeats < 1:
        raise BenchError(f"bench error: --repeats must be >= 1 (got {args.repeats})")
    if args.peers is None:
        peers = [peer for peer in PEERS if importlib.util.find_spec(PEER_MODULES[peer]) is not None]
    else:
        peers = [name.strip().lower() for name in args.peers.split(",") if name.strip() and name.strip() != "none"]
        unknown = [name for name in peers if name not in PEERS]
        if unknown:
            raise BenchError(f"bench error: unknown peer {', '.join(unknown)} (available: {', '.join(PEERS)}, none)")
    speculative = tuple(name.strip() for name in args.speculative.split(",") if name.strip())
    if args.speculative_tokens < 1:
        raise BenchError(f"bench error: --speculative-tokens must be >= 1 (got {args.speculative_tokens})")
    try:
        batch_sizes = tuple(int(size) for size in args.batch_sizes.split(",") if size.strip())
    except ValueError:
        raise BenchError(f"bench error: --batch-sizes must be a comma list of integers (got {args.batch_sizes!r})")
    if any(size < 1 for size in batch_sizes):
        raise BenchError(f"bench error: --batch-sizes must be >= 1 each (got {args.batch_sizes!r})")
    if (speculative or batch_sizes) and "B2" not in workloads:
        raise BenchError("bench error: --speculative and --batch-sizes add B2 rows; add B2 to --workloads")
    config = Path(args.config) if args.config else CONFIG_PATH
    if not config.is_file():
        raise BenchError(f"bench error: config file '{config}' does not exist (pass --config path/to/b1.yaml)")

    try:
        contention = parse_levels(args.contention)
    except ValueError as error:
        raise BenchError(f"bench error: --contention: {error}") from None
    b5 = _accuracy_options(args, "B5") if "B5" in workloads else None
    b7 = _accuracy_options(args, "B7") if "B7" in workloads else None
    if "B8" in workloads:
        from .scaling import parse_options

        b8 = parse_options(args, BenchError)
    else:
        b8 = None
    report = Path(args.report) if args.report else None
    if report is not None and report.exists() and not report.is_dir():
        raise BenchError(f"bench error: --report '{report}' exists and is not a directory")
    if report is not None:  # before measuring: a report that cannot be written would lose the results
        from ..train.preflight import check_writable_dir

        try:
            check_writable_dir(report, "--report")
        except UserError as error:
            raise BenchError(str(error).replace("config error:", "bench error:", 1)) from None
    if b8 is not None and report is not None:
        b8.plot_dir = report

    def log(text: str) -> None:
        print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    return BenchOptions(workloads=workloads, peers=peers, model=args.model if not args.quick else "tiny",
                        quick=args.quick, repeats=args.repeats, config=config, log=log,
                        trl_checkpointing={"both": (False, True), "off": (False,), "on": (True,)}[args.trl_checkpointing],
                        contention=contention, b5=b5, b7=b7, trl_bf16=args.trl_bf16, speculative=speculative,
                        speculative_tokens=args.speculative_tokens, batch_sizes=batch_sizes, b8=b8,
                        report=report)


def _accuracy_options(args, workload: str) -> Any:
    """B5's or B7's options: its --b5-* / --b7-* arguments, and the --seeds and --profiles they share."""
    from ..profiles import PROFILES
    from .b5 import DEMO_CONFIG, B5Options
    from .b7 import AGENT_CONFIG

    prefix = workload.lower()
    given = getattr(args, f"{prefix}_config")
    config = Path(given) if given else {"b5": DEMO_CONFIG, "b7": AGENT_CONFIG}[prefix]
    if not config.is_file():
        raise BenchError(f"bench error: --{prefix}-config '{config}' does not exist")
    try:
        seeds = [int(seed) for seed in args.seeds.split(",") if seed.strip()]
    except ValueError:
        raise BenchError(f"bench error: --seeds must be a comma list of integers (got '{args.seeds}')") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise BenchError(f"bench error: --seeds needs distinct integers (got '{args.seeds}')")
    profiles = [name.strip() for name in args.profiles.split(",") if name.strip()]
    unknown = [name for name in profiles if name not in PROFILES]
    if unknown:
        raise BenchError(f"bench error: unknown profile {', '.join(unknown)} (available: {', '.join(PROFILES)})")
    minutes, mark = getattr(args, f"{prefix}_minutes"), getattr(args, f"{prefix}_mark_minutes")
    mark = mark if mark is not None else (0.0 if args.quick else {"b5": 1.0, "b7": 0.0}[prefix])
    if minutes <= 0 or mark < 0:
        raise BenchError(f"bench error: --{prefix}-minutes must be > 0 and --{prefix}-mark-minutes >= 0 "
                         f"(got {minutes:g}, {mark:g})")
    variants = _variants(args) if workload == "B5" else []
    only_profiles = args.b5_only_profiles and workload == "B5"
    directory = getattr(args, f"{prefix}_dir")
    return B5Options(config, seeds, profiles, minutes, mark, Path(directory) if directory else None,
                     getattr(args, f"{prefix}_keep_checkpoints"), variants, config_run=not only_profiles,
                     model=_b7_model(args) if workload == "B7" else None)


def _variants(args) -> list[tuple[str, list[tuple[str, str]]]]:
    """--b5-variant LABEL:KEY=VALUE[,KEY=VALUE] (repeatable) -> [(label, [(key, value)])]."""
    variants = []
    for text in args.b5_variant:
        label, _, keys = text.partition(":")
        pairs = [pair.partition("=") for pair in keys.split(",") if pair.strip()]
        if not label.strip() or not label.replace("-", "").replace("_", "").isalnum() or not pairs \
                or any(not sep or not key.strip() for key, sep, _ in pairs):
            raise BenchError(f"bench error: --b5-variant '{text}' is not LABEL:KEY=VALUE[,KEY=VALUE...]")
        variants.append((label.strip(), [(key.strip(), value.strip()) for key, _, value in pairs]))
    if args.b5_only_profiles and not (args.profiles.strip() or variants):
        raise BenchError("bench error: --b5-only-profiles needs --profiles or --b5-variant (else no hasten run)")
    return variants


def _b7_model(args) -> str:
    """--b7-model checked as model.name is (a registry name, a model directory, a hub id); default --model."""
    from ..models import check_name

    if args.b7_model is None:
        return "tiny" if args.quick else args.model
    try:
        check_name(args.b7_model)
    except UserError as error:
        raise BenchError(f"bench error: --b7-model: {str(error).splitlines()[0]}") from None
    path = Path(args.b7_model).expanduser()
    return str(path.resolve()) if path.is_dir() else args.b7_model  # a directory: its absolute path, in the settings


def main(argv: list[str] | None = None, process: bool = False) -> int:
    """Run the benchmark; print the table (unless --json-only) and the JSON line. Returns the exit code.

    process: this is the `hasten bench` command's own process, which may re-execute itself on the
    allocator the B1 config's speed.allocator asks for (kernels/allocator.py); hasten's side runs here."""
    if argv and "--ablate" in argv:  # a different measurement with its own options (ablate.py)
        from .ablate import main as ablate_main

        return exit_code(lambda: ablate_main(argv))
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_request:  # --help, or a usage error argparse already printed
        return int(exit_request.code or 0)
    return exit_code(lambda: _measure_and_print(args, process))


def _measure_and_print(args, process: bool) -> int:
    opts = options(args)
    if process:
        from ..config import load_config
        from ..kernels.allocator import ensure

        ensure(load_config(opts.config, []).speed.allocator)
    results, header, limits = run(opts)
    from .report import format_table, to_json
    from .results_page import write_report

    table, line = format_table(results, limits, header), to_json(results, limits, header)
    if not args.json_only:
        print(table)
    if opts.report is not None:
        write_report(opts.report, table, line, results, header, limits)
    print(line, flush=True)
    return 0
