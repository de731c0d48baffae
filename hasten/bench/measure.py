"""The table of `hasten bench`'s workloads, and the run: the hardware limits measured around the workloads.

WORKLOADS maps a name to its function, which takes the run's Bench (the
options, and hasten's B1 setup, built on first use and shared by B1-B3) and
returns its Results. measure() runs one workload at every contention level
(B1 alternates the levels itself, step by step); run() measures the chosen
workloads in order, between two matmul-peak probes, and returns their
Results with the run's header and hardware limits, which report.py formats.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable

from .contention import Neighbours, label
from .machine import machine_figures
from .report import Result
from .workloads import BenchOptions, HastenSide

PEERS = ("trl", "hf", "vllm")
PEER_MODULES = {"trl": "trl", "hf": "transformers", "vllm": "vllm"}


@dataclass
class Bench:
    """What one run's workloads share: the options, and hasten's B1 setup (built on first use)."""

    opts: BenchOptions
    built: HastenSide | None = None

    @property
    def side(self) -> HastenSide:
        if self.built is None:
            self.built = HastenSide.build(self.opts)
        return self.built


# Each workload's module is imported when it runs: B6 imports torch and the game, B5/B7/B8 their trainers.
def _b1(bench: Bench) -> list[Result]:
    from .b1 import run_b1

    return [run_b1(bench.side, bench.opts)]


def _b2(bench: Bench) -> list[Result]:
    from .b2 import run_b2, run_b2_batches

    results = [run_b2(bench.side, bench.opts)]
    if bench.opts.batch_sizes:  # the speculative sweep (--batch-sizes)
        results.append(run_b2_batches(bench.side, bench.opts))
    return results


def _b3(bench: Bench) -> list[Result]:
    from .workloads import run_b3

    return [run_b3(bench.side, bench.opts)]


def _b4(bench: Bench) -> list[Result]:  # the command line itself, in fresh processes
    from .b4 import run_b4

    return [run_b4(bench.opts)]


def _b5(bench: Bench) -> list[Result]:
    from .b5 import run_b5

    return [run_b5(bench.opts)]


def _b6(bench: Bench) -> list[Result]:  # no language model
    from .games import run_b6

    return [run_b6(bench.opts)]


def _b7(bench: Bench) -> list[Result]:  # B5's procedure on a tool task
    from .b7 import run_b7

    return [run_b7(bench.opts)]


def _b8(bench: Bench) -> list[Result]:  # each cell in its own processes
    from .scaling import run_b8

    return [run_b8(bench.opts)]


# B5: time to accuracy (b5.py); B6: fruit-catcher (games.py); B7: agentic time to accuracy (b7.py); B8: the
# scaling grid (scaling.py), asked for by name: it runs for hours at full size
WORKLOADS: dict[str, Callable[[Bench], list[Result]]] = {
    "B1": _b1, "B2": _b2, "B3": _b3, "B4": _b4, "B5": _b5, "B6": _b6, "B7": _b7, "B8": _b8}
OWN_LEVELS = ("B1",)  # alternates the contention levels itself, step by step


def measure(bench: Bench, workload: str) -> list[Result]:
    """One workload's Results: once per contention level, under its neighbours (B1: once, at all levels)."""
    if workload in OWN_LEVELS:
        return WORKLOADS[workload](bench)
    results = []
    for level in bench.opts.contention:
        with Neighbours(level) as neighbours:
            measured = WORKLOADS[workload](bench)
        for result in measured:
            result.workload += label(level)
            result.settings["contention"] = {"neighbours": level, "load_average_before": neighbours.load_before,
                                             "load_average_after": neighbours.load_after}
        results += measured
    return results


def run(opts: BenchOptions) -> tuple[list, dict[str, Any], Any]:
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
    from .workloads import no_progress

    peers_missing = [peer for peer in opts.peers if importlib.util.find_spec(PEER_MODULES[peer]) is None]
    opts.peers = [peer for peer in opts.peers if peer not in peers_missing]
    load_before = os.getloadavg()[0]  # other jobs on a shared machine skew everything: say so in the output
    size, repeats = (512, 3) if opts.quick else (2048, 5)
    threads = torch.get_num_threads()  # speed.adaptive_threads may lower them under --contention: restored below
    peak_start = matmul_peak(size, repeats)
    bench, results = Bench(opts), []
    for workload in opts.workloads:
        opts.log(f"{workload}: start")
        # A live count of the workload's timed runs (those that report one: B1-B4), its elapsed time always;
        # the log's lines print above it. Its own mode: B1's config turns a run's progress off, not the bench's.
        log = opts.log
        with Ticker(f"bench {workload}", unit="run", mode="auto") as tick:
            opts.log, opts.progress = tick.wrap(log), tick.set
            try:
                results += measure(bench, workload)
            finally:
                opts.log, opts.progress = log, no_progress
    torch.set_num_threads(threads)
    peak_end = matmul_peak(size, repeats)
    config = bench.built.session.policy.model.config if bench.built is not None else _model_config(opts)
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
