"""Where a run computes: `model.device` resolved to one torch.device, and what it can do.

    auto     CUDA when torch sees a GPU, else the CPU
    cpu      the CPU, even on a GPU machine
    cuda     a GPU: cuda:0, or under torchrun cuda:LOCAL_RANK (one GPU per rank)
    cuda:N   that GPU (one process only: under torchrun each rank takes its own)

Everything that used to ask `torch.cuda.is_available()` asks the model's
device instead (profiles, SFT's precision, compare's peak memory): a run
pinned to the CPU on a GPU machine makes the CPU's choices, and a
`cuda` request on a machine without one is one config error (exit 2), never
a silent run on the CPU.

Peak memory is the device's scarce one: torch.cuda.max_memory_allocated on a
GPU, the process's peak resident set (ru_maxrss) on the CPU.

What this machine keeps between runs (converted models, bench probes, built kernels) lives under
`cache_root()`: $HASTEN_CACHE, default ~/.cache/hasten.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .errors import ConfigError


def cache_root() -> Path:
    """$HASTEN_CACHE (default ~/.cache/hasten): the machine's cache of converted models, probes and kernels."""
    return Path(os.environ.get("HASTEN_CACHE") or Path.home() / ".cache" / "hasten")

if TYPE_CHECKING:
    import torch

# model.device's accepted values; config.py validates with it. torch is imported where a function needs it, so
# that config (and `hasten --help`) can import this module without paying for torch.
DEVICE_SETTING = re.compile(r"auto|cpu|cuda(:\d+)?")


def world_size_from_env() -> int:
    """Processes torchrun started for this run (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_device(setting: str) -> torch.device:
    """model.device -> the torch.device this process computes on; ConfigError if it cannot."""
    import torch

    if not DEVICE_SETTING.fullmatch(setting):
        raise ConfigError(f"config error: model.device must be auto, cpu, cuda or cuda:N (got {setting!r})")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"config error: model.device={setting} but torch sees no CUDA GPU here "
                          f"(torch {torch.__version__}); use model.device=cpu or auto")
    ranks = world_size_from_env()
    if ":" in setting and ranks > 1:
        raise ConfigError(f"config error: model.device={setting} pins one GPU, but torchrun started {ranks} "
                          "processes; use model.device=cuda (each rank takes cuda:LOCAL_RANK)")
    index = int(setting.split(":")[1]) if ":" in setting else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise ConfigError(f"config error: model.device asks for GPU {index}, but torch sees "
                          f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    return torch.device("cuda", index)


def bf16_supported(device: torch.device) -> bool:
    """bf16 autocast with native kernels: Ampere and newer GPUs. (The CPU's bf16 is opt-in: docs/speedups.md.)"""
    import torch

    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


def is_sharded_tensor(tensor) -> bool:
    """A DTensor: FSDP's shard of a parameter, whose whole value exists only after a gather."""
    import torch

    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


class CPUInfo(NamedTuple):
    vendor: str  # "GenuineIntel", "AuthenticAMD", or "unknown"
    model: str
    flags: frozenset[str]


@functools.cache
def cpu_info() -> CPUInfo:
    """The first CPU's vendor, model name and flags from /proc/cpuinfo (unknown / empty where unreadable)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return CPUInfo(fields.get("vendor_id", "unknown"), fields.get("model name", "unknown"),
                   frozenset(fields.get("flags", "").split()))


def cpu_has_native_bf16() -> bool:
    """The CPU has bf16 matmul instructions (AVX512-BF16 or AMX): without them bf16 is emulated and slower."""
    return bool(cpu_info().flags & {"avx512_bf16", "amx_bf16"})


def cpu_has_vnni() -> bool:
    """The CPU has int8 dot products that accumulate in int32 (AVX512-VNNI or AVX-VNNI)."""
    return bool(cpu_info().flags & {"avx512_vnni", "avx_vnni"})


@functools.cache
def cpu_int8_unavailable_reason() -> str | None:
    """None when this torch build runs int8 linears (fbgemm's dynamic quantized linear) on this CPU, else why
    not; checked once, on a small probe (kernels/int8.py runs them)."""
    import warnings

    import torch

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this torch build has no fbgemm quantized engine"
    try:
        x, weight = torch.randn(4, 64), torch.randn(16, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, weight.abs().amax(1).double() / 127,
                                                   torch.zeros(16, dtype=torch.long), 0, torch.qint8)
            out = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(quantized, None), True)
    except (RuntimeError, AttributeError) as error:
        return f"quantized::linear_dynamic failed ({error})"
    if (out - x @ weight.T).abs().max() > 0.1 * (x @ weight.T).abs().max():
        return "quantized::linear_dynamic gave wrong results on a probe"
    return None


def configure_device(device: torch.device) -> None:
    """Make `device` the current CUDA device, so kernels and NCCL of this process use it; nothing on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)


def peak_memory_mib(device: torch.device) -> float:
    """The run's peak memory on `device`, MiB: allocated GPU memory, or the CPU process's peak RSS."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def machine_bytes(device: str = "cpu") -> int:
    """The memory a run has: a GPU's own, else the machine's (a cgroup v2 limit, where lower). Fixed for a
    machine, so a resumed run resolves the same token budget (train/microbatch.py) and engine weights."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as limit:
            text = limit.read().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total
