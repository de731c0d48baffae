"""The learning precision bf16_fp32head (a bf16 body, the LM head and its log-softmax in fp32) and `auto`.

- fp32_head: under autocast the head's logits come out fp32, computed from the fp32 hidden state with the
  fp32 weight, the same numbers as the head outside autocast; the head's forward is put back after the
  block, and a head that is not a plain Linear is left alone;
- the gradient bound: on one rollout, the GRPO gradient of bf16_fp32head is closer to a float64 pass than
  plain bf16 autocast's, within the bound docs/precision.md states, and its log-probs are far closer;
- a Learner step in bf16_fp32head runs, with the head fp32 (its weight gradient too) and the body bf16;
- auto resolves by the hardware: bf16_fp32head where bf16 is native (CPU flags, or CUDA without emulation:
  is_bf16_supported(including_emulation=False)), fp32 elsewhere; the plan line says which and why.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import rollout_of, tiny_config
from hasten.kernels import precision as precision_module
from hasten.kernels.precision import Precision, fp32_head, resolve_precision
from hasten.train.packing import backbone_and_head, packed_logprobs


def test_fp32_head_gives_fp32_logits_under_autocast_and_restores_the_head(model):
    head = backbone_and_head(model)[1]
    hidden = torch.randn(5, head.in_features)
    plain = head(hidden)
    with Precision("bf16", torch.device("cpu")).autocast():
        assert head(hidden).dtype == torch.bfloat16  # autocast alone rounds the logits
        with fp32_head(head, True) as patched:
            logits = head(hidden.to(torch.bfloat16).float())
            assert patched and logits.dtype == torch.float32
            assert torch.equal(head(hidden), plain)  # the fp32 product, as outside autocast
        assert "forward" not in vars(head)
    with fp32_head(head, False) as patched:
        assert not patched and "forward" not in vars(head)


@pytest.mark.parametrize("wrap", ["lora", "modules_to_save"])
def test_a_peft_wrapped_head_learns_in_fp32_too(model, tokenizer, wrap):
    """LoRA on lm_head, or lm_head trained whole (modules_to_save): the wrapper runs whole with autocast off, so
    its logits are fp32 as the plan line says (they were bf16: the wrapper was left to autocast). The plain tiny
    model: short_model's head hook adds an fp32 bias, which would make any logits fp32."""
    from conftest import peft_head_model
    from hasten.models import Policy
    from hasten.train.learner import Learner

    wrapped = peft_head_model(model, wrap)
    cfg = tiny_config(precision="bf16_fp32head", fast_linear=False, logit_chunk_tokens=7)  # chunks recomputed
    learner = Learner.from_config(Policy(wrapped, tokenizer, "tiny"), cfg, log=lambda text: None)
    head = backbone_and_head(wrapped)[1]
    assert type(head) is not torch.nn.Linear
    seen = []
    head.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    rollout = rollout_of(model, tokenizer, num_generations=4, max_new_tokens=8)
    metrics = learner.step(rollout, torch.randn(rollout.num_samples))
    assert seen and set(seen) == {torch.float32} and torch.isfinite(torch.tensor(metrics["loss"]))
    assert "forward" not in vars(head)


def _gradient(model, rollout, advantages, precision: str):
    """The DAPO gradient with mu = 1 (-sum A grad log p / tokens) of one packed pass, and its log-probs."""
    model.zero_grad(set_to_none=True)
    rows = torch.arange(rollout.num_samples)
    head = backbone_and_head(model)[1]
    with Precision(precision, torch.device("cpu")).autocast(), fp32_head(head, precision == "bf16_fp32head"):
        logps = packed_logprobs(model, rollout, rows, 1.0, False, 0, grouped=True, shared_prefix=True).logps
    mask = rollout.completion_mask.to(logps.dtype)
    (-(advantages[:, None].to(logps.dtype) * logps * mask).sum() / mask.sum()).backward()
    grad = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return grad, (logps.detach().double() * mask)


def test_fp32_head_gradient_is_closer_to_float64_than_bf16_autocast(short_model, tokenizer):
    # The tiny model's random head gives logits of ~0.2; a trained LM's span tens of nats, where bf16's
    # 8-bit mantissa rounds them by up to 0.06. Scaled so its logits spread over a few nats.
    with torch.no_grad():
        backbone_and_head(short_model)[1].weight.mul_(8.0)
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=16)
    advantages = torch.randn(rollout.num_samples, generator=torch.Generator().manual_seed(0))
    exact, exact_logps = _gradient(copy.deepcopy(short_model).double(), rollout, advantages.double(), "fp32")
    errors, logp_errors = {}, {}
    for precision in ("fp32", "bf16", "bf16_fp32head"):
        grad, logps = _gradient(short_model, rollout, advantages, precision)
        errors[precision] = float((grad - exact).norm() / exact.norm())
        logp_errors[precision] = float((logps - exact_logps).abs().max())
    assert errors["fp32"] < 1e-4
    # the stated bound (docs/precision.md): the fp32 head takes out the logits' rounding, the larger share
    assert errors["bf16_fp32head"] < 0.75 * errors["bf16"]
    assert logp_errors["bf16_fp32head"] < 0.5 * logp_errors["bf16"]


def test_learner_step_in_bf16_fp32head_keeps_the_head_fp32(short_model, tokenizer):
    from hasten.models import Policy
    from hasten.train.learner import Learner

    cfg = tiny_config(precision="bf16_fp32head", fast_linear=False)
    learner = Learner.from_config(Policy(copy.deepcopy(short_model), tokenizer, "tiny"), cfg, log=lambda text: None)
    assert learner.logprob_pass.fp32_head and learner.optimization.precision.mode == "bf16_fp32head"
    head = backbone_and_head(learner.policy.model)[1]
    seen = []
    head.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=8)
    before = head.weight.detach().clone()
    metrics = learner.step(rollout, torch.randn(rollout.num_samples))
    assert seen and set(seen) == {torch.float32}
    assert torch.isfinite(torch.tensor(metrics["loss"])) and not torch.equal(head.weight, before)
    assert head.weight.dtype == torch.float32 and "forward" not in vars(head)


@pytest.mark.parametrize("native, expected", [(True, "bf16_fp32head"), (False, "fp32")])
def test_auto_follows_the_cpu(monkeypatch, native, expected):
    monkeypatch.setattr("hasten.device.cpu_has_native_bf16", lambda: native)
    mode, reason = resolve_precision("auto", torch.device("cpu"))
    assert mode == expected and reason.startswith("auto:")
    assert resolve_precision("bf16", torch.device("cpu")) == ("bf16", "as set")


@pytest.mark.parametrize("native, expected", [(True, "bf16_fp32head"), (False, "fp32")])
def test_auto_on_cuda_asks_for_native_bf16_without_emulation(monkeypatch, native, expected):
    calls = []

    def supported(including_emulation=True):
        calls.append(including_emulation)
        return native if not including_emulation else True  # emulation would always say yes

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    assert resolve_precision("auto", torch.device("cuda"))[0] == expected
    assert calls == [False]


def test_plan_line_says_the_precision_and_why(monkeypatch):
    from hasten.train.learner import LearningPlan
    from hasten.models.tiny import tiny_model, tiny_tokenizer

    monkeypatch.setattr("hasten.device.cpu_has_native_bf16", lambda: True)
    tiny = tiny_model(len(tiny_tokenizer())).config
    small = LearningPlan.resolve(tiny_config(precision="auto"), False, tiny)  # 64 wide: bf16 would not pay
    assert small.precision == "fp32" and "too small for bf16 to pay" in small.describe()
    config = copy.deepcopy(tiny)
    config.hidden_size = 576  # SmolLM2-135M's width
    plan = LearningPlan.resolve(tiny_config(precision="auto"), False, config)
    assert plan.precision == "bf16_fp32head" and plan.logprob_pass.fp32_head
    assert "bf16 with an fp32 head (auto: the CPU has native bf16" in plan.describe()
    plain = LearningPlan.resolve(tiny_config(precision="fp32"), False, config)
    assert "learning pass in fp32," in plain.describe() and not plain.logprob_pass.fp32_head
    assert precision_module.FP32_HEAD_MODES == ("bf16_fp32head",)


def test_a_run_learns_and_samples_at_auto_unless_asked():
    """Both precisions are auto by default: bf16 sampling (importance-weighted) and bf16 learning with an
    fp32 head where the hardware has native bf16, each measured on B5 to learn as fp32 does
    (docs/precision.md); conservative and baseline keep both fp32, an explicit value wins."""
    from hasten.config import Config, load_config

    loaded = load_config(overrides=[("model.name", "tiny")])
    assert (loaded.train.precision, loaded.generation.precision) == ("auto", "auto")
    assert (Config().train.precision, Config().generation.precision) == ("auto", "auto")
    asked = load_config(overrides=[("model.name", "tiny"), ("train.precision", "fp32"), ("generation.precision", "fp32")])
    assert (asked.train.precision, asked.generation.precision) == ("fp32", "fp32")
    balanced = load_config(overrides=[("model.name", "tiny"), ("model.device", "cpu")], profile="balanced")
    assert (balanced.train.precision, balanced.generation.precision) == ("auto", "auto")
    for exact in ("conservative", "baseline"):
        chosen = load_config(overrides=[("model.name", "tiny")], profile=exact)
        assert (chosen.train.precision, chosen.generation.precision) == ("fp32", "fp32")


@pytest.mark.parametrize("native, hidden, settings, expected, why", [
    (True, 576, {}, "bf16", "native bf16"),
    (False, 576, {}, "fp32", "no native bf16"),
    (True, 64, {}, "fp32", "too small"),
    (True, 576, {"speed.engine": "hf"}, "fp32", "speed.engine=hf"),
    (True, 576, {"speed.engine_weights": "shared"}, "fp32", "engine_weights=shared"),
    (True, 576, {"algo.vllm_importance_sampling_correction": False}, "fp32", "uncorrected"),
    (True, 576, {"algo.loss": "vespo"}, "fp32", "vespo"),
    (True, 576, {"algo.async_steps": 1}, "fp32", "async_steps"),
    (True, 576, {"generation.precision": "fp32"}, "fp32", "as set"),
    (True, 576, {"generation.precision": "int8"}, "int8", "as set")])
def test_auto_sampling_is_bf16_only_where_it_was_measured(monkeypatch, model, tokenizer, native, hidden, settings,
                                                          expected, why):
    """bf16 where the lean engine samples its own copy on a CPU with native bf16, corrected by truncated
    importance weights, synchronously; fp32 (with the reason) anywhere else."""
    from hasten.config import set_key
    from hasten.models import Policy
    from hasten.rollout.factory import auto_generation_precision

    monkeypatch.setattr("hasten.device.cpu_has_native_bf16", lambda: native)
    cfg = tiny_config()
    assert cfg.generation.precision == "auto"
    for key, value in settings.items():
        set_key(cfg, key, value)
    model.config.hidden_size = hidden  # what the rule reads; the tiny model's shapes are not touched
    choice, reason = auto_generation_precision(cfg, Policy(model, tokenizer, "tiny"))
    assert choice == expected and why in reason


def test_the_factory_says_what_auto_sampling_chose_and_the_plan_line_shows_it(monkeypatch, model, tokenizer):
    from hasten.models import Policy
    from hasten.rollout.factory import make_engine
    from hasten.train.plan import Plan

    monkeypatch.setattr("hasten.device.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("hasten.kernels.precision.AUTO_BF16_MIN_HIDDEN", 1)  # the tiny model counts as wide
    cfg, lines = tiny_config(), []
    policy = Policy(model, tokenizer, "tiny")
    engine = make_engine(cfg, policy, lines.append)
    assert cfg.generation.precision == "bf16" and engine.sample_precision == "bf16"
    assert "generation.precision=auto: bf16 (the CPU has native bf16; importance-weighted)" in lines
    described = Plan.resolve(cfg, policy, engine, False).describe()
    assert "lean engine (bf16 sampling" in described and "importance weights capped at 2 (bf16_sampler)" in described


def test_auto_sampling_stays_fp32_where_a_bf16_copy_would_bind_memory(monkeypatch):
    """speed.engine_weights=auto samples from the training weights where a copy would take over 1/8 of the
    machine's memory; auto sampling then stays fp32 (a bf16 copy there would cost the memory shared saves)."""
    from hasten.rollout.factory import sampling_precision

    monkeypatch.setattr("hasten.device.cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr("hasten.device.machine_bytes", lambda device="cpu": 16 * 2**30)
    cfg, cpu = tiny_config(), torch.device("cpu")
    assert sampling_precision(cfg, cpu, 896, 494_000_000)[0] == "bf16"  # 0.92 GiB <= 2 GiB
    choice, why = sampling_precision(cfg, cpu, 1536, 1_540_000_000)  # 2.87 GiB > 2 GiB
    assert choice == "fp32" and "memory binds: a bf16 copy would take 2.87 GiB, > 1/8 of 16.0 GiB" in why
    cfg.speed.engine_weights = "copy"  # asked for a copy: memory is the user's call
    assert sampling_precision(cfg, cpu, 1536, 1_540_000_000)[0] == "bf16"



@pytest.mark.parametrize("native", [True, False])
def test_auto_with_bf16_weights_learns_in_bf16(monkeypatch, short_model, tokenizer, native):
    """model.dtype=bfloat16 (or a bf16 model passed in): an fp32 head has no fp32 weight to multiply, so auto
    is bf16 wherever it runs, and a learning step goes through (it raised a dtype error under the fp32 head)."""
    from hasten.models import Policy
    from hasten.train.learner import Learner, LearningPlan

    monkeypatch.setattr("hasten.device.cpu_has_native_bf16", lambda: native)
    cfg = tiny_config(fast_linear=False)
    assert cfg.train.precision == "auto"
    rollout = rollout_of(short_model, tokenizer, num_generations=4, max_new_tokens=8)
    learner = Learner.from_config(Policy(copy.deepcopy(short_model).to(torch.bfloat16), tokenizer, "tiny"), cfg,
                                  log=lambda text: None)
    assert learner.optimization.precision.mode == "bf16"
    plan = LearningPlan.resolve(cfg, False, short_model.config, "cpu", torch.bfloat16)
    assert (plan.precision, plan.precision_reason) == ("bf16", "auto: the model's weights are bfloat16")
    metrics = learner.step(rollout, torch.randn(rollout.num_samples))
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_an_fp32_head_over_weights_that_are_not_fp32_is_a_config_error():
    from hasten.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.precision=bf16_fp32head keeps the LM head in fp32, but the "
                                          r"model's weights are bfloat16"):
        resolve_precision("bf16_fp32head", torch.device("cpu"), 576, torch.bfloat16)
    assert resolve_precision("auto", torch.device("cpu"), 576, torch.float16)[0] == "fp32"  # no autocast
    assert resolve_precision("bf16", torch.device("cpu"), 576, torch.bfloat16) == ("bf16", "as set")


def test_a_resume_where_auto_resolves_otherwise_is_an_error(monkeypatch, short_model, tokenizer):
    """A checkpoint records the precision its run resolved; resumed where `auto` resolves to another (a CPU
    without native bf16), the run stops with one line instead of learning on in another precision. The NaN
    guard's own fallback to fp32 (mode fp32, resolved as before) still resumes as fp32."""
    from hasten.config import ConfigError
    from hasten.models import Policy
    from hasten.train.learner import Learner

    monkeypatch.setattr("hasten.kernels.precision.AUTO_BF16_MIN_HIDDEN", 1)  # the tiny model counts as wide

    def learner(native: bool):
        monkeypatch.setattr("hasten.device.cpu_has_native_bf16", lambda: native)
        return Learner.from_config(Policy(copy.deepcopy(short_model), tokenizer, "tiny"),
                                   tiny_config(fast_linear=False), log=lambda text: None)

    trained = learner(True)
    state = trained.optimization.state_dict()
    assert state["precision"]["resolved"] == "bf16_fp32head"
    with pytest.raises(ConfigError, match=r"resume error: this run learned in train.precision=bf16_fp32head, "
                                          r"which resolves to fp32 here"):
        learner(False).optimization.load_state_dict(state)
    same = learner(True)
    same.optimization.load_state_dict(state)
    assert same.optimization.precision.mode == "bf16_fp32head"
    trained.optimization.precision.disable()  # the NaN guard switched autocast off before the save
    guarded = learner(True)
    guarded.optimization.load_state_dict(trained.optimization.state_dict())
    assert guarded.optimization.precision.mode == "fp32"


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_sampling_precision_the_user_s_generate_cannot_honour_is_a_config_error(tokenizer, precision):
    """A model whose generate is the user's samples through it, in the model's own precision: an explicit bf16
    or int8 was kept and the learner weighted and labelled an fp32 sampler as that one."""
    from hasten.config import ConfigError
    from hasten.models import Policy
    from hasten.models.tiny import tiny_model
    from hasten.rollout.factory import make_engine

    model = tiny_model(len(tokenizer))
    real = model.generate
    model.generate = lambda *args, **kwargs: real(*args, **kwargs)  # a user's generate, as TRL's tests set one
    cfg = tiny_config()
    cfg.generation.precision = precision
    with pytest.raises(ConfigError, match=rf"generation.precision={precision}: the model's generate is the user's"):
        make_engine(cfg, Policy(model, tokenizer, "tiny"), lambda text: None)
    cfg.generation.precision = "auto"
    make_engine(cfg, Policy(model, tokenizer, "tiny"), lambda text: None)
    assert cfg.generation.precision == "fp32"
