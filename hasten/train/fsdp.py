"""FSDP2 behind `train.distributed=fsdp`: the policy's weights, gradients and AdamW state sharded over ranks.

    torchrun --nproc_per_node N $(which hasten) train --config run.yaml --train.distributed=fsdp

Everything else about a torchrun step is distributed.py's (whole groups per
rank, global draws, gathered rewards, losses pre-scaled by global totals);
this module changes where the weights live and how gradients meet:

    sharding     torch.distributed.fsdp.fully_shard on every decoder layer, then on the
                 whole model (the root: embeddings, final norm, lm_head, tied or not). Each
                 parameter becomes a DTensor holding 1/N of its rows; gloo on the CPU,
                 nccl on CUDA (distributed.init)
    gradients    each layer's are reduce-scattered in backward as a SUM: the rank losses
                 add up to the one-process loss, so no averaging (FSDP2's default divides
                 by N, and gloo lacks the PREMUL_SUM it would use for a custom factor: sums
                 are forced). Replaces distributed.all_reduce_gradients
    learning     the learner's packed pass calls the decoder and lm_head as two modules, not
                 the root's forward, so `before_pass` all-gathers the root's weights
                 explicitly; the layers gather themselves in their hooks. A rank's
                 collectives then depend only on its number of micro-batches, which is the
                 same on every rank (speed.token_budget, whose splits depend on the data,
                 is rejected)
    clipping     clip_grad_norm_ over the DTensor gradients computes the global norm
                 (DTensor reduces across shards); AdamW (kernels/adamw.py, any kernel) is
                 elementwise and runs on the shards as they are, its moments DTensors too
    generation   the engine needs whole weights: `full_weights` all-gathers every unit
                 (every rank, a collective) around generation and held-out eval, tells the
                 engine to rebuild its fused copies inside, and reshards after. The lean
                 engine calls no module, so no FSDP hook fires mid-decode (the hf and vLLM
                 engines are rejected). The full weights live on every rank while sampling:
                 sharding saves memory in learning (gradients, AdamW's moments, activations
                 of one layer's gather at a time), not in generation
    checkpoints  `full_model_state` / `full_optimizer_state` gather full tensors (collectives:
                 every rank calls them, rank 0 writes), so a checkpoint is the one-process
                 checkpoint: HF model files and trainer_state.pt in the same layout, loadable
                 by one process, DDP or FSDP. `load_full_weights` / `shard_optimizer_state`
                 cut the full tensors back to this rank's rows on resume
    reference    the KL reference (algo.beta > 0) is copied before sharding: a full frozen
                 copy on every rank

Left out: LoRA, algo.async_steps, speed.compile and fp16's GradScaler under
FSDP (config errors), SFT under FSDP, and prefetch / overlap tuning.
One process (no torchrun) has nothing to shard: the switch is then inert.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..config import Config
from ..device import world_size_from_env

SHARDED = "_hasten_fsdp"  # attribute set on a model `shard` sharded


def wanted(cfg: Config) -> bool:
    """train.distributed=fsdp under torchrun with more than one rank."""
    return cfg.train.distributed == "fsdp" and world_size_from_env() > 1


def is_sharded(model: torch.nn.Module) -> bool:
    return bool(getattr(model, SHARDED, False))


def shard(model: torch.nn.Module) -> None:
    """fully_shard every decoder layer, then the root; gradients reduce as sums (in place)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in _units(model):
        unit.set_gradient_divide_factor(1.0)  # a sum: the ranks' losses are shares of the global loss
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    setattr(model, SHARDED, True)
    # FSDP settles which unit is the root at the first forward through it; run one now, so the
    # learner's packed pass (which calls the decoder directly) cannot make a layer the root.
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long, device=device))
    model.reshard()


def _units(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def before_pass(model: torch.nn.Module) -> None:
    """Gather the root's weights (embeddings, norm, lm_head) for one learning pass; backward reshards them."""
    if is_sharded(model):
        model.unshard()


@contextlib.contextmanager
def full_weights(model: torch.nn.Module, engine) -> Iterator[None]:
    """Whole weights in every module while the block runs (every rank must enter: all-gathers); else nothing."""
    if not is_sharded(model):
        yield
        return
    units = _units(model)
    for unit in units:
        unit.unshard()
    engine.weights_changed()  # its fused copies are rebuilt from the gathered weights
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        engine.weights_changed()  # what it holds now points at freed storage


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on the CPU of rank 0 ({} elsewhere); a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def load_full_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's rows of full tensors (every rank read the same files) into the sharded parameters."""
    from torch.distributed.tensor import DTensor

    for name, parameter in model.named_parameters():
        if name in state:
            full = state[name].to(device=parameter.device, dtype=parameter.dtype)
            if isinstance(parameter, DTensor):
                parameter.to_local().copy_(_shard_like(full, parameter).to_local())
            else:
                parameter.copy_(full)


def _shard_like(full: torch.Tensor, like) -> Any:
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the full tensor and keeps its own rows, no communication
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def full_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state_dict with every sharded tensor gathered whole, on the CPU (a collective)."""
    from torch.distributed.tensor import DTensor

    def whole(value):
        return value.full_tensor().cpu() if isinstance(value, DTensor) else value

    entries = {index: {key: whole(value) for key, value in entry.items()} for index, entry in state["state"].items()}
    return {**state, "state": entries}


def shard_optimizer_state(state: dict[str, Any], parameters: list[torch.nn.Parameter]) -> dict[str, Any]:
    """The inverse: each full moment cut to the rows its (sharded) parameter holds here."""
    from torch.distributed.tensor import DTensor

    entries = {}
    for index, entry in state["state"].items():
        parameter = parameters[int(index)]
        entries[index] = {key: _shard_like(value, parameter)
                          if isinstance(parameter, DTensor) and value.shape == parameter.shape else value
                          for key, value in entry.items()}
    return {**state, "state": entries}
