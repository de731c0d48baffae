"""Memory-side switches: gradient checkpointing and the reference model's offload.

gradient checkpointing (speed.gradient_checkpointing): transformers'
per-layer activation checkpointing, non-reentrant. Activations of a layer
are recomputed in backward instead of kept: far less memory, about one more
forward of compute. Generation is unaffected (engines run in eval mode,
where checkpointing is off).

reference offload (speed.offload_reference): the frozen KL reference (beta >
0, full fine-tune) lives on the CPU and visits the policy's device only for
its no-grad pass. Saves a model's worth of accelerator memory for two copies
per step; on a CPU-only run the two devices are the same and nothing moves.
"""

from __future__ import annotations

import contextlib

import torch


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
