"""What explains a number of `hasten bench` on this machine, printed in its header.

- The CPU, its vector extensions and oneDNN's ISA cap: machines of one kind
  differ by 2x in vector throughput.
- The threads and the OpenMP variables that decide how idle threads wait
  (spin or sleep) and where they run: they decide what a busy neighbour
  costs (`--contention`).
- Matmul rates at the model's own shapes, not only the large square peak:
  `x (M, K) @ W.T (K, N)` for the fused attention projection, the fused
  MLP gate+up, the MLP down projection and the LM head, at M = the learning
  pass's token count and M = a decode step's rows, through each kernel hasten
  can use: MKL's sgemm (F.linear, fp32), oneDNN (fp32: packed weights as the
  lean engine uses at decode, plain weights as speed.fast_linear uses in the
  learning pass) and F.linear in bf16. Each rate is the best of a few calls
  within a small time budget, so the whole block stays within seconds.
- Whether the box was too busy to measure (`busy_reasons`): the load average
  before the run above the cores, the peak moving over 2x within the run, or a
  probe under half of what this machine reached before. Earlier figures are
  kept per machine (CPU, cores, probe size) in $HASTEN_CACHE/bench/probes.json,
  the last 20 runs: busy runs too, since a low figure never raises the best.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable

# Variables that change how OpenMP threads wait and where they run (GNU libgomp and Intel's libiomp).
WAIT_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_SPINCOUNT",
                  "KMP_BLOCKTIME", "KMP_AFFINITY", "MKL_NUM_THREADS")
LEARNING_ROWS = 1700  # B1's learning pass: 32 samples x ~53 model-input tokens (prompt once per group + completion)
DECODE_ROWS = 64  # a decode step over 64 live rows (8 prompts x 8 samples)


def machine_figures() -> dict[str, Any]:
    """The CPU, its vector extensions, oneDNN's ISA, the OpenMP wait variables, threads, peak RSS."""
    import torch

    from ..device import cpu_info

    model, flags = cpu_info().model, cpu_info().flags
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {"cpu": model, "cpu_flags": [flag for flag in wanted if flag in flags],
            "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default (best the CPU has)"),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "omp_env": {name: os.environ.get(name) for name in WAIT_VARIABLES if os.environ.get(name) is not None},
            "peak_rss_mib": peak_rss_mib()}


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (each B1 side reports its own after each step)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def minor_faults() -> int:
    """Minor page faults of this process so far (each B1 side counts its own around a step).

    Each fresh page costs system time, so a step whose allocations outgrow the heap
    pays seconds (B1 rows print faults per step).
    """
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def model_shapes(config) -> dict[str, tuple[int, int]]:
    """name -> (K, N) of the model's matmuls, read from a transformers-style config."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return {
        "qkv": (hidden, (heads + 2 * kv) * head_dim),  # q, k, v fused
        "gate_up": (hidden, 2 * config.intermediate_size),  # the MLP's two input projections fused
        "down": (config.intermediate_size, hidden),
        "head": (hidden, config.vocab_size),  # the LM head
    }


def _best_rate(call: Callable[[], Any], flops: float, budget: float, repeats: int) -> float:
    """GFLOP/s of the fastest of up to `repeats` timed calls after one warm-up, stopping early past `budget` s."""
    started = time.perf_counter()
    call()  # warm-up: packing caches, thread pool, first-touch pages
    first = time.perf_counter() - started
    best, spent = first, first
    for _ in range(repeats):
        if spent > budget:
            break
        began = time.perf_counter()
        call()
        elapsed = time.perf_counter() - began
        best, spent = min(best, elapsed), spent + elapsed
    return flops / best / 1e9


def matmul_at_shapes(config, quick: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """{"M=1700": {"qkv 576x960": {"mkl": GFLOP/s, "onednn": ..., "bf16": ...}, ...}, "M=64": {... "int8": ...}}."""
    import torch
    import torch.nn.functional as F

    from ..rollout.lean import Matmul
    from ..kernels import fast_linear

    repeats, budget = (1, 0.02) if quick else (5, 0.25)
    rows = (128, 16) if quick else (LEARNING_ROWS, DECODE_ROWS)
    packed = Matmul(torch.float32, torch.device("cpu"))
    from ..device import cpu_int8_unavailable_reason

    int8_matmul = Matmul(torch.float32, torch.device("cpu"), "int8") if cpu_int8_unavailable_reason() is None else None
    plain_onednn = fast_linear.available()
    out: dict[str, dict[str, dict[str, float]]] = {}
    generator = torch.Generator().manual_seed(0)
    for count in rows:
        per_shape: dict[str, dict[str, float]] = {}
        for name, (k, n) in model_shapes(config).items():
            x, weight = torch.randn(count, k, generator=generator), torch.randn(n, k, generator=generator)
            flops = 2.0 * count * k * n
            rates = {"mkl": _best_rate(lambda: F.linear(x, weight), flops, budget, repeats)}
            if count == rows[1] and packed.packed:  # decode: the lean engine's packed weights
                prepared = packed.prepare(weight)
                rates["onednn"] = _best_rate(lambda: packed(x, prepared), flops, budget, repeats)
            elif count == rows[0] and plain_onednn:  # learning: speed.fast_linear's oneDNN on plain weights
                rates["onednn"] = _best_rate(lambda: fast_linear._onednn(x, weight), flops, budget, repeats)
            x16, weight16 = x.bfloat16(), weight.bfloat16()
            rates["bf16"] = _best_rate(lambda: F.linear(x16, weight16), flops, budget, repeats)
            if count == rows[1] and int8_matmul is not None:  # decode: generation.precision=int8's kernel
                prepared8 = int8_matmul.prepare(weight)  # no name: plain int8, no statistics carried
                rates["int8"] = _best_rate(lambda: int8_matmul(x, prepared8), flops, budget, repeats)
            per_shape[f"{name} {k}x{n}"] = {kernel: round(rate, 1) for kernel, rate in rates.items()}
        out[f"M={count}"] = per_shape
    return out


def memory_bandwidth(quick: bool = False) -> dict[str, float]:
    """GB/s of a STREAM-like probe in torch on all threads: read (a sum), copy (b -> a), triad (a = b + s c).

    Arrays of 64 MiB each (quick: 4 MiB), well past the last-level cache; each figure is the best of a
    few passes. STREAM's byte counts: read 1, copy 2, triad 3 arrays (write-allocate traffic not counted).
    Decode mostly reads (weights, KV cache), so the denominator the fractions use is the best of the three.
    """
    import torch

    elements = (1 << 20) if quick else (16 << 20)
    a, b, c = torch.zeros(elements), torch.rand(elements), torch.rand(elements)
    size = elements * 4
    probes = {"read": (lambda: b.sum(), size), "copy": (lambda: a.copy_(b), 2 * size),
              "triad": (lambda: torch.add(b, c, alpha=3.0, out=a), 3 * size)}
    out = {}
    for name, (call, moved) in probes.items():
        out[name] = round(_best_rate(call, moved, budget=0.02 if quick else 0.5, repeats=3 if quick else 10), 2)
    out["best"] = max(out.values())
    return out  # _best_rate's "GFLOP/s" of bytes: GB/s


def best_rates(at_shapes: dict[str, dict[str, dict[str, float]]], square_fp32: float) -> dict[str, float]:
    """The best matmul GFLOP/s per precision over every kernel and shape measured: the peak a phase divides by.

    fp32: MKL (the square peak and F.linear at the model's shapes) and oneDNN (fast_linear's plain weights,
    the lean engine's packed ones); bf16: F.linear in bf16. The best, not MKL's alone: a learning pass on
    oneDNN at 470 GFLOP/s divided by MKL's 210 read 116% (issue 33). int8: the int8 sampler's kernel
    (kernels/int8.py) at the decode shapes, the rate an int8 generate phase's floor divides by.
    """
    best = {"fp32": square_fp32, "bf16": 0.0, "int8": 0.0}
    for per_shape in at_shapes.values():
        for rates in per_shape.values():
            for kernel, rate in rates.items():
                precision = kernel if kernel in ("bf16", "int8") else "fp32"
                best[precision] = max(best[precision], rate)
    return {precision: round(rate, 1) for precision, rate in best.items() if rate > 0}


# ------------------------------------------------------------------ is the box too busy to measure?

BUSY_PROBE_FRACTION = 0.5  # a probe under half the machine's own best earlier figure: something else ran
PROBE_HISTORY = 20  # earlier figures kept per machine


def cores() -> int:
    """The cores this process may run on (its affinity), which the load average is compared with."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def probes_path() -> Path:
    """Where earlier runs' probe figures are kept: $HASTEN_CACHE/bench/probes.json (default ~/.cache/hasten)."""
    from ..models.smollm2 import cache_root

    return cache_root() / "bench" / "probes.json"


def machine_key(header: dict[str, Any]) -> str:
    """Probes compare only with the same CPU, core count and probe sizes (--quick's are smaller)."""
    return f"{header.get('cpu')} | {header.get('cores')} cores | {'quick' if header.get('quick') else 'full'} probes"


def _probes(header: dict[str, Any]) -> dict[str, float]:
    """This run's probe figures: the best fp32 matmul peak and the best memory bandwidth."""
    peaks = [header.get("peak_gflops_start") or 0.0, header.get("peak_gflops_end") or 0.0]
    return {"fp32_gflops": float(max(peaks)), "bandwidth_gbs": float((header.get("memory_gbs") or {}).get("best", 0.0))}


def busy_reasons(header: dict[str, Any], earlier: dict[str, list[float]] | None = None) -> list[str]:
    """Why this run's figures should not be quoted (docs/benchmarks.md, "A busy box"); [] when none.

    - the load average before the run was above the cores this process may use (other work was running);
    - the matmul peak at the end of the run differs from the one at its start by over 2x (the machine's
      speed changed under the run);
    - a probe (the fp32 matmul peak, the memory bandwidth) is under BUSY_PROBE_FRACTION of the best this
      machine reached in earlier runs (`earlier`: probe name -> figures, from `probes_path()`).
    """
    reasons = []
    load, count = header.get("load_average_before"), header.get("cores") or cores()
    if isinstance(load, (int, float)) and load > count:
        reasons.append(f"load average {load:.2f} before the run, above the {count} cores")
    start, end = header.get("peak_gflops_start") or 0.0, header.get("peak_gflops_end") or 0.0
    if min(start, end) > 0 and max(start, end) > 2 * min(start, end):
        reasons.append(f"the matmul peak moved from {start:.1f} to {end:.1f} GFLOP/s during the run")
    labels = {"fp32_gflops": ("matmul peak", "GFLOP/s"), "bandwidth_gbs": ("memory bandwidth", "GB/s")}
    for name, value in _probes(header).items():
        best = max((earlier or {}).get(name) or [0.0])
        if best > 0 and value < BUSY_PROBE_FRACTION * best:
            label, unit = labels[name]
            reasons.append(f"{label} {value:.3g} {unit}, under {100 * BUSY_PROBE_FRACTION:.0f}% of this machine's "
                           f"best earlier figure ({best:.3g} {unit})")
    return reasons


def earlier_probes(header: dict[str, Any], path: Path | None = None) -> dict[str, list[float]]:
    """This machine's earlier probe figures ({} when there are none or the record cannot be read)."""
    try:
        record = json.loads((path or probes_path()).read_text())
        return {name: [float(value) for value in values]
                for name, values in record.get(machine_key(header), {}).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def record_probes(header: dict[str, Any], path: Path | None = None) -> None:
    """Add this run's probe figures to the record (the last PROBE_HISTORY per machine); a cache that cannot
    be written costs the next run its comparison, never this run."""
    path = path or probes_path()
    try:
        record = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(record, dict):
            record = {}
    except (OSError, ValueError):
        record = {}
    entry = record.setdefault(machine_key(header), {})
    for name, value in _probes(header).items():
        if value > 0:
            entry[name] = ([float(v) for v in entry.get(name, []) if isinstance(v, (int, float))] + [value])[
                -PROBE_HISTORY:]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        os.replace(temporary, path)
    except OSError:
        pass


def model_config(directory: str):
    """The model's config without loading its weights (a registry name: its directory's config)."""
    from transformers import AutoConfig

    from ..models import ALIASES

    if ALIASES.get(directory.lower()) == "tiny":
        from ..models.tiny import tiny_model, tiny_tokenizer

        return tiny_model(len(tiny_tokenizer())).config
    return AutoConfig.from_pretrained(directory)


if __name__ == "__main__":
    if sys.argv[1:] != ["rates"]:
        sys.exit("usage: python -m hasten.bench.machine rates   (B8's probe: scaling.rates_in_child)")
    request = json.loads(sys.stdin.readline())
    print(json.dumps(matmul_at_shapes(model_config(request["directory"]), request["quick"])), flush=True)
