"""Data parallel over torch.distributed: one process per rank, started by torchrun.

    torchrun --nproc_per_node N $(which hasten) train --config run.yaml
    torchrun --nnodes M --nproc_per_node N --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        $(which hasten) train --config run.yaml

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; `init` joins the process group
(gloo on the CPU, nccl on CUDA, one GPU per rank: device.py). Without them
every helper here is the identity and nothing is imported or initialized,
so a single process runs exactly the code it ran before this module existed.

How one GRPO step splits over N ranks (trainer.py, learner.py), so that it
computes what one process computes for the same global batch and seed:

    prompts     every rank draws the same global prompt stream (one seed) and keeps its
                slice of whole groups (`group_slice`): a group never spans ranks, so
                group-relative advantages need nothing from another rank
    sampling    rank r samples its rows with the draws of those rows of the global batch
                (rollout.RowRange): the tokens do not depend on how the batch is split
    rewards     scored where they were sampled; totals, per-function scores and lengths are
                all-gathered (`gather_rows`), so batch-scaled advantages and the logged
                statistics are the global batch's
    loss        each rank's loss is pre-scaled by the global totals (completion tokens,
                sequences: `sum_over_ranks`), so the rank losses add up to the 1-process loss
    gradients   summed over ranks after the last backward, before clipping
                (`all_reduce_gradients`: one flat all-reduce per dtype). The sum of the rank
                losses' gradients is the 1-process gradient; DDP would average (and need the
                loss scaled by N) and overlaps communication with backward, which matters on
                GPUs with large models and is left for later
    state       replicated: every rank holds the same weights and optimizer state; rank 0
                alone writes the run directory (the others get a `FollowerRunDir` at the same
                path) and every rank restores from it on resume (a shared filesystem across
                machines)
    signals     a stop asked on any rank is agreed after every step (`agree_signal`), so all
                ranks save and stop at the same step; loop.py acts on the agreed stop only

Sharded weights instead of replicated ones: train.distributed=fsdp (fsdp.py;
the split above stays, only where weights and gradients live changes).
Left out on purpose: dynamic sampling and feedback-driven curricula
under several ranks (their refills and sampler updates depend on every
rank's rewards; `check_config` rejects them), the game policy (its episodes
would repeat on every rank).
"""

from __future__ import annotations

import atexit
import datetime
from typing import Any, Callable, TypeVar

import torch

from ..config import Config, ConfigError, validate_ranks
from ..device import world_size_from_env
from ..errors import UserError
from .outputs import RunDir

T = TypeVar("T")
TIMEOUT = datetime.timedelta(minutes=30)  # rank 0's held-out eval runs while the others wait at the next step


def init(device: torch.device) -> None:
    """Join torchrun's process group (once); a no-op without torchrun."""
    import torch.distributed as dist

    if world_size_from_env() <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT, device_id=device if device.type == "cuda" else None)
    atexit.register(_shutdown)


def _shutdown() -> None:
    """Leave the group together: a rank that tore gloo down while its peer still had work in flight
    aborted (SIGABRT, "terminate called without an active exception"; seen in 1 of ~3 FSDP runs)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:  # bounded: a peer that died or already left must not hold this rank for the group timeout
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        except RuntimeError:
            pass
    dist.destroy_process_group()


def _active() -> bool:
    if world_size_from_env() <= 1:
        return False
    import torch.distributed as dist

    return dist.is_initialized()


def world_size() -> int:
    if not _active():
        return 1
    import torch.distributed as dist

    return dist.get_world_size()


def rank() -> int:
    if not _active():
        return 0
    import torch.distributed as dist

    return dist.get_rank()


def is_main() -> bool:
    """Rank 0: the one process that writes files and prints."""
    return rank() == 0


def main_only(log: Callable[[str], None]) -> Callable[[str], None]:
    """`log` on rank 0, silence elsewhere (print0)."""
    return log if is_main() else (lambda text: None)


def _comm_device() -> torch.device:
    """Where collectives' tensors must be: the current GPU under nccl, the CPU under gloo."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


# ----------------------------------------------------------------- the batch split


def group_slice(num_groups: int) -> slice:
    """This rank's groups of a global batch of `num_groups`: rank r takes [r*n, (r+1)*n)."""
    ranks = world_size()
    if num_groups % ranks:
        raise ConfigError(f"config error: {num_groups} prompt groups per step do not split into whole groups over "
                          f"{ranks} ranks (a group never spans ranks); use a train.prompts_per_step divisible by {ranks}")
    share = num_groups // ranks
    return slice(rank() * share, (rank() + 1) * share)


def check_config(cfg: Config) -> None:
    """What does not run data parallel (module docstring): config.validate_ranks for this process's world."""
    validate_ranks(cfg, world_size_from_env())


# ----------------------------------------------------------------- collectives


def sum_over_ranks(value: float) -> float:
    """value summed over ranks (float64 on the wire); `value` itself in one process."""
    if not _active():
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(tensor)
    return float(tensor)


def batch_totals(tokens: float, sequences: int, chunks: int) -> tuple[float, int, int]:
    """A step's loss normalisers over the global batch from this rank's share: completion tokens and
    sequences summed over ranks, so the rank losses add up to the one-process loss; chunks times the ranks
    (every rank splits alike; bnpo averages every rank's chunks)."""
    return sum_over_ranks(tokens), int(sum_over_ranks(sequences)), chunks * world_size()


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each value averaged over ranks (every rank has the same keys: it ran the same code)."""
    if not _active() or not metrics:
        return metrics
    import torch.distributed as dist

    keys = sorted(metrics)
    tensor = torch.tensor([metrics[key] for key in keys], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(tensor)
    return {key: float(value) / world_size() for key, value in zip(keys, tensor.tolist())}


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` (equal shapes) concatenated along dim 0 in rank order; itself in one process."""
    if not _active():
        return tensor
    import torch.distributed as dist

    local = tensor.to(_comm_device())
    pieces = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(pieces, local.contiguous())
    return torch.cat(pieces).to(tensor.device)


GRADIENT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the extra memory a step holds is one bucket


@torch.no_grad()
def all_reduce_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Sum .grad over ranks, in place: one all-reduce per bucket of ~GRADIENT_BUCKET_BYTES of one
    (device, dtype), as DDP does; one flat buffer of every gradient would be a second full copy of them.

    Every rank ran the same model on its share, so the same parameters have
    gradients; a parameter without one here (a rank that had no micro-batch
    in SFT's last step) takes part as zeros.
    """
    if not _active():
        return
    buckets: dict[tuple, list[torch.nn.Parameter]] = {}
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        buckets.setdefault((parameter.grad.device, parameter.grad.dtype), []).append(parameter)
    for group in buckets.values():
        bucket, size = [], 0
        for parameter in group:  # the same order on every rank: the buckets line up
            bucket.append(parameter.grad)
            size += parameter.grad.numel() * parameter.grad.element_size()
            if size >= GRADIENT_BUCKET_BYTES:
                _all_reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            _all_reduce_bucket(bucket)


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    flat = torch.cat([grad.reshape(-1) for grad in grads]).to(_comm_device())
    dist.all_reduce(flat)
    flat = flat.to(grads[0].device)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module) -> None:
    """Rank 0's weights on every rank (they start equal by seed; this makes it so by construction)."""
    if not _active():
        return
    import torch.distributed as dist

    for tensor in list(model.parameters()) + list(model.buffers()):
        wire = tensor.detach().to(_comm_device())
        dist.broadcast(wire, src=0)
        tensor.copy_(wire.to(tensor.device))


def broadcast_object(value: T) -> T:
    """Rank 0's `value` on every rank (picklable)."""
    if not _active():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_main(work: Callable[[], T]) -> T:
    """Run `work` on rank 0 only and hand its result (or its user error) to every rank."""
    if not _active():
        return work()
    outcome: tuple[str, Any] = ("", None)
    if is_main():
        try:
            outcome = ("ok", work())
        except UserError as error:
            outcome = ("user", error)
        except Exception as error:  # every rank must hear of it, or they wait forever
            outcome = ("failed", f"{type(error).__name__}: {error}")
            broadcast_object(outcome)
            raise
    kind, value = broadcast_object(outcome)
    if kind == "user":
        raise value
    if kind == "failed":
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


def agree_signal(received: int | None) -> int | None:
    """The stop signal any rank received (the highest number), so every rank stops after the same step."""
    if not _active():
        return received
    return _max_over_ranks(received or 0) or None


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any: one decision where each rank's own could differ."""
    if not _active():
        return flag
    return bool(_max_over_ranks(int(flag)))


def _max_over_ranks(value: int) -> int:
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor)


def barrier() -> None:
    if _active():
        import torch.distributed as dist

        dist.barrier()


# ----------------------------------------------------------------- the run directory


class FollowerRunDir(RunDir):
    """Rank > 0's view of rank 0's run directory: it reads what is there and writes nothing."""

    def log_step(self, record):
        pass

    def log_eval(self, step, metrics):
        pass

    def save_samples(self, name, samples):
        return self.path / "samples" / f"{name}.jsonl"

    def write_summary(self, summary):
        return self.path / "summary.json"

    def save_files(self, write, step):
        return self.checkpoint_dir(step)

    def clean_stale(self):
        return []

    def prune(self, keep):
        pass

    def truncate_logs(self, offsets):
        pass

    def plot(self):
        return None


def follow(run_dir: RunDir) -> RunDir:
    """rank 0's RunDir as it is; on other ranks, a FollowerRunDir at the same path."""
    return run_dir if is_main() else FollowerRunDir(run_dir.path)

