"""AdamW kernels (speed.optimizer): torch's fused kernel called without torch.optim, and the choice.

Why not torch.optim.AdamW(fused=True)? It runs the very same kernel, but
torch.optim wraps its methods in `torch._disable_dynamo`, which imports
torch._dynamo on the first call (sympy, torch.fx, torch.distributed.tensor
...), a large share of the time from `hasten train` to its first step. Nothing
in a plain hasten step needs dynamo otherwise, so the import is pure startup cost.

`FusedAdamW` keeps torch's state layout (per parameter: `step` as a float32
scalar tensor, `exp_avg`, `exp_avg_sq`) and does what torch's `_fused_adam`
does for AdamW without amsgrad: add 1 to the steps, then one
`torch._fused_adamw_` call per (device, dtype). tests/test_adamw.py checks it
is bit-identical to torch.optim.AdamW(fused=True) over several steps, with a
changing lr and weight decay. `_fused_adamw_` is internal to torch, so
`available()` probes it before anything relies on it; without it (or for
the fp16 GradScaler, which needs a torch.optim optimizer) hasten uses
torch.optim.AdamW.

train.optimizer_moments=bf16 keeps `exp_avg` and `exp_avg_sq` in bf16 (half of AdamW's state, a quarter
of what a full fine-tune holds per parameter besides activations). Each parameter's step runs the same
fused kernel on fp32 copies of its two moments, made one slice of ROUNDING_CHUNK elements at a time (a few
MB of extra memory, and the slice stays in cache between the update and the rounding), and stores them back
with stochastic rounding: round-to-nearest would freeze exp_avg_sq, whose per-step change (1 - beta2 = 0.1%
of itself) is below bf16's resolution (0.4%). The rounding noise is a window of a fixed pool holding each
16-bit value equally often (`_noise_pool`), at an offset drawn per slice from the optimizer's own generator,
saved with its state, so a resumed run rounds as the uninterrupted one would. (Drawing every element's noise
from the generator, as an earlier version did, runs on one thread, two numbers per parameter a step: the
update then took most of a second on SmolLM2; docs/speedups.md has the figures.) It changes numerics (the
moments are approximations); its effect on learning on B5 is in docs/speedups.md.

`make_adamw` picks the kernel for speed.optimizer: for_loop and foreach are
torch.optim.AdamW's; fused is FusedAdamW here (torch.optim's under the fp16
GradScaler, which steps torch.optim optimizers only). Every choice gives the
same update up to rounding; the fused kernel measured several times faster
per step on CPU (docs/results/speedups-notes.md).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch


@functools.cache
def available(device_type: str = "cpu") -> bool:
    """True when torch has the fused AdamW kernel and it agrees with AdamW's formula on a small case."""
    if not hasattr(torch, "_fused_adamw_") or device_type not in ("cpu", "cuda"):
        return False
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    lr, beta1, beta2, eps, decay = 0.1, 0.9, 0.99, 1e-8, 0.01
    param = torch.linspace(-1, 1, 8, device=device_type)
    grad = torch.linspace(0.5, -0.3, 8, device=device_type)
    expected = param * (1 - lr * decay)  # one AdamW step by hand: m = (1-b1) g, v = (1-b2) g^2, bias-corrected
    m_hat, v_hat = grad, grad * grad
    expected = expected - lr * m_hat / (v_hat.sqrt() + eps)
    optimizer = FusedAdamW([torch.nn.Parameter(param.clone())], lr=lr, betas=(beta1, beta2), eps=eps,
                           weight_decay=decay)
    optimizer.param_groups[0]["params"][0].grad = grad
    try:
        optimizer.step()
    except (RuntimeError, TypeError):
        return False
    return torch.allclose(optimizer.param_groups[0]["params"][0].detach(), expected, atol=1e-5)


ROUNDING_CHUNK = 1 << 18  # elements per slice of a bf16-moment update: 1 MB of fp32, cache-sized
NOISE_POOL = 1 << 22  # the rounding noise pool's length: each 16-bit value 64 times


@functools.cache
def _noise_pool(device: torch.device) -> torch.Tensor:
    """NOISE_POOL int32 values in [0, 65536), each exactly NOISE_POOL / 65536 times, in a fixed shuffled order.

    A window of it at a random offset gives each element noise that is uniform over the 16 bits bf16 drops
    (a window's values are the pool's, nearly balanced); the randomness of a step is the offsets, drawn
    from the optimizer's generator. Fixed (seed 0) so that a resumed optimizer needs only its generator."""
    order = torch.randperm(NOISE_POOL, generator=torch.Generator().manual_seed(0))
    return order.bitwise_and_(0xFFFF).to(device=device, dtype=torch.int32)  # one copy per device


def _stochastic_round(values: torch.Tensor, offset: int) -> torch.Tensor:
    """Round fp32 `values` (contiguous, at most ROUNDING_CHUNK) in place to bf16-representable values,
    stochastically: add noise below bf16's last bit to the bit pattern, then clear the 16 low bits, so the
    stored value is unbiased (E[rounded] = value) and small updates accumulate in expectation. A later
    .to(bfloat16) of the result is exact. Returns values."""
    noise = _noise_pool(values.device)[offset:offset + values.numel()]
    values.view(torch.int32).add_(noise).bitwise_and_(-65536)  # 0xFFFF0000: bf16's bits
    return values


class FusedAdamW:
    """torch.optim.AdamW(fused=True)'s update and state, with the methods hasten calls (one param group)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, moments: str = "fp32", seed: int = 0):
        self.param_groups = [{"params": list(params), "lr": lr, "betas": tuple(betas), "eps": eps,
                              "weight_decay": weight_decay}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._pre_hooks: dict[int, Callable] = {}
        if moments not in ("fp32", "bf16"):
            raise ValueError(f"moments must be fp32 or bf16, got {moments!r}")
        self.moments = moments  # train.optimizer_moments: the dtype exp_avg and exp_avg_sq are kept in
        self.rounding = torch.Generator().manual_seed(seed)  # bf16's stochastic rounding (CPU draws)

    def register_step_pre_hook(self, hook: Callable) -> _Handle:
        """hook(optimizer, args, kwargs) before every step, as torch.optim calls it; returns a handle."""
        key = max(self._pre_hooks, default=-1) + 1
        self._pre_hooks[key] = hook
        return _Handle(self._pre_hooks, key)

    @torch.no_grad()
    def reserve_state(self) -> None:
        """Allocate every trainable parameter's state now (zeros, step 0) instead of at its first update.

        Allocated lazily, the state (2x the parameters) lands in the addresses the first
        backward just freed, and the second step's activations must grow the heap: seconds
        of fresh page faults on the second learning pass. The update is the same: a zero
        state with step 0 is what the lazy path creates.
        """
        for param in self.param_groups[0]["params"]:
            if param.requires_grad and param not in self.state:
                self.state[param] = self._zero_state(param)

    def _zero_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        dtype = torch.bfloat16 if self.moments == "bf16" else param.dtype
        return {
            "step": torch.zeros((), dtype=torch.float32, device=param.device),
            "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        }

    @torch.no_grad()
    def step(self) -> None:
        for hook in list(self._pre_hooks.values()):
            hook(self, (), {})
        for group in self.param_groups:
            batches: dict[tuple, list[list[torch.Tensor]]] = {}  # (device, dtype) -> params, grads, m, v, steps
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state.get(param)
                if state is None:  # lazily, as torch does: zeros, and a float32 step counter
                    state = self.state[param] = self._zero_state(param)
                lists = batches.setdefault((param.device, param.dtype), [[], [], [], [], []])
                for bucket, tensor in zip(lists, (param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                                                  state["step"])):
                    bucket.append(tensor)
            beta1, beta2 = group["betas"]
            settings = {"amsgrad": False, "lr": group["lr"], "beta1": beta1, "beta2": beta2,
                        "weight_decay": group["weight_decay"], "eps": group["eps"], "maximize": False,
                        "grad_scale": None, "found_inf": None}
            for params, grads, exp_avgs, exp_avg_sqs, steps in batches.values():
                torch._foreach_add_(steps, 1)
                if self.moments == "fp32" or params[0].dtype == torch.bfloat16:
                    torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, **settings)
                    continue
                for param, grad, exp_avg, exp_avg_sq, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
                    self._bf16_moments_step(param, grad, exp_avg, exp_avg_sq, step, settings)

    def _bf16_moments_step(self, param, grad, exp_avg, exp_avg_sq, step, settings) -> None:
        """One parameter's fused update on fp32 copies of its bf16 moments, a ROUNDING_CHUNK slice at a time
        (the update is elementwise, so slicing changes no number), each moment rounded back stochastically."""
        given = (param, grad, exp_avg, exp_avg_sq)
        used = [tensor if tensor.is_contiguous() else tensor.contiguous() for tensor in given]  # same index order
        flat = [tensor.view(-1) for tensor in used]
        size = flat[0].numel()
        starts = range(0, size, ROUNDING_CHUNK)
        offsets = self._offsets(2 * len(starts))
        for index, start in enumerate(starts):
            part, part_grad, avg, avg_sq = (tensor[start:start + ROUNDING_CHUNK] for tensor in flat)
            wide_avg, wide_sq = avg.float(), avg_sq.float()
            torch._fused_adamw_([part], [part_grad], [wide_avg], [wide_sq], [], [step], **settings)
            avg.copy_(_stochastic_round(wide_avg, offsets[2 * index]))
            avg_sq.copy_(_stochastic_round(wide_sq, offsets[2 * index + 1]))
        for original, copy in zip(given, used):  # a non-contiguous tensor was updated in its contiguous copy
            if copy is not original and original is not grad:
                original.copy_(copy)

    def _offsets(self, count: int) -> list[int]:
        """`count` window starts into the noise pool, from this optimizer's seeded generator."""
        return torch.randint(0, NOISE_POOL - ROUNDING_CHUNK + 1, (count,), generator=self.rounding).tolist()

    def _round(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 -> bf16 with stochastic rounding (a copy; values is left alone), a slice at a time."""
        flat = values.detach().float().reshape(-1).clone()
        starts = range(0, flat.numel(), ROUNDING_CHUNK)
        for start, offset in zip(starts, self._offsets(len(starts))):
            _stochastic_round(flat[start:start + ROUNDING_CHUNK], offset)
        return flat.view(values.shape).to(torch.bfloat16)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's layout: per-parameter state by position, and the group's hyperparameters."""
        params = self.param_groups[0]["params"]
        state = {index: {key: value.clone() for key, value in self.state[param].items()}
                 for index, param in enumerate(params) if param in self.state}
        group = {key: value for key, value in self.param_groups[0].items() if key != "params"}
        saved = {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}
        if self.moments == "bf16":
            saved["rounding"] = self.rounding.get_state()  # the same rounding draws after a resume
        return saved

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        params = self.param_groups[0]["params"]
        if len(saved["param_groups"][0]["params"]) != len(params):
            raise ValueError(f"optimizer state holds {len(saved['param_groups'][0]['params'])} parameters, "
                             f"this model trains {len(params)}")
        for key, value in saved["param_groups"][0].items():
            if key != "params":
                self.param_groups[0][key] = tuple(value) if key == "betas" else value
        self.state = {params[int(index)]: {key: value.to(params[int(index)].device) for key, value in entry.items()}
                      for index, entry in saved["state"].items()}
        for param, entry in self.state.items():
            stored, wanted = entry["exp_avg"].dtype, self._zero_state(param)["exp_avg"].dtype
            if stored != wanted:
                raise ValueError(f"optimizer state holds {stored} moments where this run keeps {wanted} "
                                 f"(train.optimizer_moments must match the checkpoint's)")
        if "rounding" in saved:
            self.rounding.set_state(saved["rounding"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()


class _Handle:
    def __init__(self, hooks: dict, key: int):
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


def adamw_kernel(choice: str, device: torch.device) -> dict[str, bool]:
    """AdamW keyword arguments for speed.optimizer on `device`."""
    if choice == "auto":
        # Fused where torch has the kernel (CUDA and CPU): several times faster per step than for-loop.
        # On the CPU it leaves the parameters' _version alone, which is why the trainer tells the
        # lean engine about every update (LeanEngine.weights_changed) instead of relying on it.
        choice = "fused" if device.type in ("cuda", "cpu") else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True},
            "for_loop": {"foreach": False, "fused": False}}[choice]


def make_adamw(parameters: list[torch.nn.Parameter], choice: str, lr: float, betas: tuple[float, float],
               weight_decay: float, precision: str = "fp32", moments: str = "fp32"):
    """AdamW with the kernel speed.optimizer picks. The fused kernel is called directly
    (FusedAdamW above: the same update, without torch.optim's ~1 s import of torch._dynamo),
    except under the fp16 GradScaler, which steps torch.optim optimizers only. bf16 moments
    (train.optimizer_moments) exist in FusedAdamW only: config.validate refuses the rest."""
    device = parameters[0].device if parameters else torch.device("cpu")
    kernel = adamw_kernel(choice, device)
    common = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay}
    if kernel.get("fused") and precision != "fp16":
        if available(device.type):
            return FusedAdamW(parameters, **common, moments=moments)
    if moments != "fp32":
        raise ValueError(f"train.optimizer_moments={moments} needs the fused AdamW kernel, which "
                         f"{'the fp16 GradScaler cannot step' if precision == 'fp16' else 'is not used here'}")
    return torch.optim.AdamW(parameters, **common, **kernel)
