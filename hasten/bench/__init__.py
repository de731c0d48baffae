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

B1 and B3 (and the setup B1-B3 share) live in workloads.py, B2 in b2.py, peers in peers.py, rows and
output in report.py.
B4 is here: it measures the command line itself, in fresh processes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..errors import UserError
from .contention import Neighbours, label, parse_levels
from .machine import machine_figures

WORKLOADS = ("B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8")  # B5: time to accuracy (b5.py); B6: fruit-catcher
# (games.py); B7: agentic time to accuracy (b7.py); B8: the scaling grid (scaling.py), asked for by name: it
# runs for hours at full size
DEFAULT_WORKLOADS = ("B1", "B2", "B3", "B4", "B6")  # B5 and B7 train for minutes per side: asked for by name
PEERS = ("trl", "hf", "vllm")
PEER_MODULES = {"trl": "trl", "hf": "transformers", "vllm": "vllm"}


class BenchError(UserError):
    """A bad `hasten bench` argument; str() is the one-line message."""


def _parser() -> argparse.ArgumentParser:
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
                         "bf16:train.precision=bf16,generation.precision=bf16 (repeatable)")
    b5.add_argument("--b5-minutes", type=float, default=15.0, help="training-time budget per run (default 15)")
    b5.add_argument("--b5-mark-minutes", type=float,
                    help="a checkpoint after the first step past every M training minutes (default 1; --quick 0 = "
                         "every step)")
    b5.add_argument("--b5-dir", help="where checkpoints, curves.json and the PNG go (default: a new temp directory)")
    b5.add_argument("--b5-keep-checkpoints", action="store_true", help="keep the weight files once scored")
    b5.add_argument("--b5-only-profiles", action="store_true",
                    help="hasten runs only for --profiles and --b5-variant, not for the config as it is")
    b7 = parser.add_argument_group("B7, agentic GRPO against TRL's tools= (b7.py; --seeds, --profiles as B5)")
    b7.add_argument("--b7-model", help="the model both sides start from: a name or a local checkpoint directory "
                                       "(default: --model)")
    b7.add_argument("--b7-config", help="the tool task trained (default: configs/agent-demo.yaml)")
    b7.add_argument("--b7-minutes", type=float, default=30.0, help="training-time budget per run (default 30)")
    b7.add_argument("--b7-mark-minutes", type=float,
                    help="a checkpoint after the first step past every M training minutes "
                         "(default 0: after every step)")
    b7.add_argument("--b7-dir", help="where checkpoints, curves.json and the PNG go (default: a new temp directory)")
    b7.add_argument("--b7-keep-checkpoints", action="store_true", help="keep the weight files once scored")
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


def _options(args) -> Any:
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

        try:
            return ablate_main(argv)
        except UserError as error:
            print(str(error).splitlines()[0], file=sys.stderr)
            return 2
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_request:  # --help, or a usage error argparse already printed
        return int(exit_request.code or 0)
    try:
        opts = _options(args)
        if process:
            from ..config import load_config
            from ..kernels.allocator import ensure

            ensure(load_config(opts.config, []).speed.allocator)
        results, header, limits = run(opts)
    except UserError as error:
        print(str(error).splitlines()[0], file=sys.stderr)
        return 2
    from .report import format_table, to_json
    from .results_page import write_report

    table, line = format_table(results, limits, header), to_json(results, limits, header)
    if not args.json_only:
        print(table)
    if opts.report is not None:
        write_report(opts.report, table, line, results, header, limits)
    print(line, flush=True)
    return 0


def run(opts) -> tuple[list, dict[str, Any], Any]:
    """Measure the peak, run the chosen workloads in order (each contention level), measure the peak again,
    then the rates at the model's shapes and the memory bandwidth: the run's hardware limits (cost.Limits)."""
    import torch
    import transformers

    from ..kernels.allocator import loaded as loaded_allocator
    from .cost import Limits
    from .machine import (best_rates, busy_reasons, cores, earlier_probes, matmul_at_shapes, memory_bandwidth,
                          record_probes)
    from .report import matmul_peak
    from ..ticker import Ticker
    from .b2 import run_b2, run_b2_batches
    from .workloads import HastenSide, no_progress, run_b1, run_b3

    peers_missing = [peer for peer in opts.peers if importlib.util.find_spec(PEER_MODULES[peer]) is None]
    opts.peers = [peer for peer in opts.peers if peer not in peers_missing]
    load_before = os.getloadavg()[0]  # other jobs on a shared machine skew everything: say so in the output
    size, repeats = (512, 3) if opts.quick else (2048, 5)
    threads = torch.get_num_threads()  # speed.adaptive_threads may lower them under --contention: restored below
    peak_start = matmul_peak(size, repeats)
    side, results = None, []

    def measure(workload: str) -> Any:
        nonlocal side
        if workload == "B4":
            return run_b4(opts)
        if workload == "B5":
            from .b5 import run_b5

            return run_b5(opts)
        if workload == "B7":  # B5's procedure on a tool task
            from .b7 import run_b7

            return run_b7(opts)
        if workload == "B8":  # each cell in its own processes: its own module
            from .scaling import run_b8

            return run_b8(opts)
        if workload == "B6":  # no language model: its own module
            from .games import run_b6

            return run_b6(opts)
        if side is None:
            side = HastenSide.build(opts)
        return {"B2": run_b2, "B3": run_b3}[workload](side, opts)

    def run_workload(workload: str) -> None:
        nonlocal side
        if workload == "B1":  # alternates the contention levels itself, step by step
            side = side or HastenSide.build(opts)
            results.append(run_b1(side, opts))
            return
        for level in opts.contention:  # every other workload: once per level, under its neighbours
            with Neighbours(level) as neighbours:
                measured = [measure(workload)]
                if workload == "B2" and opts.batch_sizes:  # the speculative sweep (--batch-sizes)
                    measured.append(run_b2_batches(side, opts))
            for result in measured:
                result.workload += label(level)
                result.settings["contention"] = {"neighbours": level, "load_average_before": neighbours.load_before,
                                                 "load_average_after": neighbours.load_after}
                results.append(result)

    for workload in opts.workloads:
        opts.log(f"{workload}: start")
        # A live count of the workload's timed runs (those that report one: B1-B4), its elapsed time always;
        # the log's lines print above it. Its own mode: B1's config turns a run's progress off, not the bench's.
        log = opts.log
        with Ticker(f"bench {workload}", unit="run", mode="auto") as tick:
            opts.log, opts.progress = tick.wrap(log), tick.set
            try:
                run_workload(workload)
            finally:
                opts.log, opts.progress = log, no_progress
    torch.set_num_threads(threads)
    peak_end = matmul_peak(size, repeats)
    config = side.session.policy.model.config if side is not None else _model_config(opts)
    header = {
        "model": opts.model, "quick": opts.quick, "cpus": os.cpu_count(), "cores": cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__, "trl": _version("trl"),
        "peers": opts.peers, "peers_missing": peers_missing, "contention": opts.contention,
        "peak_gflops_start": round(peak_start, 1), "peak_gflops_end": round(peak_end, 1),
        "load_average_before": round(load_before, 2), "load_average_after": round(os.getloadavg()[0], 2),
        **machine_figures(), "allocator": loaded_allocator(),
        "matmul_gflops_at_model_shapes": matmul_at_shapes(config, opts.quick),
        "memory_gbs": memory_bandwidth(opts.quick),
    }
    measured = dict(header["matmul_gflops_at_model_shapes"])
    for result in results:  # B8 measured each of its models' shapes too: the best over all of them
        for model, rates in result.settings.get("matmul_gflops_at_model_shapes", {}).items():
            measured.update({f"{model} {part}": per_shape for part, per_shape in rates.items()})
    header["best_gflops"] = best_rates(measured, max(peak_start, peak_end))
    # Too busy to measure? Against the load, the run's own two peaks and this machine's earlier probes;
    # then this run's probes join the record.
    header["busy_box"] = busy_reasons(header, earlier_probes(header))
    record_probes(header)
    return results, header, Limits(header["best_gflops"], header["memory_gbs"]["best"])


def _model_config(opts) -> Any:
    """The model's config (hidden, intermediate, vocab sizes) when no workload loaded it: load it once."""
    from ..models import load_policy
    from .workloads import bench_config

    return load_policy(bench_config(opts, 1).model, log=lambda text: None).model.config


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# ------------------------------------------------------------------ B4: startup, in fresh processes


PREPARE_SCRIPT = """
import json, sys, time
started = time.perf_counter()
from hasten.config import load_config
from hasten.train.learner import Learner
from hasten.train.trainer import prepare
imported = time.perf_counter()
spec = json.loads(sys.argv[1])
cfg = load_config(spec["config"], [tuple(pair) for pair in spec["overrides"]])
session = prepare(cfg, log=lambda text: None)
Learner.from_config(session.policy, cfg)
message = {"event": "built", "import_seconds": imported - started, "construct_seconds": time.perf_counter() - imported}
print(spec["prefix"] + json.dumps(message), flush=True)
"""


def _hasten_command() -> list[str]:
    """The installed `hasten` script beside this interpreter, else `python -m hasten.cli`."""
    script = Path(sys.executable).parent / "hasten"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "hasten.cli"]


def _wall(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - started


def _until_built(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Launch `command`; wall seconds until it prints its "built" message, plus the message."""
    from .peers import PREFIX, PeerError

    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        for line in process.stdout:
            if line.startswith(PREFIX):
                message = {**json.loads(line[len(PREFIX):]), "wall": time.perf_counter() - started}
                process.wait()
                return message
        process.wait()
        errors.seek(0)
        raise PeerError(f"{command[:3]} exited with code {process.returncode}: {errors.read()[-300:]}")


def _launch_to_first_step(command: list[str], env: dict[str, str], workdir: Path) -> tuple[float, float]:
    """Start `hasten train` for one step; seconds until its first metrics line exists, and that step's time."""
    metrics = workdir / "b4" / "metrics.jsonl"
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(command + [f"--output.dir={workdir}", "--output.name=b4"],
                                   stdout=subprocess.DEVNULL, stderr=errors, env=env)
        try:
            while process.poll() is None:
                if metrics.is_file() and metrics.read_text().endswith("\n"):  # a whole line: step 1 is done
                    elapsed = time.perf_counter() - started
                    return elapsed, json.loads(metrics.read_text().splitlines()[0])["time/step"]
                time.sleep(0.02)
            errors.seek(0)
            from .peers import PeerError

            raise PeerError(f"hasten train exited with code {process.returncode}: {errors.read()[-300:]}")
        finally:
            if process.poll() is None:
                process.terminate()  # the step is done; skip saving the checkpoint
            process.wait()


def run_b4(opts) -> Any:
    import statistics

    from ..tasks import make_task
    from ..tasks.sampler import PromptSampler
    from ..train.trainer import build_rewards
    from .peers import PREFIX, PeerError, peer_env, trl_construct
    from .report import Result, Row
    from .workloads import QUICK_OVERRIDES, bench_config, peer_model_dir, trl_spec

    rounds = opts.rounds("B4")
    help_rounds = 2 if opts.quick else max(5, opts.repeats or 0)  # ~0.1 s each: always at least 5
    env, hasten = peer_env(), _hasten_command()
    result = Result("B4", "startup, each in a fresh process (wall seconds from launch)")
    overrides = [("model.name", opts.model)] + (QUICK_OVERRIDES if opts.quick else [])
    train_command = hasten + ["train", "--config", str(opts.config), "--steps", "1"] + [
        f"--{key}={value}" for key, value in overrides]
    result.settings["hasten"] = {"help": hasten + ["--help"], "train": train_command,
                                 "prepare": "import hasten; prepare(cfg); Learner.from_config(policy, cfg)"}

    opts.log("B4: hasten --help")
    help_seconds = [_wall(hasten + ["--help"], env) for _ in range(help_rounds)]
    result.rows.append(Row("hasten --help", "hasten", "s", help_seconds))

    launches, step_seconds = [], []
    runs = help_rounds + 2 * rounds  # --help, launches, import + construction rounds
    opts.progress(help_rounds, runs)
    for round_index in range(rounds):
        opts.log(f"B4: launch to step 1, round {round_index + 1}/{rounds}")
        opts.progress(help_rounds + round_index, runs)
        with tempfile.TemporaryDirectory(prefix="hasten-bench-") as workdir:
            elapsed, step = _launch_to_first_step(train_command, env, Path(workdir))
        launches.append(elapsed)
        step_seconds.append(step)
    result.rows.append(Row("hasten train: launch -> step 1", "hasten", "s", launches,
                           extra={"step_1": statistics.median(step_seconds)}))
    # Step 1's own seconds (time/step, measured from the moment the loop calls it) taken away:
    # launch until training starts, everything built (model, engine, optimizer, run directory).
    result.rows.append(Row("hasten train: launch -> step 1 begins", "hasten", "s",
                           [launch - step for launch, step in zip(launches, step_seconds)]))

    cfg = bench_config(opts, 1)
    spec = json.dumps({"config": str(opts.config), "overrides": overrides, "prefix": PREFIX})
    prepared, constructed = [], []
    trl = "trl" in opts.peers
    with tempfile.TemporaryDirectory(prefix="hasten-bench-") as workdir:
        if trl:
            task = make_task(cfg.task)
            rows = PromptSampler(task.train_rows, cfg.train.seed).next(cfg.train.prompts_per_step)
            peer = trl_spec(cfg, rows, build_rewards(cfg, task), peer_model_dir(cfg.model.name, Path(workdir)),
                            False, 1)
            result.settings["trl"] = {"model": peer["model_dir"], **peer["config"]}
        for round_index in range(rounds):  # A B A B
            opts.log(f"B4: import + construction, round {round_index + 1}/{rounds}")
            opts.progress(help_rounds + rounds + round_index, runs)
            prepared.append(_until_built([sys.executable, "-c", PREPARE_SCRIPT, spec], env))
            if trl:
                try:
                    constructed.append(trl_construct(peer))
                except PeerError as error:
                    result.notes.append(str(error))
                    trl = False

    opts.progress(runs, runs)

    def split(messages: list[dict]) -> dict[str, float]:
        return {"import": statistics.median(m["import_seconds"] for m in messages),
                "construct": statistics.median(m["construct_seconds"] for m in messages)}

    result.rows.append(Row("hasten import+prepare", "hasten", "s", [m["wall"] for m in prepared],
                           extra=split(prepared)))
    if constructed and len(constructed) == rounds:
        result.rows.append(Row("trl import+GRPOTrainer", "peer", "s", [m["wall"] for m in constructed],
                               baseline="hasten import+prepare", extra=split(constructed)))
    elif "trl" not in opts.peers:
        result.notes.append("trl not measured: the `trl` package does not import here (pip install 'hasten[bench]')")
    result.notes.append("launch -> step 1 stops the run once step 1's metrics line is written (no checkpoint); "
                        "import+construction: wall from launch to the built object; both load the same weights")
    return result
