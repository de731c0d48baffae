"""The learner: the policy-gradient update on a rollout, through the optimization layer.

One `step(rollout, advantages)` runs num_iterations (mu) optimizer steps on
one generation batch. The batch is split into gradient_accumulation_steps
chunks of whole samples, each split again to speed.token_budget tokens when
that is set (microbatch.py); each chunk's loss is already scaled to its share
of the batch loss (see algo/losses.py), so gradients simply add up.

No redundant passes:
- old-policy log-probs are the detached log-probs of the first iteration's
  forward (taken before any update), never a separate pass; with mu = 1
  they are used at once and not even stored;
- the reference model runs only when beta > 0 (one no-grad pass per chunk,
  before any update); with LoRA it is the adapter-disabled policy.

`step` is the update and nothing else: log-probs, the loss from the registry
(LOSSES[algo.loss]), backward, the optimizer. Every optional feature is built
once into each chunk's LossInputs by train/step_inputs.py: samples left out
(speed.skip_zero_advantage), the old log-probs and importance weights fixed on
a chunk's first pass (the Correction), the high-entropy mask, and the terms
algo/losses.add_optional_terms adds: the entropy bonus (algo.entropy_coef: the
chunk's mean token entropy with its gradient, over the tokens the policy term
learns from; the coefficient is the EntropyControl's, updated after each
optimizer step) and a mixture-of-experts model's aux loss. Rank sums are
distributed.batch_totals and Optimization.step_shares.

The log-prob pass is chosen once, at construction (`LogprobPass`): packed or
padded, grouped attention and oneDNN linears on or off. The one choice left
to the data is speed.min_pack_ratio (a batch too sparse to pack runs padded).
The temperature and the length cap come from the rollout's own
SamplingParams: the learner scores exactly the distribution that was sampled.
AdamW, the schedule, precision, clipping and the NaN guard are
train/optimization.py's, shared with the game and SFT loops.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import ticker
from ..algo import LOSSES, LossSettings
from ..algo.entropy import EntropyControl, EntropySettings
from ..algo.losses import add_optional_terms
from ..algo.zero_advantage import learning_rows
from ..config import Config
from ..device import machine_bytes
from ..kernels.fast_linear import onednn_linears
from ..kernels.recast_linear import active as recast_active, recast_linears
from ..kernels.fast_linear import resolve as resolve_fast_linear
from ..kernels.memory import on_device, set_gradient_checkpointing
from ..kernels.precision import FP32_HEAD_MODES, fp32_head, resolve_precision
from ..models import Policy, Reference
from ..rollout import Rollout
from ..rollout.shared_weights import resolve as resolve_engine_weights
from . import distributed, fsdp
from .logprobs import TokenStats, completion_logprobs
from .microbatch import COPY_BYTES, MOMENT_BYTES, micro_batches, parameter_count, resolve_budget
from .optimization import Optimization, OptimizerSettings
from .packing import backbone_and_head, pack_ratio, packed_logprobs
from .step_inputs import StepBatch, StepSums


@dataclass(frozen=True)
class LogprobPass:
    """The learning pass's kernels, resolved once from `speed:` and the model."""

    packed: bool  # speed.packed_learning: one row per group (train/packing.py)
    min_pack_ratio: float  # below this fill, a batch runs the padded pass anyway
    logit_chunk_tokens: int
    grouped_attention: bool  # speed.grouped_attention, packed pass only
    shared_prefix: bool  # speed.shared_prefix: the prompts' common prefix once (grouped packed pass only)
    fast_linear: bool  # speed.fast_linear, auto resolved (fast_linear.resolve)
    fp32_head: bool = False  # the learning precision keeps the LM head fp32 under autocast (bf16_fp32head)
    recast: bool = True  # under bf16 autocast, linears that hold no bf16 weight copy for backward (recast_linear.py)

    @classmethod
    def choose(cls, cfg: Config, precision: str = "fp32") -> LogprobPass:
        """precision: the learning precision as resolved (kernels.precision.resolve_precision)."""
        # fast_linear, recast linears and grouped_attention switch the model's kernels for the forward only. With
        # gradient checkpointing, backward recomputes layers after that switch is undone and
        # torch rejects the mismatch, so checkpointing runs them on the plain kernels. (The learner
        # sets the model's checkpointing from the same key, so the key is what the model will do.)
        # Recast linears also stay off under speed.compile: dynamo cannot trace their shared input cast (it
        # leaves the Function through a cache), so each compiled layer would fall back to eager with a long log.
        speed = cfg.speed
        plain_kernels = speed.gradient_checkpointing
        return cls(speed.packed_learning, speed.min_pack_ratio, speed.logit_chunk_tokens,
                   speed.grouped_attention and not plain_kernels, speed.shared_prefix,
                   resolve_fast_linear(speed.fast_linear) and not plain_kernels, precision in FP32_HEAD_MODES,
                   recast=not (plain_kernels or speed.compile))

    def __call__(self, model, rollout: Rollout, rows: torch.Tensor, with_entropy: bool,
                 entropy_grad: bool = False, router_aux: bool = False) -> TokenStats:
        """entropy_grad: the entropy keeps its gradient (the entropy bonus). router_aux: a mixture-of-experts
        model's load-balancing loss too, which the padded pass alone returns (its router sees TRL's batch)."""
        temperature = rollout.sampling.temperature
        recast = self.recast and recast_active()  # under bf16 autocast on the CPU
        lm_head = backbone_and_head(model)[1] if self.fp32_head or recast else None
        head = lm_head if self.fp32_head else None  # bf16_fp32head: the head stays fp32
        # fp32 passes: oneDNN's linears where fast_linear says; bf16 autocast: the decoder's linears recast
        # (the same bits, no bf16 weight copy held for backward), the head left to autocast or its fp32 forward
        with onednn_linears(model, self.fast_linear), fp32_head(head, head is not None, onednn=self.fast_linear), \
                recast_linears(model, recast, leave=lm_head):
            # min_pack_ratio 0 packs every batch: its fill is not measured (host syncs on a GPU)
            if self.packed and not router_aux and (self.min_pack_ratio <= 0
                                                   or pack_ratio(rollout, rows) >= self.min_pack_ratio):
                return packed_logprobs(model, rollout, rows, temperature, with_entropy, self.logit_chunk_tokens,
                                       self.grouped_attention, self.shared_prefix, entropy_grad)
            group = rows // rollout.num_generations  # prompt index of each sample
            return completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                       rollout.completion_ids[rows], rollout.completion_mask[rows],
                                       temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                       router_aux=router_aux)


class OffPolicyStats:
    """How far the learner's policy is from the one that sampled, over the sampled tokens.

    logp_abs_diff: mean |log pi_learner - log pi_sampler|. kl: the k3 estimate of KL(sampler || learner),
    mean(r - 1 - log r) with r = pi_learner / pi_sampler per token (non-negative, unbiased for tokens drawn
    from the sampler). ratio_mean / ratio_max: r before any cap. truncated_fraction (a cap given): the
    share of tokens whose r exceeds the cap, i.e. whose importance weight the cap lowered.
    """

    def __init__(self, prefix: str, cap: float | None = None):
        self.prefix = prefix  # async (older weights) | vllm | bf16_sampler | int8_sampler (another implementation)
        self.cap = cap
        self.tokens = 0.0
        self.abs_diff = 0.0
        self.kl = 0.0
        self.ratio_sum = 0.0
        self.ratio_max = 0.0
        self.truncated = 0.0

    def add(self, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> None:
        diff = (logps - sampling_logps) * mask  # (rows, T) log r, 0 off the mask
        ratio = diff.exp() * mask  # (rows, T) pi_current / pi_sampling per token
        self.tokens += float(mask.sum())
        self.abs_diff += float(diff.abs().sum())
        self.kl += float(((diff.exp() - 1 - diff) * mask).sum())  # k3 per token; exactly 0 where diff is 0
        self.ratio_sum += float(ratio.sum())
        self.ratio_max = max(self.ratio_max, float(ratio.max()) if ratio.numel() else 0.0)
        if self.cap is not None:
            self.truncated += float(((ratio > self.cap) & mask.bool()).sum())

    def metrics(self) -> dict[str, float]:
        """Over the tokens that went through the pass; none (every sample skipped: speed.skip_zero_advantage)
        reports nothing rather than a ratio of 0."""
        if self.tokens == 0:
            return {}
        tokens, prefix = self.tokens, self.prefix
        record = {f"{prefix}/logp_abs_diff": self.abs_diff / tokens, f"{prefix}/kl": self.kl / tokens,
                  f"{prefix}/ratio_mean": self.ratio_sum / tokens, f"{prefix}/ratio_max": self.ratio_max}
        if self.cap is not None:
            record[f"{prefix}/truncated_fraction"] = self.truncated / tokens
        return record


@dataclass(frozen=True)
class LearnerSettings:
    """The learner's share of the config, read once: the step never looks at `Config` again."""

    loss: str  # algo.loss: a key of LOSSES
    loss_settings: LossSettings  # clip range and beta
    num_iterations: int  # mu: optimizer steps per generation batch
    accumulation_steps: int  # train.gradient_accumulation_steps: chunks of whole samples
    token_budget: int  # speed.token_budget: chunks split again to this many model-input tokens (0 = off)
    packed: bool  # speed.packed_learning: micro-batches count packed rows, not padded ones
    skip_zero_advantage: bool  # speed.skip_zero_advantage, and the model is not FSDP-sharded
    offload_reference: bool  # speed.offload_reference
    top_entropy_quantile: float = 1.0  # algo.top_entropy_quantile: < 1 masks the low-entropy tokens' policy term
    entropy: EntropySettings = EntropySettings()  # algo.entropy_coef and the adaptive control's keys
    router_aux_loss_coef: float = 0.0  # algo.router_aux_loss_coef on a mixture-of-experts model, else 0 (off)

    @classmethod
    def from_config(cls, cfg: Config, sharded: bool, model_config=None, device: str = "cpu") -> LearnerSettings:
        """model_config, device: the policy's (transformers') config and device, which speed.token_budget=auto
        sizes from."""
        algo, speed = cfg.algo, cfg.speed
        # FSDP's forwards are collectives: every rank must run the same passes, so nothing is skipped there.
        loss = LossSettings(algo.epsilon, algo.epsilon_high, algo.beta, algo.importance_sampling_level == "sequence",
                            delta=algo.delta, off_policy_threshold=algo.off_policy_mask_threshold,
                            sapo_temperature_pos=algo.sapo_temperature_pos,
                            sapo_temperature_neg=algo.sapo_temperature_neg,
                            vespo_k_pos=algo.vespo_k_pos, vespo_lambda_pos=algo.vespo_lambda_pos,
                            vespo_k_neg=algo.vespo_k_neg, vespo_lambda_neg=algo.vespo_lambda_neg,
                            kl_bias_correction=algo.kl_bias_correction)
        entropy = EntropySettings(algo.entropy_coef, algo.adaptive_entropy, algo.entropy_coef_min,
                                  algo.entropy_coef_max, algo.entropy_coef_delta, algo.entropy_target)
        return cls(algo.loss, loss, algo.num_iterations,
                   cfg.train.gradient_accumulation_steps, token_budget(cfg, sharded, model_config, device),
                   speed.packed_learning,
                   speed.skip_zero_advantage and not sharded, speed.offload_reference, algo.top_entropy_quantile,
                   entropy, router_aux_coef(model_config, algo.router_aux_loss_coef))


def is_mixture_of_experts(model_config) -> bool:
    """TRL's test: the (text) config has an output_router_logits field, whatever its value."""
    if model_config is None:
        return False
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text, "output_router_logits", None) is not None


def router_aux_coef(model_config, coef: float | None) -> float:
    """The aux loss's coefficient, as TRL's: algo.router_aux_loss_coef, or when None the model config's own
    router_aux_loss_coef (0 when it declares none: GLM-4 MoE returns no router loss at all); 0 for a dense model."""
    if not is_mixture_of_experts(model_config):
        return 0.0
    if coef is None:
        text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        return float(getattr(text, "router_aux_loss_coef", None) or 0.0)
    return coef


def token_budget(cfg: Config, sharded: bool, model_config, device: str = "cpu") -> int:
    """speed.token_budget in tokens. auto (microbatch.resolve_budget) is off where a split would change
    what is learned or cannot run: bnpo's normalizer, the entropy bonus's mean and top_entropy_quantile's
    threshold are per micro-batch; FSDP's ranks must run the same passes."""
    setting = cfg.speed.token_budget
    if setting != "auto":
        return setting
    algo = cfg.algo
    if sharded or algo.loss == "bnpo" or algo.entropy_coef or algo.adaptive_entropy or algo.top_entropy_quantile < 1:
        return 0
    if model_config is None:
        raise ValueError("speed.token_budget=auto needs the policy's model config")
    # the lean engine's copy counts where speed.engine_weights resolves to copy (the factory's rule), at the
    # bytes of the precision it samples in; AdamW's moments at theirs
    engine_copy = resolve_engine_weights(cfg.speed.engine_weights, parameter_count(model_config),
                                         cfg.generation.precision, machine_bytes(device))[0] == "copy"
    return resolve_budget(setting, model_config, cfg.speed.gradient_checkpointing, device=device,
                          lora=cfg.model.lora, logit_chunk=cfg.speed.logit_chunk_tokens,
                          copy_bytes=COPY_BYTES[cfg.generation.precision] if engine_copy else 0,
                          moment_bytes=MOMENT_BYTES[cfg.train.optimizer_moments])


@dataclass(frozen=True)
class Correction:
    """How the learner treats the log-probs the batch was sampled with; one per run, chosen at construction.

    stale: the batch was sampled from older weights (algo.async_steps), so the clipped ratio is taken
    against its sampling log-probs, not the current policy's detached ones; the gap is logged (async/*).
    cap: another implementation of these weights sampled (speed.engine=vllm, or the lean engine's bf16 or
    int8 matmuls): each token's loss is weighted by min(exp(logp_learner - logp_sampler), cap), truncated
    importance sampling as TRL's vllm_importance_sampling_correction with vllm_importance_sampling_mode=
    "token_truncate" (its clip_max is the cap); logged as vllm/*, bf16_sampler/* or int8_sampler/*.
    Both asked for: stale alone. The ratio is then taken against the sampler's own log-probs, which carry its
    mismatch as well as the staleness, so the importance weights would be exp(0) = 1 and their statistics
    zero; none are applied or logged (async/* measures the learner against the sampler).
    Neither: on-policy, the sampling log-probs are not read.
    """

    stale: bool = False
    cap: float | None = None
    sampler: str = "bf16_sampler"  # the metrics prefix of `cap`'s sampler: vllm | bf16_sampler | int8_sampler

    @classmethod
    def for_run(cls, cfg: Config) -> Correction:
        speed, algo, generation = cfg.speed, cfg.algo, cfg.generation
        # auto is resolved by the engine factory before this is read; unresolved (no engine made), it is fp32
        other_sampler = speed.engine == "vllm" or generation.precision not in ("fp32", "auto")
        cap = algo.vllm_importance_sampling_cap if other_sampler and algo.vllm_importance_sampling_correction else None
        if not other_sampler or algo.async_steps:  # stale: the ratio against the sampler's log-probs (above)
            return cls(stale=bool(algo.async_steps))
        sampler = "vllm" if speed.engine == "vllm" else f"{generation.precision}_sampler"
        return cls(stale=bool(algo.async_steps), cap=cap, sampler=sampler)

    def trackers(self) -> tuple[OffPolicyStats | None, OffPolicyStats | None]:
        """A step's (staleness, sampler) statistics, None where that correction is off."""
        return (OffPolicyStats("async") if self.stale else None,
                OffPolicyStats(self.sampler, self.cap) if self.cap is not None else None)

    def anchor(self, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
               trackers: tuple[OffPolicyStats | None, OffPolicyStats | None]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(old log-probs the ratio is taken against, importance weights or None) for one chunk's first pass.

        logps: (rows, T) the learner's detached log-probs before any update; sampling_logps, mask: (rows, T).
        """
        stale, sampler = trackers
        old = logps  # the sampling policy: no update has happened yet...
        if stale is not None:  # ...unless it sampled from older weights
            old = sampling_logps.to(logps.device)
            stale.add(logps, old, mask.to(logps.device))
        weights = None
        if sampler is not None:  # ...or from another implementation of these weights
            sampled = sampling_logps.to(old.device)
            token_mask = mask.to(old.device)
            sampler.add(old, sampled, token_mask)
            weights = torch.exp(old - sampled).clamp(max=self.cap) * token_mask  # (rows, T)
        return old, weights


@dataclass(frozen=True)
class LearningPlan:
    """Everything the learner decides from the config, resolved once (train/plan.py holds it for a run)."""

    settings: LearnerSettings
    logprob_pass: LogprobPass
    correction: Correction
    precision: str = "fp32"  # the learning precision, auto resolved: fp32 | bf16 | bf16_fp32head | fp16
    precision_reason: str = "as set"  # why (the plan line prints it)

    @classmethod
    def resolve(cls, cfg: Config, sharded: bool, model_config=None, device: str = "cpu",
                weight_dtype: torch.dtype = torch.float32) -> LearningPlan:
        """weight_dtype: the policy's weights' (an fp32 head needs them fp32: resolve_precision)."""
        hidden = getattr(model_config, "hidden_size", None) if model_config is not None else None
        precision, reason = resolve_precision(cfg.train.precision, torch.device(device), hidden, weight_dtype)
        return cls(LearnerSettings.from_config(cfg, sharded, model_config, device),
                   LogprobPass.choose(cfg, precision), Correction.for_run(cfg), precision, reason)

    def describe(self) -> str:
        """A few words for the run's plan line: the pass and the correction."""
        chosen = self.logprob_pass
        kernels = [name for name, on in (("grouped attention", chosen.grouped_attention),
                                          ("shared prefix", chosen.shared_prefix and chosen.grouped_attention),
                                          ("oneDNN linears", chosen.fast_linear)) if on]
        learning = ("packed" if chosen.packed else "padded") + (f" ({', '.join(kernels)})" if kernels else "")
        correction = self.correction
        fixes = (["stale-weight ratios"] if correction.stale else []) + (
            [f"importance weights capped at {correction.cap:g} ({correction.sampler})"] if correction.cap else [])
        skipping = ", zero-advantage samples skipped" if self.settings.skip_zero_advantage else ""
        if self.settings.token_budget:
            skipping = f", micro-batches of <= {self.settings.token_budget} tokens{skipping}"
        precision = PRECISION_WORDS[self.precision] + (f" ({self.precision_reason})" if self.precision_reason != "as set"
                                                         else "")
        return (f"{learning} learning pass in {precision}{skipping}, "
                f"{'; '.join(fixes) if fixes else 'on-policy'}")


PRECISION_WORDS = {"fp32": "fp32", "bf16": "bf16 autocast", "bf16_fp32head": "bf16 with an fp32 head",
                   "fp16": "fp16 autocast with a loss scaler"}


class Learner:
    def __init__(self, policy: Policy, plan: LearningPlan, optimization: Optimization,
                 reference: Reference | None = None):
        self.policy = policy
        self.settings = plan.settings
        self.loss_fn = LOSSES[plan.settings.loss]
        self.optimization = optimization
        self.parameters = optimization.parameters
        self.logprob_pass = plan.logprob_pass
        self.reference = reference
        self.correction = plan.correction
        self.entropy_control = EntropyControl(plan.settings.entropy)
        self.device = next(policy.model.parameters()).device

    @classmethod
    def from_config(cls, policy: Policy, cfg: Config, reference: Reference | None = None,
                    log: Callable[[str], None] = print, correction: Correction | None = None,
                    plan: LearningPlan | None = None) -> Learner:
        """The learner for `cfg`: its optimizer built, the model's checkpointing set, and the plan (the run's,
        resolved in prepare; else resolved here) taken as it is. correction: replaces the plan's (tests)."""
        sharded = fsdp.is_sharded(policy.model)
        first = next(policy.model.parameters())
        plan = plan if plan is not None else LearningPlan.resolve(cfg, sharded, policy.model.config, str(first.device),
                                                                  first.dtype)
        if correction is not None:
            plan = dataclasses.replace(plan, correction=correction)
        parameters = [p for p in policy.model.parameters() if p.requires_grad]
        optimization = Optimization(parameters, OptimizerSettings.for_training(cfg, plan.precision), cfg.speed, log,
                                    sharded=sharded)
        set_gradient_checkpointing(policy.model, cfg.speed.gradient_checkpointing)
        return cls(policy, plan, optimization, reference)

    def step(self, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor | None = None
             ) -> dict[str, float]:
        """num_iterations optimizer steps on `rollout`; returns the metrics record.

        loss_mask: (B*G, T), the completion tokens the loss counts (default: all of them); the
        forward always sees whole completions (algo.mask_truncated_completions passes one).
        """
        settings = self.settings
        lr = self.optimization.lr  # the lr these updates use
        batch = self._batch(rollout, advantages, loss_mask)  # chunks, the samples that run, global totals
        sums = StepSums.for_step(reports_kl=batch.ref_logps is not None and settings.loss_settings.beta > 0)
        count = ticker.tally("learning", settings.num_iterations * len(batch.passes), "micro-batch")
        for iteration in range(settings.num_iterations):
            sums.start_iteration()
            coef = self.entropy_control.applied()  # the same for every chunk of this optimizer step (TRL)
            for index, rows in enumerate(batch.passes):
                count.done += 1
                if not rows.numel():  # no sample here can have a gradient; its clip metrics are 0
                    continue
                stats = self._logprobs(rollout, rows, first=iteration == 0)  # (n, T) log-probs, entropies
                inputs = batch.loss_inputs(index, stats, coef)  # old log-probs, weights, masks, optional terms
                policy_loss, metrics = self.loss_fn(inputs, settings.loss_settings)  # LOSSES[algo.loss]
                loss = add_optional_terms(policy_loss, inputs)  # - entropy bonus + aux loss, where on
                self.optimization.backward(loss)
                sums.add(inputs, policy_loss, loss, metrics, len(batch.chunks))
            self._optimizer_step(batch, sums)
        count.finish()
        return self._report(sums, lr, batch)

    def _batch(self, rollout: Rollout, advantages: torch.Tensor, loss_mask: torch.Tensor | None) -> StepBatch:
        """The step's batch: chunks, the samples of each that can have a gradient (speed.skip_zero_advantage),
        the reference's log-probs, the global normalisers, and what each chunk's loss inputs are built from."""
        if rollout.sampling is None:
            raise ValueError("the rollout does not say how it was sampled (Rollout.sampling)")
        settings = self.settings
        mask = rollout.completion_mask if loss_mask is None else loss_mask  # (B*G, T)
        chunks = micro_batches(rollout, settings.accumulation_steps, settings.token_budget, settings.packed)
        chunks = [rows for rows in chunks if rows.numel()]  # dynamic sampling may leave fewer samples
        bonus = settings.entropy.enabled  # every token has an entropy gradient: no sample is skipped then
        router_coef = settings.router_aux_loss_coef  # > 0: a mixture-of-experts model's load-balancing loss joins
        passes = ([learning_rows(rows, advantages, mask, settings.loss_settings.beta, bonus or router_coef > 0)
                   for rows in chunks]
                  if settings.skip_zero_advantage else chunks)
        ref_logps = self._reference_logprobs(rollout, passes) if self.reference is not None else None
        # Under torchrun this rank's rollout is its share (distributed.py): the loss is the global batch's.
        totals = distributed.batch_totals(float(mask.sum()), rollout.num_samples, len(chunks))
        trackers = self.correction.trackers()  # this step's off-policy statistics, filled on the first passes
        return StepBatch(rollout, advantages, mask, chunks, passes, totals, ref_logps,
                         functools.partial(self.correction.anchor, trackers=trackers), trackers,
                         settings.top_entropy_quantile, bonus, router_coef)

    def _logprobs(self, rollout: Rollout, rows: torch.Tensor, first: bool) -> TokenStats:
        """The policy's pass over `rows` under train.precision: the entropies too on the first iteration (the
        metric, the high-entropy mask) and, with their gradient, under the bonus; a MoE model's aux loss."""
        fsdp.before_pass(self.policy.model)  # FSDP: the root's weights for the packed pass; else nothing
        bonus = self.settings.entropy.enabled
        with self.optimization.autocast():  # train.precision: a no-op in fp32
            return self.logprob_pass(self.policy.model, rollout, rows, with_entropy=first or bonus,
                                     entropy_grad=bonus, router_aux=self.settings.router_aux_loss_coef > 0)

    def _optimizer_step(self, batch: StepBatch, sums: StepSums) -> None:
        """One optimizer step on the iteration's gradients: zeros where skipped samples left none, the loss
        summed over ranks, then the entropy control's update from the step's bonus tokens (every rank's)."""
        if batch.learned < batch.rollout.num_samples and self.parameters:  # some samples were left out
            self.optimization.zero_missing_gradients(ran_backward=any(rows.numel() for rows in batch.passes))
        sums.loss, sums.grad_norm = self.optimization.step_shares(sums.loss)
        if self.settings.entropy.enabled:
            self.entropy_control.update(distributed.sum_over_ranks(sums.bonus_entropy),
                                        distributed.sum_over_ranks(sums.bonus_tokens))
            sums.metrics["entropy_coef"] = sums.metrics.get("entropy_coef", 0.0) + self.entropy_control.coef

    def _report(self, sums: StepSums, lr: float, batch: StepBatch) -> dict[str, float]:
        """The step's metrics record, averaged over iterations and ranks."""
        iterations = self.settings.num_iterations
        out = distributed.mean_over_ranks({key: value / iterations for key, value in sums.metrics.items()})
        out.update(loss=sums.loss, grad_norm=sums.grad_norm, lr=lr)
        if self.settings.entropy.enabled:
            out["policy_loss"] = distributed.sum_over_ranks(sums.policy_loss)
        entropy_tokens = distributed.sum_over_ranks(batch.entropy_tokens)
        if entropy_tokens > 0:  # the tokens that went through the pass (all of them unless some were skipped)
            out["entropy"] = distributed.sum_over_ranks(batch.entropy) / entropy_tokens
        if self.settings.skip_zero_advantage:
            out["learn/skipped_samples"] = distributed.mean_over_ranks(
                {"skipped": 1.0 - batch.learned / max(batch.rollout.num_samples, 1)})["skipped"]
        for tracker in batch.trackers:
            if tracker is not None:
                out.update(tracker.metrics())
        if self.optimization.guard is not None:
            out["nan_guard/skipped"] = self.optimization.skipped_updates  # over the run so far
        return out

    @torch.no_grad()
    def _reference_logprobs(self, rollout: Rollout, chunks) -> list[torch.Tensor | None]:
        if not any(rows.numel() for rows in chunks):  # every sample skipped: no reason to move the reference
            return [None] * len(chunks)
        offload = self.settings.offload_reference and self.reference.frozen is not None
        with self.reference.active() as reference_model, on_device(reference_model, self.device, offload), \
                self.optimization.autocast():
            return [self.logprob_pass(reference_model, rollout, rows, False).logps if rows.numel() else None
                    for rows in chunks]
