"""torch.compile (speed.compile, speed.compile_mode) with a capability check and a logged fallback.

What is compiled: each decoder layer of the policy, in place
(`nn.Module.compile`), with dynamic shapes, because every GRPO step has new
sequence lengths. In place keeps parameter names, so checkpoints save as
before; per layer keeps graphs small and lets the packed learning pass, the
transformers engine and the reference pass all use the compiled layers.

When it cannot help it says why and runs eager:
- dynamo does not support this Python/torch build;
- CUDA with compute capability < 7.0 (Triton needs Volta or newer);
- CPU without a C++ compiler (inductor's CPU backend generates C++).
Errors while compiling a graph fall back to eager for that graph
(torch._dynamo.config.suppress_errors), so a model dynamo cannot trace still
trains. On a 2-core CPU the compile time (minutes for 135M) is rarely paid
back in a short run; docs/results/speedups-notes.md has the measurement.
"""

from __future__ import annotations

import shutil
from typing import Callable

import torch


def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile cannot be used on `device`, or None if it can."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python/torch build"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 7:
            return f"CUDA capability {major}.{minor} < 7.0 (Triton needs Volta or newer)"
        return None
    if device.type == "cpu" and not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        return "no C++ compiler found (inductor's CPU backend needs g++ or clang++)"
    return None


def decoder_layers(model) -> list[torch.nn.Module]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(base.get_decoder(), "layers", None)
    return list(layers) if layers is not None else []


def compile_model(model, mode: str = "default", log: Callable[[str], None] = print,
                  unavailable: Callable[[torch.device], str | None] = compile_unavailable) -> bool:
    """Compile the decoder layers in place; False (and a log line) when falling back to eager."""
    device = next(model.parameters()).device
    reason = unavailable(device)
    layers = decoder_layers(model)
    if reason is None and not layers:
        reason = "the model has no decoder .layers to compile"
    if reason is not None:
        log(f"speed.compile: running eager ({reason})")
        return False
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a graph that fails to compile runs eager
    from .grouped_attention import keep_out_of_graphs

    keep_out_of_graphs()  # its per-step layout would recompile the layers every step
    for layer in layers:
        layer.compile(mode=None if mode == "default" else mode, dynamic=True)
    log(f"speed.compile: {len(layers)} decoder layers compiled (mode {mode}, dynamic shapes)")
    return True
