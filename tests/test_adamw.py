"""kernels/adamw.py: FusedAdamW is torch's fused AdamW update, bit for bit; Schedule is LambdaLR's lr."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from hasten.kernels import adamw
from hasten.kernels.adamw import FusedAdamW, available, make_adamw
from hasten.train.optimization import Schedule, lr_factor


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((7, 5), (5,), (3, 2, 4))]


def test_the_fused_kernel_is_available_here():
    assert available("cpu")  # torch 2.13 CPU has it; the probe compares one step with AdamW's formula


def test_fused_adamw_is_bit_identical_to_torch_over_several_steps():
    ours, theirs = parameters(), parameters()
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    optimizer = FusedAdamW(ours, **settings)
    reference = torch.optim.AdamW(theirs, fused=True, **settings)
    factor = lambda step: lr_factor(step, 2, 6, "cosine", 0.1)  # noqa: E731 - warmup, then a falling lr
    schedules = Schedule(optimizer, factor), torch.optim.lr_scheduler.LambdaLR(reference, factor)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        for index, (a, b) in enumerate(zip(ours, theirs)):
            if step == 3 and index == 1:  # a parameter without a gradient this step is left alone
                a.grad = b.grad = None
                continue
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        optimizer.step()
        reference.step()
        for schedule in schedules:
            schedule.step()
        optimizer.zero_grad()
        reference.zero_grad()
        assert optimizer.param_groups[0]["lr"] == reference.param_groups[0]["lr"]
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    for a, b in zip(ours, theirs):
        assert torch.equal(optimizer.state[a]["exp_avg_sq"], reference.state[b]["exp_avg_sq"])
        assert torch.equal(optimizer.state[a]["step"], reference.state[b]["step"])


@pytest.mark.parametrize("first_grad_at", [0, 2])
def test_reserved_state_gives_the_same_updates_as_lazy_state(first_grad_at):
    # reserve_state allocates zeros up front (a stable heap); the updates and the
    # saved state must be what the lazy path gives, also for a parameter whose
    # first gradient comes late (its reserved step counter stays 0 until then).
    lazy, reserved = parameters(), parameters()
    settings = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
    plain, early = FusedAdamW(lazy, **settings), FusedAdamW(reserved, **settings)
    early.reserve_state()
    assert all(float(early.state[p]["step"]) == 0 and not early.state[p]["exp_avg"].any() for p in reserved)
    generator = torch.Generator().manual_seed(2)
    for step in range(4):
        for index, (a, b) in enumerate(zip(lazy, reserved)):
            if index == 0 and step < first_grad_at:
                a.grad = b.grad = None
                continue
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        plain.step()
        early.step()
        for a, b in zip(lazy, reserved):
            assert torch.equal(a, b)
    for a, b in zip(lazy, reserved):
        assert all(torch.equal(plain.state[a][key], early.state[b][key]) for key in ("step", "exp_avg", "exp_avg_sq"))


def test_fused_adamw_matches_the_for_loop_update():
    ours, theirs = parameters(), parameters()
    optimizer, reference = FusedAdamW(ours, lr=1e-3), torch.optim.AdamW(theirs, lr=1e-3, foreach=False)
    for a, b in zip(ours, theirs):
        a.grad = torch.full_like(a, 0.3)
        b.grad = a.grad.clone()
    optimizer.step()
    reference.step()
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-6)


def test_schedule_scales_its_peak_and_zero_grad_clears():
    params = parameters()
    optimizer = FusedAdamW(params, lr=0.5)
    schedule = Schedule(optimizer, lambda step: 1.0 / (step + 1))
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
    schedule.scale_peak(0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.125)
    params[0].grad = torch.ones_like(params[0])
    seen = []
    handle = optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    optimizer.step()
    handle.remove()
    optimizer.step()
    assert seen == [pytest.approx(0.125)]  # called before the step, once, then removed
    optimizer.zero_grad(set_to_none=False)
    assert params[0].grad.eq(0).all()
    optimizer.zero_grad()
    assert params[0].grad is None


@pytest.mark.parametrize("choice, precision, expected", [
    ("auto", "fp32", FusedAdamW), ("fused", "bf16", FusedAdamW),
    ("fused", "fp16", torch.optim.AdamW),  # the GradScaler steps torch.optim optimizers only
    ("foreach", "fp32", torch.optim.AdamW), ("for_loop", "fp32", torch.optim.AdamW),
])
def test_speed_optimizer_picks_the_implementation(choice, precision, expected):
    optimizer = make_adamw(copy.deepcopy(parameters()), choice, 1e-3, (0.9, 0.999), 0.0, precision)
    assert type(optimizer) is expected
    assert optimizer.param_groups[0]["lr"] == 1e-3


@pytest.fixture(params=["one slice", "many slices"])
def slices(request, monkeypatch):
    """bf16 moments update a parameter ROUNDING_CHUNK elements at a time: run each test with every tensor in
    one slice, and with slices of 8 elements (several per parameter, the last one short)."""
    if request.param == "many slices":
        monkeypatch.setattr(adamw, "ROUNDING_CHUNK", 8)
    return request.param


def test_bf16_moments_follow_fp32_moments_and_halve_the_state(slices):
    # train.optimizer_moments=bf16: the same fused update on fp32 copies of bf16 moments. Over many steps
    # the parameters stay within bf16's rounding of the fp32-moment run, and exp_avg_sq keeps growing
    # under tiny updates (stochastic rounding; round-to-nearest would freeze it at beta2 = 0.999).
    full, half = parameters(), parameters()
    settings = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    reference, optimizer = FusedAdamW(full, **settings), FusedAdamW(half, **settings, moments="bf16", seed=3)
    generator = torch.Generator().manual_seed(5)
    for _ in range(200):
        for a, b in zip(full, half):
            a.grad = torch.randn(a.shape, generator=generator)
            b.grad = a.grad.clone()
        reference.step()
        optimizer.step()
    for a, b in zip(full, half):
        state = optimizer.state[b]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16 and b.dtype == torch.float32
        assert torch.allclose(state["exp_avg_sq"].float(), reference.state[a]["exp_avg_sq"], rtol=0.05)
        assert (a - b).abs().max() < 2e-3  # 200 steps of lr 1e-3: each parameter moved ~0.2
        assert (a - b).abs().max() > 0  # a different (rounded) path, not the fp32 one renamed


def test_stochastic_rounding_is_unbiased_and_resumes_exactly(slices):
    optimizer = FusedAdamW(parameters(), lr=1e-3, moments="bf16", seed=0)
    value = torch.full((20000,), 1.0 + 2**-10)  # between two bf16 neighbours, a quarter of the way up
    rounded = optimizer._round(value).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-4)  # nearest would give 1.0 exactly
    first, second = parameters(), parameters()
    straight, resumed = (FusedAdamW(first, lr=1e-2, moments="bf16", seed=1),
                         FusedAdamW(second, lr=1e-2, moments="bf16", seed=1))
    generator = torch.Generator().manual_seed(2)
    grads = [[torch.randn(p.shape, generator=generator) for p in first] for _ in range(4)]
    for step, step_grads in enumerate(grads):
        if step == 2:  # checkpoint and restore the second one halfway
            saved = copy.deepcopy(resumed.state_dict())
            resumed = FusedAdamW(second, lr=1e-2, moments="bf16", seed=99)
            resumed.load_state_dict(saved)
        for a, b, grad in zip(first, second, step_grads):
            a.grad, b.grad = grad.clone(), grad.clone()
        straight.step()
        resumed.step()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="optimizer_moments"):
        FusedAdamW(parameters(), lr=1e-2).load_state_dict(saved)  # bf16 state into an fp32-moment run


def test_rounding_noise_is_uniform_over_the_bits_bf16_drops():
    # The pool holds every 16-bit value equally often, so a window at a random offset is uniform noise; the
    # noise of a step comes from windows at offsets the optimizer's generator draws.
    pool = adamw._noise_pool(torch.device("cpu"))
    assert pool.dtype == torch.int32 and pool.numel() == adamw.NOISE_POOL
    counts = torch.bincount(pool.long(), minlength=1 << 16)
    assert counts.numel() == 1 << 16 and bool((counts == adamw.NOISE_POOL >> 16).all())
    window = pool[12345:12345 + adamw.ROUNDING_CHUNK].double()
    assert window.mean().item() == pytest.approx((1 << 16) / 2 - 0.5, rel=0.01)
    first, second = FusedAdamW(parameters(), lr=1e-3, moments="bf16", seed=4), None
    offsets = first._offsets(64)
    second = FusedAdamW(parameters(), lr=1e-3, moments="bf16", seed=4)
    assert offsets == second._offsets(64) and len(set(offsets)) > 60  # seeded, and not one window
    assert max(offsets) <= adamw.NOISE_POOL - adamw.ROUNDING_CHUNK


def test_bf16_moments_update_a_non_contiguous_parameter_in_place():
    # A transposed parameter (non-contiguous) gets the update its contiguous twin gets, in its own storage.
    generator = torch.Generator().manual_seed(6)
    base = torch.randn(6, 4, generator=generator)
    strided, plain = torch.nn.Parameter(base.clone().t()), torch.nn.Parameter(base.clone().t().contiguous())
    assert not strided.is_contiguous()
    optimizers = [FusedAdamW([p], lr=1e-2, moments="bf16", seed=2) for p in (strided, plain)]
    for _ in range(3):
        grad = torch.randn(4, 6, generator=generator)
        strided.grad, plain.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert torch.equal(strided, plain) and not torch.equal(plain, base.t())


@pytest.mark.parametrize("extra", [{"speed.optimizer": "for_loop"}, {"train.precision": "fp16"},
                                   {"train.distributed": "fsdp"}])
def test_bf16_moments_refuse_what_cannot_keep_them(extra):
    from hasten.config import load_config
    from hasten.errors import ConfigError

    with pytest.raises(ConfigError, match="train.optimizer_moments=bf16"):
        load_config(overrides=[("train.optimizer_moments", "bf16"), *extra.items()])


def test_a_run_with_bf16_moments_trains_and_keeps_them_bf16(letters_task):
    from conftest import letters_config, run_metrics
    from hasten.train.trainer import train

    summary = train(letters_config(letters_task, "moments", **{"train.steps": 2, "train.optimizer_moments": "bf16"}),
                    log=lambda _: None)
    records = run_metrics(summary)
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    state = torch.load(next(Path(summary["run_dir"]).glob("checkpoint*/trainer_state.pt")), weights_only=False)
    dtypes = {tensor.dtype for tensor in _tensors(state)}  # the AdamW moments sit inside the job's state
    assert torch.bfloat16 in dtypes  # the tiny model's weights are fp32: only the moments are bf16


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
