"""The entropy bonus (TRL's entropy_coef, adaptive entropy control), the bias-corrected KL (TRL's
use_bias_correction_kl) and the luspo and vespo losses: each equal to TRL 1.16's own
GRPOTrainer._compute_loss on crafted tensors, in value and gradient, and the bonus wired through
hasten's learning pass with a gradient on the entropy."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hasten.algo import LOSSES, LossInputs, LossSettings
from hasten.algo.entropy import EntropyControl, EntropySettings
from hasten.algo.losses import entropy_term, high_entropy_mask

MAX_LENGTH = 6


def trl_trainer(loss_type: str, *, beta=0.0, bias_correction=False, entropy_coef=0.0, adaptive=False,
                quantile=1.0, level="token", accumulation=1, target=0.2, coef_delta=0.005, coef_max=1.0,
                coef_min=0.0):
    """A stand-in for TRL 1.16's GRPOTrainer with what _compute_loss reads (one process)."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    identity = SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction="sum": x, num_processes=1,
                               sync_gradients=True, gather_for_metrics=lambda x: x,
                               pad_across_processes=lambda x, dim, pad_index: x)
    trainer = SimpleNamespace(
        aux_loss_enabled=False, top_entropy_quantile=quantile, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        use_vllm=False, vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation, accelerator=identity,
        entropy_coef=entropy_coef, use_adaptive_entropy=adaptive,
        _entropy_bonus_enabled=entropy_coef != 0.0 or adaptive, _last_world_entropy=float("inf"),
        _entropy_window_stats=None, max_completion_length=MAX_LENGTH,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=bias_correction, steps_per_generation=accumulation,
                             entropy_target=target, entropy_coef_delta=coef_delta, entropy_coef_max=coef_max,
                             entropy_coef_min=coef_min, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                             vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0))
    trainer.get_gamma_weights = trl.GRPOTrainer.get_gamma_weights  # a staticmethod
    trainer.get_high_entropy_mask = lambda entropies, mask, threshold: trl.GRPOTrainer.get_high_entropy_mask(
        trainer, entropies, mask, threshold)
    return trainer


def trl_loss(trainer, logps, entropies, old_logps, advantages, mask, ref_logps=None, total_tokens=None):
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, entropies, None)
    count = mask.shape[0]
    inputs = {"prompt_ids": torch.zeros(count, 1, dtype=torch.long), "prompt_mask": torch.ones(count, 1),
              "completion_ids": torch.zeros_like(mask, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old_logps,
              "num_items_in_batch": mask.sum() if total_tokens is None else total_tokens}
    if ref_logps is not None:
        inputs["ref_per_token_logps"] = ref_logps
    return trl.GRPOTrainer._compute_loss(trainer, None, inputs)


def crafted(seed=0, count=4):
    generator = torch.Generator().manual_seed(seed)
    logps = -torch.rand(count, MAX_LENGTH, generator=generator) * 3  # (N, T)
    old = logps + 0.3 * torch.randn(count, MAX_LENGTH, generator=generator)  # ratios clipped both ways
    ref = logps + 0.5 * torch.randn(count, MAX_LENGTH, generator=generator)
    entropies = torch.rand(count, MAX_LENGTH, generator=generator) * 2
    advantages = torch.randn(count, generator=generator)
    mask = torch.ones(count, MAX_LENGTH)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    return logps, old, ref, entropies, advantages, mask


def hasten_loss(loss_type, logps, entropies, old, advantages, mask, coef, *, ref=None, beta=0.0,
                bias_correction=False, quantile=1.0, sequence=False, chunks=1, total_tokens=None,
                total_sequences=None):
    """One chunk's loss as the learner forms it: the registry's loss minus coef x entropy_term."""
    keep = high_entropy_mask(entropies.detach(), mask, quantile).float() if quantile < 1 else None
    settings = LossSettings(epsilon=0.2, epsilon_high=0.28, beta=beta, kl_bias_correction=bias_correction,
                            sequence_level=sequence)
    inputs = LossInputs(logps, old, ref, advantages, mask,
                        float(mask.sum()) if total_tokens is None else total_tokens,
                        mask.shape[0] if total_sequences is None else total_sequences, MAX_LENGTH,
                        num_chunks=chunks, importance_weights=keep)
    loss, _ = LOSSES[loss_type](inputs, settings)
    tokens = mask if keep is None else mask * keep
    return loss - coef * entropy_term(entropies, tokens, chunks)


def leaves(*tensors):
    return [tensor.clone().requires_grad_(True) for tensor in tensors]


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_entropy_bonus_equals_trl(loss_type, quantile):
    logps, old, _, entropies, advantages, mask = crafted()
    ours_logps, ours_entropies = leaves(logps, entropies)
    theirs_logps, theirs_entropies = leaves(logps, entropies)
    ours = hasten_loss(loss_type, ours_logps, ours_entropies, old, advantages, mask, 0.3, quantile=quantile)
    theirs = trl_loss(trl_trainer(loss_type, entropy_coef=0.3, quantile=quantile), theirs_logps, theirs_entropies,
                      old, advantages, mask)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_logps.grad, theirs_logps.grad, atol=1e-7)
    assert torch.allclose(ours_entropies.grad, theirs_entropies.grad, atol=1e-7)
    assert ours_entropies.grad.abs().sum() > 0  # the bonus has a gradient


def test_entropy_bonus_over_two_chunks_is_trls_accumulation():
    """Two chunks (gradient_accumulation_steps=2): each chunk's mean entropy over 2, as TRL's micro-batches."""
    logps, old, _, entropies, advantages, mask = crafted(seed=1, count=4)
    total = float(mask.sum())
    ours = theirs = 0.0
    trainer = trl_trainer("dapo", entropy_coef=0.2, accumulation=2)
    for half in (slice(0, 2), slice(2, 4)):
        ours = ours + hasten_loss("dapo", logps[half], entropies[half], old[half], advantages[half], mask[half], 0.2,
                                  chunks=2, total_tokens=total, total_sequences=4)
        theirs = theirs + trl_loss(trainer, logps[half], entropies[half], old[half], advantages[half], mask[half],
                                   total_tokens=torch.tensor(total))
    assert float(ours) == pytest.approx(float(theirs), abs=1e-6)


def test_adaptive_entropy_control_follows_trl():
    """Over optimizer steps of one micro-batch: the coefficient applied, its update and the loss, as TRL's."""
    settings = EntropySettings(coef=0.01, adaptive=True, coef_min=0.0, coef_max=0.02, coef_delta=0.005, target=0.9)
    control = EntropyControl(settings)
    trainer = trl_trainer("grpo", entropy_coef=0.01, adaptive=True, target=0.9, coef_delta=0.005, coef_max=0.02)
    logps, old, _, entropies, advantages, mask = crafted(seed=2)
    applied = []
    for step, scale in enumerate([0.2, 0.3, 0.4, 0.5, 1.5, 1.5, 1.5, 0.1, 0.1]):  # entropy below, then above target
        current = entropies * scale
        ours = hasten_loss("grpo", logps, current, old, advantages, mask, control.applied())
        theirs = trl_loss(trainer, logps, current, old, advantages, mask)
        assert float(ours) == pytest.approx(float(theirs), abs=1e-6), step
        applied.append(control.applied())
        control.update(float((current * mask).sum()), float(mask.sum()))
        assert control.coef == pytest.approx(trainer.entropy_coef, abs=1e-12), step
        assert control.last_entropy == pytest.approx(trainer._last_world_entropy, abs=1e-6)
    assert applied[0] == 0.0 and max(applied) == pytest.approx(0.02) and min(applied[1:]) == 0.0  # capped, gated
    restored = EntropyControl(settings)
    restored.load_state_dict(control.state_dict())
    assert (restored.coef, restored.last_entropy, restored.applied()) == (control.coef, control.last_entropy,
                                                                           control.applied())
    assert EntropyControl(EntropySettings(coef=0.1)).applied() == 0.1  # static: applied from the first step
    assert not EntropySettings().enabled and EntropySettings(adaptive=True).enabled


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("on_policy", [False, True])
def test_bias_corrected_kl_equals_trl(loss_type, sequence, on_policy):
    """TRL's default use_bias_correction_kl=True with beta > 0: k3 x the ratio, in value and gradient."""
    logps, old, ref, _, advantages, mask = crafted(seed=3)
    old = logps if on_policy else old
    level = "sequence" if sequence else "token"
    ours_type = "gspo" if sequence and loss_type == "grpo" else loss_type
    results = {}
    for correction in (True, False):
        ours_logps, theirs_logps = leaves(logps, logps)
        ours = hasten_loss(ours_type, ours_logps, torch.zeros_like(logps), old.detach(), advantages, mask, 0.0,
                           ref=ref, beta=0.1, bias_correction=correction,
                           sequence=sequence and ours_type != "gspo")
        theirs = trl_loss(trl_trainer(loss_type, beta=0.1, bias_correction=correction, level=level), theirs_logps,
                          torch.zeros_like(logps), old.detach(), advantages, mask, ref_logps=ref)
        assert float(ours) == pytest.approx(float(theirs), abs=1e-6)
        ours.backward()
        theirs.backward()
        assert torch.allclose(ours_logps.grad, theirs_logps.grad, atol=1e-7)
        results[correction] = ours_logps.grad
    assert not torch.allclose(results[True], results[False])  # the correction changes the gradient, on-policy too


def test_grpo_config_maps_the_entropy_and_kl_options():
    from hasten.api import GRPOConfig
    from hasten.config import Config

    def mapped(**fields):
        return dict(GRPOConfig(output_dir="out", per_device_train_batch_size=4, num_generations=4, max_steps=1,
                               **fields).overrides(8, 0))

    keys = mapped(entropy_coef=0.05, use_adaptive_entropy=True, entropy_coef_min=0.01, entropy_coef_max=0.5,
                  entropy_coef_delta=0.01, entropy_target=1.5)
    assert [keys[f"algo.{name}"] for name in ("entropy_coef", "adaptive_entropy", "entropy_coef_min",
                                              "entropy_coef_max", "entropy_coef_delta", "entropy_target")] == \
        [0.05, True, 0.01, 0.5, 0.01, 1.5]
    assert mapped()["algo.kl_bias_correction"] is True  # TRL's default on the API path
    assert mapped(use_bias_correction_kl=False)["algo.kl_bias_correction"] is False
    assert Config().algo.kl_bias_correction is False and Config().algo.entropy_coef == 0.0  # the CLI's unchanged


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_entropy_gradient_matches_autograd(temperature):
    from hasten.train.packing import TargetLogSoftmax

    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 10, 3, 5, 1])
    weights = torch.randn(6, dtype=torch.float64)
    logps, entropy = TargetLogSoftmax.apply(logits, targets, temperature, True, True)
    assert entropy.requires_grad
    (logps.sum() + (weights * entropy).sum()).backward()
    reference = logits.detach().clone().requires_grad_(True)
    log_probs = torch.log_softmax(reference / temperature, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    plain = log_probs.gather(-1, targets[:, None]).squeeze(-1).sum() + (weights * entropy).sum()
    plain.backward()
    assert torch.allclose(logits.grad, reference.grad, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x: TargetLogSoftmax.apply(x, targets, temperature, True, True)[1],
                                    (logits.detach().clone().requires_grad_(True),))


def _bonus(coef, packed=True, chunk_tokens=None, skip=False):
    def apply(cfg):
        cfg.algo.entropy_coef = coef
        cfg.algo.loss = "dapo"
        cfg.train.max_grad_norm = 0.0  # the gradients as the loss gives them
        cfg.speed.packed_learning = packed
        cfg.speed.skip_zero_advantage = skip
        if chunk_tokens is not None:
            cfg.speed.logit_chunk_tokens = chunk_tokens
    return apply


def test_learning_pass_gives_the_entropy_its_gradient(model, tokenizer):
    """The learner's gradient with the bonus is TRL's _compute_loss's on the model's own log-probs and
    entropies, in both passes (packed with chunked logits, padded), and differs from the plain loss's."""
    from conftest import learner_step, rollout_of

    from hasten.train.logprobs import completion_logprobs

    rollout = rollout_of(model, tokenizer, num_generations=4, max_new_tokens=8)
    advantages = torch.linspace(-1.0, 1.0, rollout.num_samples)
    advantages[:4] = 0.0  # a zero-advantage group still learns from the bonus
    copy = __import__("copy").deepcopy(model)
    group = torch.arange(rollout.num_samples) // rollout.num_generations
    stats = completion_logprobs(copy, rollout.prompt_ids[group], rollout.prompt_mask[group], rollout.completion_ids,
                                rollout.completion_mask, rollout.sampling.temperature, True, True)
    mask = rollout.completion_mask.float()
    theirs = trl_loss(trl_trainer("dapo", entropy_coef=0.5), stats.logps, stats.entropy, stats.logps.detach(),
                      advantages, mask)
    theirs.backward()
    expected = [p.grad for p in copy.parameters() if p.requires_grad]
    plain = learner_step(model, tokenizer, rollout, advantages, _bonus(0.0))[1]
    for configure in (_bonus(0.5), _bonus(0.5, chunk_tokens=5), _bonus(0.5, packed=False), _bonus(0.5, skip=True)):
        metrics, grads = learner_step(model, tokenizer, rollout, advantages, configure)
        assert all(torch.allclose(ours, want, atol=1e-5, rtol=1e-4) for ours, want in zip(grads, expected))
        assert metrics["entropy_coef"] == 0.5 and "policy_loss" in metrics
    assert any(not torch.allclose(a, b) for a, b in zip(plain, expected))


def test_adaptive_control_moves_after_each_optimizer_step(model, tokenizer):
    from conftest import rollout_of

    from hasten.config import Config
    from hasten.models import Policy
    from hasten.train.learner import Learner

    cfg = Config()
    cfg.algo.adaptive_entropy, cfg.algo.entropy_coef, cfg.algo.entropy_target = True, 0.1, 100.0  # always below
    learner = Learner.from_config(Policy(model, tokenizer, "tiny"), cfg)
    rollout = rollout_of(model, tokenizer, num_generations=4, max_new_tokens=4)
    metrics = learner.step(rollout, torch.linspace(-1.0, 1.0, rollout.num_samples))
    assert metrics["entropy_coef"] == pytest.approx(0.105) and learner.entropy_control.last_entropy < math.inf
    assert learner.entropy_control.applied() == pytest.approx(0.105)  # the entropy was below the target


def test_adaptive_coefficient_continues_after_a_resume(tmp_path):
    """The controller's state is in the checkpoint (TRL's entropy_ctrl_state.json): resuming from step 1
    continues the coefficient the uninterrupted run had."""
    from hasten.api import GRPOConfig, GRPOTrainer

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def trainer(steps):
        args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                          max_steps=steps, save_steps=1, max_completion_length=4, logging_steps=1,
                          use_adaptive_entropy=True, entropy_coef=0.1, entropy_target=100.0, entropy_coef_delta=0.01)
        return GRPOTrainer(model="tiny", reward_funcs=length, args=args,
                           train_dataset=[{"prompt": "a"}, {"prompt": "b"}], log=lambda line: None)

    def coefficients(run):
        return [entry["entropy_coef"] for entry in run.state.log_history
                if "entropy_coef" in entry and "train_loss" not in entry]

    whole = trainer(3)
    whole.train()
    assert coefficients(whole) == pytest.approx([0.11, 0.12, 0.13])  # the entropy is below the target: it rises
    resumed = trainer(3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert coefficients(resumed)[-2:] == pytest.approx([0.12, 0.13])
