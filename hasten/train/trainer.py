"""The GRPO loop: generate, score, compare within groups, update. Run it with
`hasten train --config run.yaml` (see cli.py).

One step takes prompts_per_step prompts, samples num_generations completions
for each (the engine shares each prompt's prefill across its group), scores
them with the reward functions, turns scores into group-relative advantages,
and hands the batch to the learner for num_iterations optimizer steps. The
engine works on the policy's own weights, so "handing the new weights to the
engine" costs nothing here; a vLLM engine will need an explicit sync.

`GRPOJob` is that step as train/loop.py's Job: the loop around it (evals,
full-state checkpoints, resume, signals, summary) is shared with the game
policy and SFT. Everything that can fail on user input (config, task data,
reward files, model name) is resolved before the run directory is created,
so a bad invocation leaves nothing behind.

Under torchrun (train/distributed.py) each rank runs this same step on its
share of whole groups; the hooks are marked where they act.

The Python API (hasten/api/, TRL's GRPOTrainer surface) runs this same code:
it builds the Task, reward functions and Policy in memory and hands them to
`prepare(task=, rewards=, policy=)` / `train(...)` instead of names, plus
its callbacks (TRL's TrainerCallback hooks) for the loop.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..agent import make_agent
from ..algo import group_advantages, zero_variance_fraction
from ..algo.advantages import nanstd, normalized_sum_advantages
from ..config import Config, ConfigError
from ..device import configure_device, peak_memory_mib, resolve_device
from ..models import Policy, Reference, load_policy, load_trained_weights
from ..models import check_name as check_model_name
from ..rewards import RewardFunction, load_reward
from ..rewards.reward_model import place_reward_models
from ..rewards.batch import ScoredBatch, reward_inputs
from ..rewards.runner import RewardScores
from ..rollout import Engine, RowRange, SamplingParams
from ..rollout.factory import check_engine_installed, make_engine, use_native_model
from ..rollout.stops import apply_stop_strings
from ..rollout.model_generate import custom_generate, sampling_engine
from ..sandbox.pool import close_shared, shared_stats
from ..kernels.allocator import check_in_process as check_allocator
from ..kernels.compile import compile_model
from ..kernels.frozen_base import hold_in_bf16
from ..algo.dynamic_sampling import refill
from ..kernels.threads import ThreadGovernor
from ..tasks import Task, make_task
from .. import ticker
from ..ticker import Ticker
from . import distributed, fsdp, loop
from .evaluate import evaluate
from .feeder import Feeder, make_feeder
from .learner import Learner
from .plan import Plan
from .outputs import RunDir, save_model_files
from .packing import backbone_and_head
from .preflight import check_output_dir
from ..kernels.runtime import configure_threads, keep_freed_memory
from ..rewards.scoring import RewardLogs, RewardScorer, RewardState
from .tracking import check_trackers, make_trackers


@dataclass
class Session:
    """Everything a run needs, resolved and checked before anything is written."""

    cfg: Config
    task: Task
    rewards: list[RewardFunction]
    policy: Policy
    engine: Engine  # KVCacheEngine or LeanEngine (speed.engine)
    scorer: RewardScorer | None = None  # reward pool, cache and gate (speed.*); owns the pool threads
    reward_logs: RewardLogs | None = None  # trainer_state / log_metric / log_extra for reward functions
    completions: list[dict[str, Any]] = field(default_factory=list)  # the last step's samples (output.log_completions)
    threads: ThreadGovernor | None = None  # speed.adaptive_threads (set by prepare)
    plan: Plan | None = None  # every choice resolved once (train/plan.py); set by prepare
    agent: Any = None  # agent.Agent: tools / environments, the multi-turn loop (None: single-turn)
    reference: Reference | None = None  # the KL reference when algo.beta > 0 (made before any update)


def build_rewards(cfg: Config, task: Task, given: list[RewardFunction] | None = None,
                  owned: list[RewardFunction] | None = None) -> list[RewardFunction]:
    """The task's rewards (rewards.task_rewards), rewards.extra's files, `given` (the Python API's), then
    `owned`: the environments' get_reward functions, weight 1 each. rewards.weights covers all but those (TRL:
    reward_weights are the reward_funcs'; an environment-owned reward is appended after them, weight 1)."""
    functions = list(task.reward_functions) if cfg.rewards.task_rewards else []
    functions += [load_reward(spec) for spec in cfg.rewards.extra]
    functions += list(given or [])
    if not functions and not owned:
        raise ConfigError(
            f"config error: no reward functions (task '{task.name}' has none built in; add --reward file.py:function)"
        )
    if cfg.rewards.weights is not None:
        if len(cfg.rewards.weights) != len(functions):
            names = ", ".join(f.name for f in functions)
            raise ConfigError(
                f"config error: rewards.weights has {len(cfg.rewards.weights)} values for "
                f"{len(functions)} reward functions ({names})"
            )
        functions = [dataclasses.replace(f, weight=w) for f, w in zip(functions, cfg.rewards.weights)]
    return functions + list(owned or [])


def callable_name(obj: Any) -> str:
    """'module:qualified.name' of a function or class (what a tools= / environment_factory= entry is); a
    dict of environment factories (TRL's per-row `environment` column) as '{name: module:Class, ...}'."""
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{key}: {callable_name(value)}" for key, value in obj.items()) + "}"
    target = getattr(obj, "func", obj)  # functools.partial: the function it wraps
    if not hasattr(target, "__qualname__"):  # a callable instance: its class
        target = type(target)
    return f"{getattr(target, '__module__', '?')}:{target.__qualname__}"


def prepare(cfg: Config, log: Callable[[str], None] = print, task: Task | None = None,
            rewards: list[RewardFunction] | None = None, policy: Policy | None = None,
            trainer_state: Any = None, tools: list | None = None, environment: Any = None,
            evaluating: bool = False) -> Session:
    """Everything a run needs. task / rewards / policy: built by the caller (the Python API) instead of
    from cfg's names; rewards are added after the task's and rewards.extra's. trainer_state: what reward
    functions receive as `trainer_state` (default: a RewardState the step keeps current). tools /
    environment: the API's tools= and environment_factory= (agent/, added to the task's and the config's).
    evaluating: `hasten eval`'s session, which never learns: its plan line leaves the learning pass out."""
    device = resolve_device(cfg.model.device)  # a GPU asked for and missing: a config error, before any work
    ticker.configure(cfg.output.progress if distributed.is_main() else "off")  # every phase's live progress (ticker.py)
    configure_device(device)
    check_trackers(cfg)
    configure_threads(cfg.train.num_threads)
    check_allocator(cfg.speed.allocator, log)  # asked for another than this process runs on: one line says so
    if cfg.speed.keep_freed_memory:
        keep_freed_memory()
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    task = task if task is not None else make_task(cfg.task, cfg)
    parts = make_agent(cfg, task, tools, environment)  # tools and environments checked before the model loads
    # config.yaml records what the run uses: the API's callables by name (they cannot be reloaded from it)
    cfg.generation.api_tools = [callable_name(tool) for tool in tools or []]
    cfg.task.api_environment = callable_name(environment) if environment is not None else None
    rewards = build_rewards(cfg, task, rewards, parts.reward_functions if parts else None)
    loaded = policy is None  # the API's own model stays as it was given (Plan.resolve)
    if policy is None:
        check_model_name(cfg.model.name)  # an unknown name or a broken directory: one line, not after "loading"
        check_engine_installed(cfg)  # speed.engine=vllm without vLLM: likewise
        log(f"loading model {cfg.model.name} ...")  # the first line of a run: the load (and a first conversion) take seconds
        with Ticker(f"loading model {cfg.model.name}", unit="s") as tick:  # elapsed; a first conversion counts tensors
            policy = load_policy(cfg.model, tick.wrap(log), native=use_native_model(cfg, log))
    agent = parts.build(policy.tokenizer, policy.pad_token_id, log) if parts is not None else None
    policy.model.to(device)  # before the engine and the optimizer: both keep references to its tensors
    place_reward_models(rewards, device)  # reward models score where the policy runs
    distributed.init(device)  # torchrun: join the process group (nothing without it)
    distributed.broadcast_parameters(policy.model)  # equal by seed already; rank 0's by construction
    if cfg.speed.compile:
        compile_model(policy.model, cfg.speed.compile_mode, log)
    state = trainer_state if trainer_state is not None else RewardState(max_steps=cfg.train.steps * cfg.algo.num_iterations)
    # speed.adaptive_threads: only where the thread count is torch's own choice, in one process.
    governor = ThreadGovernor(cfg.speed.adaptive_threads and cfg.train.num_threads == 0
                              and distributed.world_size() == 1 and device.type == "cpu")
    engine = make_engine(cfg, policy, log)
    plan = Plan.resolve(cfg, policy, engine, governor.enabled, loaded=loaded and not evaluating)
    if plan.bf16_base:
        # before the first sample, which merges from it; the head stays fp32 (kernels/frozen_base.py)
        hold_in_bf16(policy.model, leave=backbone_and_head(policy.model)[1])
    log(plan.describe_eval() if evaluating else plan.describe())
    return Session(cfg, task, rewards, policy, engine, RewardScorer(rewards, cfg.speed, cfg.algo), RewardLogs(state),
                   threads=governor, plan=plan, agent=agent)


def generate_and_score(session: Session, engine: Engine, feeder: Feeder, count: int, seed: int) -> ScoredBatch:
    """Take `count` prompts, sample a group for each with `engine`, score them (slow rewards joined here)."""
    tokenizer, generation = session.policy.tokenizer, session.cfg.generation
    sampling = SamplingParams(generation.max_new_tokens, generation.temperature, generation.top_p, generation.top_k,
                              generation.min_p, generation.repetition_penalty)
    rows, prompts = feeder.take(count)  # the global batch's prompts: every rank draws the same stream
    mine = distributed.group_slice(count)  # this rank's whole groups (all of them in one process)
    rows, prompts = rows[mine], prompts[mine]
    group = generation.num_generations
    started = time.perf_counter()
    draws = RowRange(mine.start * group, count * group)  # the global batch's draws
    agent_metrics: dict[str, float] = {}
    if session.agent is not None:  # tools / environments: the multi-turn loop (agent/loop.py)
        agentic = session.agent.generate(engine, rows, group, sampling, seed, draws)
        rollout, inputs, agent_metrics = agentic.rollout, agentic.inputs, agentic.metrics
        generated = time.perf_counter()
    else:
        rollout = engine.generate(prompts, group, sampling, seed=seed, rows=draws)
        rollout = apply_stop_strings(rollout, tokenizer, generation.stop_strings, session.policy.pad_token_id)
        generated = time.perf_counter()
        inputs = reward_inputs(tokenizer, rows, rollout)
    pending = session.scorer.start(inputs.prompts, inputs.completions, inputs.columns, inputs.completion_ids,
                                   session.reward_logs.kwargs())
    scores = pending.join()  # slow rewards ran in the pool while the fast ones ran here
    group_means = torch.nan_to_num(torch.nanmean(scores.scored_total.view(len(rows), -1), dim=1))  # (B,)
    feeder.observe(rows, group_means.tolist())  # curriculum success rates
    metrics = {**pending.metrics, **rollout.stats, **agent_metrics,  # stats: the engine's own counters (spec/*)
               "time/generate": generated - started, "time/reward": time.perf_counter() - generated}
    return ScoredBatch(rows, rollout, inputs, scores, metrics)


@dataclass
class Collected:
    """A step's generation half: every round drawn, the batch to learn from, DAPO's metrics."""

    rounds: list[ScoredBatch]  # the first is the policy's plain sample; more are dynamic sampling's refills
    batch: ScoredBatch | None  # None: every group was flat
    dynamic: dict[str, float]


def collect(session: Session, engine: Engine, feeder: Feeder, step: int) -> Collected:
    """Generate and score step `step`'s batch (refilled by dynamic sampling when on)."""
    cfg = session.cfg
    seed = cfg.train.seed * 1_000_003 + step
    state = session.reward_logs.state  # what reward functions see as trainer_state
    state.global_step = (step - 1) * cfg.algo.num_iterations
    rounds: list[ScoredBatch] = [generate_and_score(session, engine, feeder, cfg.train.prompts_per_step, seed)]
    batch: ScoredBatch | None = rounds[0]
    dynamic: dict[str, float] = {}
    if cfg.algo.dynamic_sampling:  # DAPO: drop flat groups, refill from the same stream (a capped loop)
        def draw(count: int, round_index: int) -> ScoredBatch:
            rounds.append(generate_and_score(session, engine, feeder, count, seed + 1_000_000_007 * round_index))
            return rounds[-1]

        batch, dynamic = refill(rounds[0], draw, cfg.algo.dynamic_sampling_max_rounds, session.policy.pad_token_id)
    return Collected(rounds, batch, dynamic)


def grpo_step(session: Session, learner: Learner, feeder: Feeder, step: int,
              collected: Collected | None = None) -> dict[str, float]:
    """One GRPO step; returns its metrics record.

    collected: the step's batch when it was generated elsewhere (algo.async_steps: in the
    background, from older weights; the learner's Correction takes its ratios against the sampling log-probs).
    """
    cfg = session.cfg
    group = cfg.generation.num_generations
    started = time.perf_counter()
    threads = session.threads or ThreadGovernor(False)
    phase_threads = {}
    generated_here = collected is None
    if generated_here:
        phase_threads["threads/generate"] = threads.adjust()
        policy = session.policy  # a generate the user replaced after prepare samples from now on (TRL's tests)
        engine = sampling_engine(session.engine, policy.model, policy.pad_token_id, policy.eos_token_ids)
        with fsdp.full_weights(policy.model, session.engine):  # FSDP: gathered for sampling; else nothing
            collected = collect(session, engine, feeder, step)
    rounds, batch = collected.rounds, collected.batch
    scored = time.perf_counter()

    learned_metrics: dict[str, Any] = {"skipped_update": 1.0}  # every group was flat: nothing to learn from
    if batch is not None:
        totals = distributed.gather_rows(batch.scores.scored_total)  # (B*G,) the global batch's, in rank order
        mine = distributed.group_slice(len(totals) // group)
        if cfg.rewards.aggregation == "normalize_then_sum":  # per function, then summed (TRL's option)
            weights = torch.tensor([function.weight for function in session.rewards], dtype=torch.float32)
            per_function = distributed.gather_rows(batch.scores.per_function)  # (B*G, F)
            advantages = normalized_sum_advantages(per_function, weights, group)
        else:
            advantages = group_advantages(totals, group, cfg.algo.scale_rewards)  # (B*G,), 0 where unscored
        advantages = advantages[mine.start * group:mine.stop * group]
        # (B*G, T) or None: tool results (multi-turn) and, with algo.mask_truncated_completions, completions
        # cut at max_new_tokens get no loss (TRL's tool_mask and option)
        loss_mask = batch.rollout.loss_mask(cfg.algo.mask_truncated_completions)
        phase_threads["threads/learn"] = threads.adjust()
        if generated_here:  # under algo.async_steps the engine samples the next batch while this one learns
            session.engine.release_weights()  # a lean engine's own copy, rebuilt at the next generate
        learned_metrics = learner.step(batch.rollout, advantages, loss_mask)
        session.engine.weights_changed()  # engines that cache weights (lean.py) re-read them
    finished = time.perf_counter()

    # Reward and length statistics describe the first round: the policy's plain sample, as without refills;
    # under torchrun, of the global batch (gathered from every rank). Times are this rank's.
    first = rounds[0]
    scores = RewardScores(distributed.gather_rows(first.scores.per_function),
                          distributed.gather_rows(first.scores.total), first.scores.names)
    lengths = distributed.gather_rows(first.rollout.model_lengths).float()  # model-written tokens (TRL)
    ended = distributed.gather_rows(first.rollout.ended_with_eos)
    tokens = distributed.sum_over_ranks(
        sum(int(r.rollout.prompt_mask.sum()) + int(r.rollout.completion_mask.sum()) for r in rounds))
    logged, columns = session.reward_logs.drain()  # what reward functions sent through log_metric / log_extra
    if cfg.output.log_completions:
        session.completions = completion_table(first, columns)
    total = scores.scored_total  # (B*G,) NaN where no reward function applied
    record = {
        "step": step,
        "reward_mean": float(torch.nanmean(total)),
        "reward_std": float(nanstd(total)),
        **{f"rewards/{name}": value for name, value in scores.means().items()},
        **{f"rewards/{name}/std": value for name, value in scores.stds().items()},
        "zero_variance_groups": zero_variance_fraction(total, group),
        "unscored_fraction": float((~scores.scorable).float().mean()),
        "completion_length": float(lengths.mean()),
        "completion_length_max": float(lengths.max()),
        "eos_fraction": float(ended.float().mean()),
        **rounds[-1].metrics,
        **collected.dynamic,
        **learned_metrics,
        **logged,
        "time/generate": sum(r.metrics["time/generate"] for r in rounds),
        "time/reward": sum(r.metrics["time/reward"] for r in rounds),
        "time/learn": finished - scored,
        "time/step": finished - started,
        "tokens_per_second": tokens / (finished - started),
        # The process's peak RSS on a CPU (peak allocated memory on a GPU) so far: a run whose memory
        # keeps growing shows it here, step by step, before the machine runs out (docs/results/speedups-notes.md).
        "memory/peak_mib": peak_memory_mib(next(session.policy.model.parameters()).device),
        **(phase_threads if threads.enabled else {}),  # speed.adaptive_threads' choice per phase
    }
    return record


def completion_table(batch: ScoredBatch, columns: dict[str, list]) -> list[dict[str, Any]]:
    """One row per sample of a round: prompt, completion, rewards, and log_extra's columns."""
    scores = batch.scores
    table = []
    for index, (prompt, text) in enumerate(zip(batch.inputs.prompts, batch.inputs.texts)):
        row = {"prompt": prompt, "completion": text, "reward": float(scores.total[index])}
        row.update({name: float(scores.per_function[index, column]) for column, name in enumerate(scores.names)})
        row.update({name: values[index] for name, values in columns.items() if index < len(values)})
        table.append(row)
    return table


class GRPOJob:
    """GRPO steps as the loop's Job; state = the learner's optimization + the prompt feed's position."""

    def __init__(self, session: Session, log: Callable[[str], None]):
        cfg = self.cfg = session.cfg
        self.session, self.log = session, log
        self.announced = False  # the first step of this process says what it is doing (nothing is drawn yet)
        if session.reference is None and cfg.algo.beta > 0:
            # a full copy, before any sharding; offloaded: made on the CPU, never a second copy on the GPU
            session.reference = Reference(session.policy, cfg.speed.offload_reference)
        reference = session.reference
        if fsdp.wanted(cfg):  # train.distributed=fsdp under torchrun: before the optimizer takes the parameters
            fsdp.shard(session.policy.model)
        self.full_state: dict | None = None  # FSDP: the weights state_dict() gathered for save_model
        self.learner = Learner.from_config(session.policy, cfg, reference, log,
                                           plan=session.plan.learning if session.plan else None)
        self.feeder = make_feeder(cfg, session.task.train_rows, session.policy.tokenizer)
        self.total_steps, self.eval_at_start, self.eval_every = cfg.train.steps, cfg.eval.at_start, cfg.eval.every
        self.resume_command = "hasten train --resume"
        self.pipeline = None  # algo.async_steps=1: the next batch is generated while this one learns
        if cfg.algo.async_steps:
            from .async_pipeline import AsyncRollouts

            self.pipeline = AsyncRollouts(session.policy, lambda policy: make_engine(cfg, policy, log),
                                          lambda engine, step: collect(session, engine, self.feeder, step),
                                          session.task.train_rows)

    def step(self, step: int) -> dict[str, Any]:
        if not self.announced:
            self.announced = True
            generation = self.cfg.generation
            steps = f"{self.total_steps} step{'' if self.total_steps == 1 else 's'}"
            custom = custom_generate(self.session.policy.model)  # replaced since the plan line: say so here
            planned = getattr(self.session.plan, "engine", None) == "model.generate"
            through = f" through model.generate ({custom})" if custom and not planned else ""
            self.log(f"training {steps}; step {step}: sampling {self.cfg.train.prompts_per_step} prompts x "
                     f"{generation.num_generations} completions{through}, scoring, learning ...")
        before = shared_stats()
        record = self._step(step)
        every = self.cfg.algo.ref_model_sync_steps
        if every and self.session.reference is not None and step * self.cfg.algo.num_iterations % every == 0:
            self.session.reference.mix_in(self.session.policy.model, self.cfg.algo.ref_model_mixup_alpha)
        after = shared_stats()  # code tasks: this step's sandbox runs (malformed reports scored 0, counted here)
        work = {f"sandbox/{name}": value - before.get(name, 0) for name, value in after.items()}
        return {**record, **work} if any(work.values()) else record  # a sandbox left idle by another run: silent

    def _step(self, step: int) -> dict[str, Any]:
        if self.pipeline is None:
            return grpo_step(self.session, self.learner, self.feeder, step)
        waited = time.perf_counter()
        collected = self.pipeline.take(step)  # sampled before the last update (step 1: from these weights)
        waited = time.perf_counter() - waited
        if step < self.total_steps:
            self.pipeline.start(step + 1)  # from the weights as they are now, while this step learns
        record = grpo_step(self.session, self.learner, self.feeder, step, collected)
        return {**record, "async/staleness": float(step > 1), "time/wait_for_batch": waited}

    def evaluate(self, step: int, run: RunDir) -> dict[str, Any] | None:
        cfg, session = self.cfg, self.session
        if not cfg.eval.num_examples:
            return None
        with fsdp.full_weights(session.policy.model, session.engine):  # FSDP: every rank gathers, rank 0 evaluates
            if not distributed.is_main():  # torchrun: rank 0 evaluates, the rest go on
                return None
            return self._evaluate(step, run)

    def _evaluate(self, step: int, run: RunDir) -> dict[str, Any]:
        cfg, session = self.cfg, self.session
        started = time.perf_counter()
        count = min(cfg.eval.num_examples, len(session.task.eval_rows))
        if step == 0:  # before training, nothing else is on screen yet: say what the wait is for
            self.log(f"evaluating {count} held-out question{'' if count == 1 else 's'} (greedy, up to "
                     f"{cfg.eval.max_new_tokens} new tokens) ...")
        metrics, samples = evaluate(  # its count moves after every eval.batch_size questions (ticker.py)
            session.task, session.engine, session.policy.tokenizer, session.rewards,
            count, cfg.eval.max_new_tokens, cfg.eval.batch_size,
            cfg.generation.chat_template_kwargs, session.reward_logs.kwargs(), cfg.generation.stop_strings,
            agent=session.agent, description=f"evaluating at step {step}",
        )
        metrics.update(session.reward_logs.drain()[0])  # what reward functions logged during the eval
        metrics["seconds"] = time.perf_counter() - started
        run.save_samples(f"eval-step{step}", samples)
        return metrics

    def save_model(self, directory) -> None:
        save_model_files(self.session.policy.model, self.session.policy.tokenizer, directory, self.full_state)
        self.full_state = None

    def state_dict(self) -> dict[str, Any]:
        """Every rank calls it before rank 0 saves (loop.save): under FSDP the gathers happen here."""
        if fsdp.is_sharded(self.session.policy.model):
            self.full_state = fsdp.full_model_state(self.session.policy.model)  # for save_model, on rank 0
        state = {"optimization": self.learner.optimization.state_dict()}
        engine_state = self.session.engine.state_dict()  # the int8 sampler's statistics (rollout/lean.py)
        if engine_state:
            state["engine"] = engine_state
        if self.cfg.algo.adaptive_entropy:  # the adaptive coefficient and its last entropy (algo/entropy.py)
            state["entropy_control"] = self.learner.entropy_control.state_dict()
        if self.pipeline is not None:  # first: the batch in flight draws from the feeder
            state["pipeline"] = self.pipeline.state_dict(self.session.policy.tokenizer)
        return {**state, "feeder": self.feeder.state_dict()}

    def load_state_dict(self, state: dict[str, Any], directory) -> None:
        sharded = fsdp.is_sharded(self.session.policy.model)
        load_trained_weights(self.session.policy.model, directory, fsdp.load_full_weights if sharded else None)
        self.session.engine.weights_changed()
        self.session.engine.load_state_dict(state.get("engine", {}))
        self.learner.optimization.load_state_dict(state["optimization"])
        plan = self.session.plan
        if plan is not None and plan.bf16_base and not self.learner.optimization.precision.mixed:
            raise ConfigError("resume error: the NaN guard switched this run to fp32 learning "
                              "(speed.nan_guard_action=disable_mixed_precision), which reads the LoRA base in "
                              "fp32; set that action again in the run's config.yaml to continue it")
        if "entropy_control" in state:
            self.learner.entropy_control.load_state_dict(state["entropy_control"])
        self.feeder.load_state_dict(state["feeder"])
        if self.pipeline is not None:
            self.pipeline.load_state_dict(state.get("pipeline", {}), self.session.policy.tokenizer, Collected)

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        try:
            if self.pipeline is not None:
                self.pipeline.close()  # before the feeder and the scorer it draws on
            self.feeder.close()
        finally:
            try:
                self.session.scorer.close()
            finally:
                close_shared()  # the code task's sandbox workers
                if self.session.agent is not None:
                    self.session.agent.close()
                if self.session.threads is not None:
                    self.session.threads.restore()  # speed.adaptive_threads may have lowered them


def train(cfg: Config, log: Callable[[str], None] = print, resume: Path | None = None, *,
          task: Task | None = None, rewards: list[RewardFunction] | None = None, policy: Policy | None = None,
          trainer_state: Any = None, callbacks: list | None = None, session: Session | None = None) -> dict:
    """Train with GRPO (a game task: its policy loop); `resume`: a checkpoint of this run (see loop.resolve).

    task, rewards, policy, trainer_state: see prepare; session: one prepare() already made (the API
    prepares at construction, as TRL does). callbacks: loop hooks (loop.run), after the trackers.
    """
    from ..games import GAMES

    if resume is None:
        check_output_dir(cfg)  # an unwritable output.dir, a name too long: now, not after the model loads
    else:
        loop.check_resume(resume)  # a run one may not write (another user's): likewise
    if cfg.task.name in GAMES:  # a tensor policy, not a language model: the small loop in policy_loop.py
        from .policy_loop import train_policy

        if distributed.world_size_from_env() > 1 or cfg.model.device.startswith("cuda"):
            raise ConfigError(f"config error: {cfg.task.name} trains a small policy in one CPU process "
                              "(no torchrun, model.device auto or cpu)")
        return train_policy(cfg, log, resume)
    distributed.check_config(cfg)  # what does not split over torchrun's ranks: before any work
    log = distributed.main_only(log)  # torchrun: rank 0 speaks for the run
    if session is None:
        session = prepare(cfg, log, task, rewards, policy, trainer_state)  # raises on bad input before any write
    try:
        job = GRPOJob(session, log)
    except BaseException:
        session.scorer.close()
        raise
    run, checkpoint = loop.open_run(cfg, resume)
    if resume is not None and session.threads is not None and session.threads.enabled:
        log("resuming with speed.adaptive_threads: bit-identical to the uninterrupted run where both chose the "
            "same threads per phase (metrics.jsonl threads/*); set train.num_threads to pin them")
    trackers = make_trackers(cfg, run, lambda: session.completions) if distributed.is_main() else []  # rank 0 logs
    hooks = trackers + list(callbacks or [])
    return loop.run(job, cfg, run, log, checkpoint, created=resume is None, callbacks=hooks)
