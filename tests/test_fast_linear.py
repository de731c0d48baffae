"""speed.fast_linear: oneDNN matmuls give the same outputs, gradients and learner
updates as F.linear (fp32, float rounding only), and the model is restored."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from conftest import learner_step, rollout_of
from hasten.algo import group_advantages
from hasten.kernels import fast_linear
from hasten.kernels.fast_linear import OneDNNLinear, onednn_linears

pytestmark = pytest.mark.skipif(not fast_linear.available(), reason="torch built without oneDNN's fp32 linear")


@pytest.fixture
def route_small_layers(monkeypatch):
    """The tiny model's layers are below MIN_FEATURES; route them anyway."""
    monkeypatch.setattr(fast_linear, "MIN_FEATURES", 1)


@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_linear_matches_f_linear_forward_and_backward(with_bias):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 96, requires_grad=True)  # (batch, tokens, in)
    weight = torch.randn(80, 96, requires_grad=True)  # (out, in)
    bias = torch.randn(80, requires_grad=True) if with_bias else None
    upstream = torch.randn(3, 7, 80)

    def run(function):
        for tensor in (x, weight, bias):
            if tensor is not None:
                tensor.grad = None
        out = function(x, weight, bias)
        (out * upstream).sum().backward()
        grads = [t.grad.clone() for t in (x, weight, bias) if t is not None]
        return out.detach(), grads

    expected, expected_grads = run(F.linear)
    actual, actual_grads = run(OneDNNLinear.apply)
    assert actual.shape == expected.shape == (3, 7, 80)
    assert torch.allclose(actual, expected, atol=1e-4, rtol=1e-5)
    for a, b in zip(actual_grads, expected_grads):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tokens, out_features", [(37, 80), (300, 1000), (300, 96), (5, 4000)])
def test_backward_on_transposed_views_equals_the_copies(monkeypatch, tokens, out_features):
    """The backward hands oneDNN g.T, x.T and W.T as views (reads_transposed); the gradients equal those of
    contiguous copies (the path where the probe says no) and F.linear's."""
    assert fast_linear.reads_transposed()  # the probe holds on the CPUs this runs on (x86 with oneDNN)
    torch.manual_seed(1)
    x = torch.randn(tokens, 96, requires_grad=True)
    weight = torch.randn(out_features, 96, requires_grad=True)
    upstream = torch.randn(tokens, out_features)

    def grads():
        x.grad = weight.grad = None
        (OneDNNLinear.apply(x, weight, None) * upstream).sum().backward()
        return x.grad.clone(), weight.grad.clone()

    views = grads()
    monkeypatch.setattr(fast_linear, "reads_transposed", lambda: False)
    copies = grads()
    x.grad = weight.grad = None
    (F.linear(x, weight) * upstream).sum().backward()
    for view, copy, reference in zip(views, copies, (x.grad, weight.grad)):
        assert torch.allclose(view, copy, atol=1e-5, rtol=1e-6)
        assert torch.allclose(view, reference, atol=1e-3, rtol=1e-5)


def test_frozen_weight_gets_no_gradient():
    x = torch.randn(4, 32, requires_grad=True)
    weight = torch.randn(16, 32)  # frozen, as LoRA's base weights are
    OneDNNLinear.apply(x, weight, None).sum().backward()
    assert weight.grad is None
    assert torch.allclose(x.grad, weight.sum(0).expand(4, 32), atol=1e-5)


def test_context_routes_large_linears_and_restores_them(model, route_small_layers):
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    with onednn_linears(model) as routed:
        assert routed == len(linears) > 0
        assert all("forward" in vars(m) for m in linears)
    assert not any("forward" in vars(m) for m in linears)
    with pytest.raises(RuntimeError, match="boom"):
        with onednn_linears(model):
            raise RuntimeError("boom")
    assert not any("forward" in vars(m) for m in linears)
    with onednn_linears(model, enabled=False) as routed:
        assert routed == 0


def test_autocast_keeps_the_linears_in_the_autocast_dtype(model, route_small_layers):
    # train.precision=bf16: routing would run the decoder's matmuls in fp32 through oneDNN, unseen.
    linear = next(m for m in model.modules() if type(m) is torch.nn.Linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with onednn_linears(model) as routed:
            assert routed == 0
            assert linear(torch.randn(2, linear.in_features)).dtype == torch.bfloat16
    with onednn_linears(model) as routed:  # outside autocast: fp32 through oneDNN as before
        assert routed > 0


def test_small_layers_are_left_alone(model):
    # The tiny model's widths (64, 128) are all under MIN_FEATURES.
    assert fast_linear.MIN_FEATURES > 64
    with onednn_linears(model) as routed:
        assert routed == 0


# logit chunks of 5 tokens: backward recomputes each chunk of the head after the routing context has
# ended, and must recompute it with the kernels its forward used (B8's 256-token cells hit this)
@pytest.mark.parametrize("packed, chunk", [(False, 0), (True, 0), (True, 5)])
def test_learner_loss_and_gradients_are_the_same_with_fast_linear(short_model, tokenizer, route_small_layers,
                                                                  packed, chunk):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    advantages = group_advantages(torch.randn(rollout.num_samples), 4)
    def configure(fast):
        def apply(cfg):
            cfg.train.lr = 1e-2
            cfg.speed.packed_learning = packed
            cfg.speed.logit_chunk_tokens = chunk
            cfg.speed.fast_linear = fast
        return apply

    results = [learner_step(short_model, tokenizer, rollout, advantages, configure(f)) for f in (False, True)]
    (plain_metrics, plain_grads), (fast_metrics, fast_grads) = results
    assert plain_metrics["loss"] == pytest.approx(fast_metrics["loss"], abs=1e-5)
    assert plain_metrics["entropy"] == pytest.approx(fast_metrics["entropy"], rel=1e-5)
    assert len(plain_grads) == len(fast_grads) > 0
    for a, b in zip(plain_grads, fast_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("intel, expected", [(True, False), (False, True)])
def test_auto_routes_through_onednn_except_on_intel(monkeypatch, intel, expected):
    # MKL takes its tuned path on Intel CPUs (faster than oneDNN there), a generic one elsewhere.
    monkeypatch.setattr(fast_linear, "intel_cpu", lambda: intel)
    assert fast_linear.resolve("auto") is expected
    assert fast_linear.resolve(True) is True and fast_linear.resolve(False) is False


def test_fast_linear_setting_accepts_true_false_auto_only():
    from hasten.config import ConfigError, load_config

    assert load_config().speed.fast_linear == "auto"
    assert load_config(overrides=[("speed.fast_linear", False)]).speed.fast_linear is False
    with pytest.raises(ConfigError, match="speed.fast_linear must be true, false or auto"):
        load_config(overrides=[("speed.fast_linear", "fast")])


@pytest.mark.parametrize("wrap", ["lora", "modules_to_save"])
def test_a_peft_wrapped_head_recomputes_its_chunks_on_the_kernels_it_ran(short_model, tokenizer, route_small_layers,
                                                                        wrap):
    """peft's head wrapper holds a routed nn.Linear: a logit chunk recomputed in backward, after the routing
    ended, runs through oneDNN again (it ran F.linear and torch's checkpoint raised), with F.linear's sums."""
    from conftest import peft_head_model
    from hasten.train.packing import packed_logprobs

    model = peft_head_model(short_model, wrap)
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    rows = torch.arange(rollout.num_samples)

    def gradients(fast: bool):
        model.zero_grad(set_to_none=True)
        with onednn_linears(model, fast) as routed:
            logps = packed_logprobs(model, rollout, rows, 1.0, True, 5).logps
        logps.sum().backward()
        return routed, logps.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    _, plain_logps, plain_grads = gradients(False)
    routed, logps, grads = gradients(True)
    assert routed > 0
    assert torch.allclose(logps, plain_logps, atol=1e-5)
    assert len(grads) == len(plain_grads) > 0
    for a, b in zip(grads, plain_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
