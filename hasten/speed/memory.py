"""Memory-side switches and the pack-ratio gate.

gradient checkpointing (speed.gradient_checkpointing): transformers'
per-layer activation checkpointing, non-reentrant. Activations of a layer
are recomputed in backward instead of kept: far less memory, about one more
forward of compute. Generation is unaffected (engines run in eval mode,
where checkpointing is off).

reference offload (speed.offload_reference): the frozen KL reference (beta >
0, full fine-tune) lives on the CPU and visits the policy's device only for
its no-grad pass. Saves a model's worth of accelerator memory for two copies
per step; on a CPU-only run the two devices are the same and nothing moves.

pack ratio (speed.min_pack_ratio): the packed learning pass puts each group
in one row; rows of very different lengths pad to the longest. The ratio is
real tokens / row slots of the packed batch; below min_pack_ratio the plain
padded pass is used for that chunk instead (0 = always pack).
"""

from __future__ import annotations

import contextlib

import torch

from ..rollout import Rollout


def set_gradient_checkpointing(model, enabled: bool) -> None:
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()


@contextlib.contextmanager
def on_device(module: torch.nn.Module, device: torch.device, offload: bool):
    """Move `module` to `device` for the block and back to the CPU after, when offloading."""
    if not offload:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to("cpu")


def pack_ratio(rollout: Rollout, rows: torch.Tensor) -> float:
    """Real tokens / slots of the packed batch for samples `rows` (one row per group, as packing.py)."""
    lengths = rollout.completion_mask.sum(dim=1)  # (N,)
    prompts = rollout.prompt_mask.sum(dim=1)  # (B,)
    row_lengths: dict[int, int] = {}
    for sample in rows.tolist():
        group = sample // rollout.num_generations
        # the prompt once, then each completion without its last token (only a target)
        row_lengths.setdefault(group, int(prompts[group]))
        row_lengths[group] += max(int(lengths[sample]) - 1, 0)
    if not row_lengths:
        return 1.0
    return sum(row_lengths.values()) / (len(row_lengths) * max(row_lengths.values()))
