"""Under bf16 learning with LoRA, the frozen base projections are held in bf16.

The learner reads a frozen base weight only through a bf16 cast: autocast's, or RecastLinear's, which is the
same rounding (kernels/recast_linear.py). Holding that cast in place of the fp32 weight gives the learning pass
the same bits (log-probs, losses, every adapter gradient) and frees 2 bytes a base parameter: 2.4 GiB of
Qwen2.5-1.5B's 5.75 GiB base, at the learning pass's peak and everywhere else. The casts in each forward and
backward go too.

What it changes, and so where it applies:
- The engine's merged copy and greedy evaluation start from the bf16 base, float(bf16(W)) + scale * B @ A
  (rollout/lean.py `_effective`), as a TRL run in bf16 starts from its bf16-loaded base. Sampling in bf16 rounds
  that sum once more; the learner corrects for the sampler as before (truncated importance sampling).
- Saved runs are unchanged: LoRA saves its adapters only, and hasten_base.json names the base they apply to.
- An fp32 pass over the base would need its low bits, which are gone. So the base stays fp32 where one can run:
  fp32 or fp16 learning, and the NaN guard's disable_mixed_precision action (it switches autocast off mid-run).
  It stays fp32 too where another sampler reads the weights (speed.engine_weights=shared, speculative decoding,
  vLLM, the hf engine), under speed.compile (inductor may fuse autocast's cast into another kernel, so a bf16
  weight need not give the same bits), off the CPU (not measured), under torchrun (DDP and FSDP wrap the model as they find
  it), for `hasten eval` (it never learns) and for a model handed to the Python API (its owner keeps it).

A LoRA base lies on the weights file's pages (models/__init__.py leaves it there: nothing writes it). Converted,
each weight's pages go back to the kernel at once (madvise MADV_DONTNEED on the file's private mapping, whose
pages nothing wrote: they read the file again if touched), so the conversion does not peak at the whole mapping
plus the bf16 copy.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

MADV_DONTNEED = 4  # linux/mman.h


def reason_not(device: str, lora: bool, native: bool, precision: str, engine: str, engine_weights: str,
               nan_guard_action: str, world_size: int, compiled: bool = False) -> str | None:
    """None where the frozen base is held in bf16 (this module's docstring); else why not, in a few words."""
    for reason, applies in (
            ("no LoRA: every weight trains, in fp32", not lora),
            ("fp32 learning reads the base in fp32", precision not in ("bf16", "bf16_fp32head")),
            ("off the CPU, not measured", not device.startswith("cpu")),
            ("transformers' model", not native),
            ("the sampler reads the live weights", engine != "lean" or engine_weights != "copy"),
            ("the NaN guard may switch autocast off", nan_guard_action == "disable_mixed_precision"),
            ("torchrun", world_size > 1),
            ("torch.compile may pick other kernels for a bf16 weight than for autocast's cast", compiled)):
        if applies:
            return reason
    return None


@torch.no_grad()
def hold_in_bf16(model, leave: torch.nn.Module | None = None) -> int:
    """Replace each frozen fp32 base weight under plain peft LoRA with its bf16 cast (the Parameter object kept:
    `.data`); returns the bytes of fp32 weights replaced. Biases, norms, the embedding stay fp32, and so do
    `leave` with everything inside it (the LM head: an fp32 head reads its weight in fp32), a weight any other
    parameter shares, and a layer in a peft variant (DoRA reads its base in the input's dtype)."""
    converted = 0
    pointers = [parameter.data_ptr() for parameter in model.parameters()]
    kept = set(pointers)
    mapped = _file_mappings()
    left = set(leave.modules()) if leave is not None else set()
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if (module in left or not hasattr(module, "lora_A") or type(base) is not torch.nn.Linear
                or getattr(module, "lora_variant", None) or any(getattr(module, "use_dora", {}).values())):
            continue
        weight = base.weight
        if (weight.dtype != torch.float32 or weight.requires_grad or weight.device.type != "cpu"
                or pointers.count(weight.data_ptr()) > 1):  # tied to another parameter
            continue
        old = weight.data
        weight.data = old.to(torch.bfloat16)
        converted += old.numel() * old.element_size()
        kept.discard(old.data_ptr())
        _return_pages(old, mapped, kept)
    return converted


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's private mappings of regular files (/proc/self/maps); [] where unreadable."""
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return ranges
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1][3] == "p" and fields[5].startswith("/"):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _return_pages(old: torch.Tensor, mapped: list[tuple[int, int]], kept: set[int]) -> None:
    """madvise(MADV_DONTNEED) the whole pages inside `old`'s bytes, where they lie in a private file mapping
    (never anonymous memory: there it would zero them) and no parameter still starts inside them."""
    start = old.data_ptr()
    end = start + old.numel() * old.element_size()
    if not old.is_contiguous() or not any(low <= start and end <= high for low, high in mapped):
        return
    if any(start <= pointer < end for pointer in kept):  # another tensor in there: leave its pages
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise(first, last - first, MADV_DONTNEED)  # failing, the pages stay resident: nothing else changes
