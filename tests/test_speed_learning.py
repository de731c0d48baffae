"""Learner-side speed switches on the tiny model: NaN guard, mixed precision (fp16 GradScaler on
CPU), AdamW kernels, gradient checkpointing, reference offload, min_pack_ratio, compile fallback,
and the profiles resolving to their documented settings."""

from __future__ import annotations

import copy
import json
import math
import os
import types

import pytest
import torch
from conftest import rollout_of

from hasten.algo import group_advantages
from hasten.config import Config, ConfigError, SpeedConfig, load_config, set_key
from hasten.models import Policy, Reference
from hasten.config_yaml import MOVED
from hasten.profiles import PROFILES, TRADES, resolve
from hasten.kernels import compile as speed_compile
from hasten.train.packing import pack_ratio
from hasten.kernels.nan_guard import TrainingDiverged
from hasten.train import learner as learner_module
from hasten.train.learner import Learner


def make_learner(model, tokenizer, reference=False, precision="fp32", **speed):
    """A learner on `model` with train.precision and these speed.* keys (through the config's own setter)."""
    cfg = Config()
    cfg.train.lr = 1e-2
    cfg.train.lr_schedule = "constant"
    cfg.train.precision = precision
    for key, value in speed.items():
        set_key(cfg, f"speed.{key}", value)
    if reference:
        cfg.algo.beta = 0.1
    policy = Policy(model, tokenizer, "tiny")
    logs = []
    learner = Learner.from_config(policy, cfg, Reference(policy) if reference else None, log=logs.append)
    return learner, logs


def batch(model, tokenizer, seed=0):
    rollout = rollout_of(model, tokenizer, num_generations=4, max_new_tokens=8, seed=seed)
    return rollout, group_advantages(torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(seed)), 4)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def gradients_of(learner, rollout, advantages):
    grads = []
    learner.optimization.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: grads.extend(p.grad.clone() for p in learner.parameters))
    metrics = learner.step(rollout, advantages)
    return metrics, grads


# ------------------------------------------------------------------ NaN guard


def test_nan_guard_skips_then_lowers_lr_then_recovers(short_model, tokenizer):
    learner, logs = make_learner(short_model, tokenizer, nan_guard_patience=2, nan_guard_lr_factor=0.5)
    rollout, advantages = batch(short_model, tokenizer)
    poisoned = advantages.clone()
    poisoned[0] = float("nan")
    before = weights(short_model)
    for _ in range(2):
        metrics = learner.step(rollout, poisoned)
        assert all(torch.equal(a, b) for a, b in zip(before, weights(short_model)))  # no NaN update applied
    assert metrics["nan_guard/skipped"] == 2
    assert learner.optimization.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)  # patience reached: lr halved
    assert any("skipped an update" in line for line in logs) and any("multiplied by 0.5" in line for line in logs)
    learner.step(rollout, advantages)  # a finite batch trains again
    after = weights(short_model)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))
    assert all(torch.isfinite(p).all() for p in after)


def test_nan_guard_stop_and_disable_mixed_precision(short_model, tokenizer):
    rollout, advantages = batch(short_model, tokenizer)
    poisoned = torch.full_like(advantages, float("inf"))
    learner, _ = make_learner(copy.deepcopy(short_model), tokenizer, nan_guard_patience=1, nan_guard_action="stop")
    with pytest.raises(TrainingDiverged, match="non-finite loss or gradient in 1 updates in a row"):
        learner.step(rollout, poisoned)
    learner, _ = make_learner(copy.deepcopy(short_model), tokenizer, nan_guard_patience=1, precision="bf16",
                              nan_guard_action="disable_mixed_precision")
    learner.step(rollout, poisoned)
    assert learner.optimization.precision.mode == "fp32" and not learner.optimization.precision.mixed


# ------------------------------------------------------------------ precision and kernels


def test_fp16_gradscaler_path_trains_on_cpu(short_model, tokenizer):
    learner, _ = make_learner(short_model, tokenizer, precision="fp16")
    assert learner.optimization.precision.scaler is not None
    rollout, advantages = batch(short_model, tokenizer)
    before = weights(short_model)
    scale = learner.optimization.precision.scaler.get_scale()
    metrics = learner.step(rollout, advantages)
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["grad_norm"] > 0
    after = weights(short_model)
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in after)  # fp32 master weights
    # Either the step was applied, or the scaler found an overflow, skipped it and halved its scale.
    changed = any(not torch.equal(a, b) for a, b in zip(before, after))
    assert changed or learner.optimization.precision.scaler.get_scale() < scale


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_autocast_loss_stays_close_to_fp32(short_model, tokenizer, mode):
    rollout, advantages = batch(short_model, tokenizer)
    losses = {}
    for precision in ("fp32", mode):
        learner, _ = make_learner(copy.deepcopy(short_model), tokenizer, precision=precision)
        losses[precision] = learner.step(rollout, advantages)["loss"]
    assert losses[mode] == pytest.approx(losses["fp32"], abs=0.05)


@pytest.mark.parametrize("kernel", ["foreach", "fused", "auto"])
def test_adamw_kernels_give_the_for_loop_update(short_model, tokenizer, kernel):
    rollout, advantages = batch(short_model, tokenizer)
    updated = []
    for choice in ("for_loop", kernel):
        model = copy.deepcopy(short_model)
        learner, _ = make_learner(model, tokenizer, optimizer=choice)
        learner.step(rollout, advantages)
        updated.append(weights(model))
    for a, b in zip(*updated):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients(short_model, tokenizer):
    rollout, advantages = batch(short_model, tokenizer)
    results = []
    for checkpointing in (False, True):
        learner, _ = make_learner(copy.deepcopy(short_model), tokenizer, gradient_checkpointing=checkpointing)
        results.append(gradients_of(learner, rollout, advantages))
    assert results[1][0]["loss"] == pytest.approx(results[0][0]["loss"], abs=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_reference_offload_gives_the_same_kl_and_stays_on_cpu(short_model, tokenizer):
    rollout, advantages = batch(short_model, tokenizer)
    kls = []
    for offload in (False, True):
        learner, _ = make_learner(copy.deepcopy(short_model), tokenizer, reference=True, offload_reference=offload)
        kls.append(learner.step(rollout, advantages)["kl"])
        assert all(p.device.type == "cpu" for p in learner.reference.frozen.parameters())
    assert kls[0] == pytest.approx(kls[1], abs=1e-7)


def test_pack_ratio_and_min_pack_ratio_fallback(short_model, tokenizer, monkeypatch):
    rollout, advantages = batch(short_model, tokenizer)
    rows = torch.arange(rollout.num_samples)
    lengths, prompts = rollout.completion_lengths, rollout.prompt_mask.sum(1)
    row_lengths = [int(prompts[g]) + int((lengths[4 * g:4 * g + 4] - 1).clamp(min=0).sum()) for g in range(3)]
    assert pack_ratio(rollout, rows) == pytest.approx(sum(row_lengths) / (3 * max(row_lengths)))
    calls = []
    real = learner_module.packed_logprobs
    monkeypatch.setattr(learner_module, "packed_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = []
    for ratio in (0.0, 1.0):  # 1.0: packing never qualifies (rows differ in length) -> the padded pass
        learner, _ = make_learner(copy.deepcopy(short_model), tokenizer, min_pack_ratio=ratio)
        calls.clear()
        results.append(learner.step(rollout, advantages)["loss"])
        assert bool(calls) == (ratio == 0.0)
    assert results[0] == pytest.approx(results[1], abs=1e-5)


# ------------------------------------------------------------------ compile


def test_compile_falls_back_with_a_log_line_when_unavailable(model):
    logs = []
    compiled = speed_compile.compile_model(model, log=logs.append, unavailable=lambda device: "no compiler here")
    assert compiled is False and logs == ["speed.compile: running eager (no compiler here)"]
    assert all(layer._compiled_call_impl is None for layer in speed_compile.decoder_layers(model))


@pytest.mark.parametrize("compiler, reason", [
    ("/usr/bin/g++", None),
    (None, "no C++ compiler found (inductor's CPU backend needs g++ or clang++)"),
])
def test_compile_capability_check_on_cpu(monkeypatch, compiler, reason):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: True)
    monkeypatch.setattr(speed_compile, "shutil", types.SimpleNamespace(which=lambda name: compiler))
    assert speed_compile.compile_unavailable(torch.device("cpu")) == reason


@pytest.mark.parametrize("capability, reason", [
    ((8, 0), None), ((6, 1), "CUDA capability 6.1 < 7.0 (Triton needs Volta or newer)"),
])
def test_compile_capability_check_on_cuda(monkeypatch, capability, reason):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert speed_compile.compile_unavailable(torch.device("cuda")) == reason


def test_compile_capability_check_without_dynamo(monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    assert speed_compile.compile_unavailable(torch.device("cpu")) == "torch.compile does not support this Python/torch build"


def test_training_runs_eager_with_compile_requested_but_no_compiler(tmp_path, monkeypatch):
    """The trainer's real capability check and fallback, on a machine made to have no C++ compiler."""
    import torch._dynamo

    from hasten.train.trainer import train

    if not torch._dynamo.is_dynamo_supported():
        pytest.skip("dynamo unsupported here: the fallback reason differs")
    monkeypatch.setattr(speed_compile, "shutil", types.SimpleNamespace(which=lambda name: None))
    logs = []
    cfg = load_config(overrides=[("model.name", "tiny"), ("task.name", "arithmetic"), ("train.steps", 1),
                                 ("train.prompts_per_step", 2), ("generation.num_generations", 2),
                                 ("generation.max_new_tokens", 4), ("eval.num_examples", 0),
                                 ("output.dir", str(tmp_path)), ("output.progress", "off"),
                                 ("output.plot", False), ("speed.compile", True)])
    summary = train(cfg, log=logs.append)
    assert "speed.compile: running eager (no C++ compiler found (inductor's CPU backend needs g++ or clang++))" in logs
    assert not any("layers compiled" in line for line in logs)
    records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert [r["step"] for r in records] == [1] and math.isfinite(records[0]["loss"])


@pytest.mark.skipif(not os.environ.get("HASTEN_SLOW"), reason="compiles the tiny model (~1 min); HASTEN_SLOW=1")
def test_compiled_layers_give_the_eager_loss(short_model, tokenizer):
    rollout, advantages = batch(short_model, tokenizer)
    losses = []
    for compiled in (False, True):
        model = copy.deepcopy(short_model)
        if compiled:
            assert speed_compile.compile_model(model, log=lambda text: None)
        learner, _ = make_learner(model, tokenizer)
        losses.append(learner.step(rollout, advantages)["loss"])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


# ------------------------------------------------------------------ profiles


def test_baseline_switches_every_acceleration_off():
    cfg = load_config(profile="baseline")
    speed, algo, train = cfg.speed, cfg.algo, cfg.train
    assert (speed.engine, speed.packed_learning, speed.keep_freed_memory) == ("hf", False, False)
    assert speed.reward_workers == 0 and not speed.reward_cache and not speed.prefetch
    assert speed.optimizer == "for_loop" and train.precision == "fp32" and not speed.compile
    assert not algo.dynamic_sampling and algo.curriculum == "off" and algo.gate_reward is None
    assert speed.nan_guard  # a safety net, on in every profile


def test_conservative_is_the_code_defaults_with_fp32_precisions():
    """conservative changes nothing learned: the defaults, except that it samples and learns in fp32 where a
    run's default takes both precisions at auto (bf16 where native: measured to learn as fp32 does,
    docs/precision.md, but not the same numbers)."""
    defaults = load_config()  # a run's defaults
    chosen = resolve("conservative", Config())
    precisions = ("generation.precision", "train.precision")
    assert [chosen[key] for key in precisions] == ["fp32", "fp32"]
    assert (defaults.generation.precision, defaults.train.precision) == ("auto", "auto")
    for key, value in chosen.items():
        section, name = key.split(".")
        if key not in precisions:
            assert getattr(getattr(defaults, section), name) == value, key
    assert TRADES["conservative"] == "" and TRADES["baseline"] == ""


def test_profiles_that_trade_name_the_moved_keys_they_change():
    """A profile sets a key that left `speed` (it changes learning) away from its default only where its TRADES
    line names that key by its new name; the exact profiles set none away from the default. "Away" is from both
    a run's default (auto precisions) and the dataclass's exact value (fp32): baseline's fp32 is the reference."""
    run_defaults, exact = load_config(), Config()
    exact.generation.precision = exact.train.precision = "fp32"  # the exact reference; a run's default is auto
    for name in PROFILES:
        told = TRADES[name] + (TRADES["balanced"] if "balanced's" in TRADES[name] else "")
        for key, value in resolve(name, Config()).items():
            assert key not in MOVED, f"profile {name} uses the old name {key}"
            section, field_name = key.split(".")
            if key in MOVED.values() and value not in (getattr(getattr(run_defaults, section), field_name),
                                                       getattr(getattr(exact, section), field_name)):
                assert key in told, f"profile {name} changes {key} without naming it in TRADES"
    assert "algo.dynamic_sampling" in TRADES["balanced"] and "algo.curriculum" in TRADES["aggressive"]


def test_profiles_apply_between_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("generation:\n  num_generations: 8\n  max_new_tokens: 64\ntrain:\n  steps: 40\n"
                    "speed:\n  engine: lean\n")
    cfg = load_config(path, [("speed.reward_workers", 4)], profile="aggressive")
    assert cfg.generation.num_generations == 4 and cfg.generation.max_new_tokens == 48  # 8 / 2, 64 * 3/4
    assert cfg.algo.curriculum == "success_rate" and cfg.algo.curriculum_warmup_steps == 10
    assert cfg.speed.reward_workers == 4  # the command line wins
    assert load_config(path, profile="baseline").speed.engine == "hf"  # the profile wins over the file
    short = load_config(path, [("train.steps", 8), ("generation.num_generations", 6)], profile="aggressive")
    assert short.algo.curriculum_warmup_steps == 2  # the rule reads the run's own steps (8 // 4)
    assert short.generation.num_generations == 6  # an explicit value is never rewritten by a profile
    assert "trades quality" in TRADES["aggressive"] and TRADES["balanced"]
    assert set(PROFILES) == set(TRADES) == {"baseline", "conservative", "balanced", "aggressive"}
    with pytest.raises(ConfigError, match="unknown profile 'fast'"):
        load_config(profile="fast")


# ------------------------------------------------------------------ hasten compare


def test_compare_runs_every_profile_end_to_end(tmp_path, capsys, monkeypatch):
    from hasten.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["compare", "--model", "tiny", "--task", "arithmetic", "--steps", "1", "--eval-examples", "1",
                 "--profiles", "baseline,balanced", "--train.prompts_per_step=2", "--generation.num_generations=2",
                 "--generation.max_new_tokens=4", "--eval.max_new_tokens=4"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    payload = json.loads(out[-1])  # the JSON line comes last
    rows = {row["label"]: row for row in payload["rows"]}
    assert list(rows) == ["baseline", "balanced"] and payload["reference"] == "baseline"
    # Shape and arithmetic only (this is a smoke run, not a measurement): one round of one step each,
    # the median is that step, and the speed-up is baseline step / this step.
    for row in rows.values():
        assert len(row["step_seconds"]) == 1 and len(row["step_seconds"][0]) == 1
        assert row["median_step"] == row["step_seconds"][0][0] and 0 <= row["accuracy"] <= 1
    assert rows["baseline"]["speedup"] == 1.0
    assert rows["balanced"]["speedup"] == pytest.approx(rows["baseline"]["median_step"] / rows["balanced"]["median_step"])
    assert rows["baseline"]["settings"]["speed"]["engine"] == "hf"
    assert rows["balanced"]["settings"]["algo"]["dynamic_sampling"] is True
    assert "algo.dynamic_sampling" in rows["balanced"]["quality"]
    table = "\n".join(out[:-1])
    assert "speed-up" in table and "held-out acc" in table and "algo.dynamic_sampling" in table


def test_compare_rejects_an_unknown_profile_before_running(capsys):
    from hasten.cli import main

    assert main(["compare", "--profiles", "baseline,turbo"]) == 2
    assert "compare error: unknown profile turbo" in capsys.readouterr().err


def test_ablation_switches_off_each_balanced_feature_alone():
    from hasten.bench.ablate import features

    switched, inert = features(cuda=False)
    balanced, baseline = resolve("balanced", Config()), resolve("baseline", Config())
    assert switched == {key: baseline[key] for key in switched}  # each variant takes baseline's value
    assert {"speed.engine", "speed.packed_learning", "speed.reward_workers", "algo.dynamic_sampling",
            "speed.optimizer", "speed.prefetch", "speed.keep_freed_memory", "speed.reward_cache"} <= set(switched)
    from hasten.kernels.allocator import resolve as resolve_allocator

    # listed, not run: tf32 without CUDA; the allocator where neither tcmalloc nor mimalloc loads (auto = glibc)
    inert_here = ["speed.allocator"] if resolve_allocator("auto") == "glibc" else []
    assert sorted(inert) == sorted(["train.tf32", *inert_here])
    assert all(balanced[key] != value for key, value in switched.items())
