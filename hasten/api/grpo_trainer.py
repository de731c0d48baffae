"""GRPOTrainer: TRL 1.16's constructor and methods over hasten's one GRPO loop.

    from hasten import GRPOConfig, GRPOTrainer      # was: from trl import GRPOConfig, GRPOTrainer
    trainer = GRPOTrainer(model="tiny", reward_funcs=my_reward, args=GRPOConfig(output_dir="out"),
                          train_dataset=dataset)
    trainer.train()

Construction does what TRL's does, and everything that can fail on user
input fails here: the arguments are mapped onto a Config (grpo_config.py),
the model, tokenizer, reward functions and rows are built (inputs.py) and
handed to train/trainer.py's `prepare(task=, rewards=, policy=)`. `train()`
runs train/trainer.py's `train(session=...)` (the same loop, checkpoints,
resume and signals as `hasten train`) with the callbacks bridged in
(callbacks.py). The model is trained in place: `trainer.model` is the
trained policy afterwards, as in TRL.

Differences a TRL user meets (docs/trl.md has all of them): the run
directory is output_dir itself, as TRL's; an earlier run there is renamed
`<output_dir>.previous-N` first instead of being overwritten (the log says
so); `train()` a second time on the same trainer is an error; an
interrupted run (Ctrl-C) returns with metrics["status"] == "interrupted"
after saving a checkpoint instead of raising KeyboardInterrupt.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import Config, load_config
from .callbacks import CallbackBridge, TrainerState, instantiate
from .grpo_config import APIError, GRPOConfig
from .inputs import build_policy, build_rewards, build_task, model_name, named_eval_sets
from .runs import TrainOutput, check_same_config, run_records, say_where, tag_model

UNSUPPORTED_ARGUMENTS = ("quantization_config",)
LOGGER = logging.getLogger(__name__)  # TRL's construction warnings, which scripts and tests capture
TOKEN_SUMMED_LOSSES = ("bnpo", "dr_grpo", "dapo", "cispo")


class GRPOTrainer:
    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 reward_processing_classes: Any = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), peft_config: Any = None, tools: list[Callable] | None = None,
                 rollout_func: Callable | None = None, environment_factory: Any = None,
                 log: Callable[[str], None] = print, **others: Any):
        import torch

        from ..train.trainer import prepare

        for name, value in others.items():
            if name not in UNSUPPORTED_ARGUMENTS:
                raise APIError(f"GRPOTrainer: unexpected argument '{name}'")
            if value is not None:
                raise APIError(f"GRPOTrainer: {name} is not supported by hasten (docs/trl.md)")
        if optimizers != (None, None):
            raise APIError("GRPOTrainer: optimizers is not supported (hasten's AdamW and schedule come from args)")
        if args is None:
            args = GRPOConfig(f"{model_name(model).rstrip('/').split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise APIError(f"GRPOTrainer: args must be a hasten GRPOConfig (got {type(args).__name__})")
        self.args, self.log = args, log
        self.callbacks = instantiate(callbacks)
        if args.importance_sampling_level == "sequence" and args.loss_type in TOKEN_SUMMED_LOSSES:  # TRL's words
            LOGGER.warning(
                f"When using `importance_sampling_level='sequence'`, the `'{args.loss_type}'` loss sums per-token "
                "contributions, which effectively weights each sequence by its completion length instead of "
                "optimizing the per-sequence objective. To reproduce the GSPO paper's setup, set `loss_type='grpo'`.")
        if rollout_func is not None and (tools or environment_factory is not None):
            raise APIError("GRPOTrainer: rollout_func does its own generation; it does not combine with tools or "
                           "environment_factory")
        placeholder = None
        if train_dataset is None and environment_factory is not None:  # the environment makes the prompts
            if isinstance(environment_factory, dict):  # TRL's words: nothing would choose each row's environment
                raise APIError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` "
                               "with an `environment` column to route each example to its environment. Provide a "
                               "dataset, or pass a single environment factory.")
            if args.max_steps <= 0:
                raise APIError("GRPOTrainer: without a train_dataset (the environment's reset makes the prompts), "
                               "args.max_steps must be set")
            placeholder = [{"prompt": [{"role": "user", "content": ""}]}] * args.prompts_per_step()
        iterable = [type(data).__name__ == "IterableDataset" for data in
                    (train_dataset, *(eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]))]
        if any(iterable):  # TRL's check and setting (hasten reads a stream whole, in its own process)
            if args.accelerator_config.dispatch_batches:
                raise APIError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                               "`accelerator_config`. Please set it to `False`.")
            args.accelerator_config.dispatch_batches = False
        if iterable[0]:  # TRL forces 0 workers on a train stream (get_train_dataloader's loader)
            args.dataloader_num_workers = 0
        self.eval_dataset = eval_dataset
        # {None: rows} or {name: rows}; {} without one
        self.eval_sets = named_eval_sets(eval_dataset, fill_prompt=environment_factory is not None)
        task = build_task(train_dataset, self.eval_sets.get(None), placeholder,
                          fill_prompt=environment_factory is not None)
        rewards = build_rewards(reward_funcs, reward_processing_classes, args.chat_template_kwargs,
                                optional=environment_factory is not None)
        # TRL's words; the weights are reward_funcs' alone (an environment's get_reward joins after, weight 1)
        if args.reward_weights is not None and len(args.reward_weights) != len(rewards):
            raise APIError(f"Number of reward weights ({len(args.reward_weights)}) must match number of reward "
                           f"functions ({len(rewards)})")
        pairs = [("model.name", model_name(model)), ("task.name", "dataset"),
                 *args.overrides(len(task.train_rows), sum(map(len, self.eval_sets.values())))]
        self.config: Config = load_config(None, pairs, profile=args.profile)
        self.eval_every = self.config.eval.every if self.config.eval.num_examples else 0
        if self.eval_sets and None not in self.eval_sets:  # named sets: the trainer evaluates each (bridge)
            self.config.eval.num_examples, self.config.eval.at_start = 0, False
        random.seed(args.seed)
        torch.manual_seed(args.seed)  # LoRA's initialization, as TRL seeds before building the model
        policy = build_policy(model, self.config, processing_class, peft_config, log)
        check_model_options(policy.model, args)
        cfg = self.config
        self.state = TrainerState(max_steps=cfg.train.steps * cfg.algo.num_iterations,
                                  num_train_epochs=args.num_train_epochs, logging_steps=args.logging_steps,
                                  save_steps=args.save_steps, eval_steps=args.eval_steps,
                                  train_batch_size=args.per_device_train_batch_size)
        self.session = prepare(cfg, log, task=task, rewards=rewards, policy=policy, trainer_state=self.state,
                               tools=tools, environment=environment_factory)
        if rollout_func is not None:  # TRL's contract: the function generates, hasten learns (agent/custom.py)
            from ..agent.custom import RolloutFunction

            self.session.agent = RolloutFunction(rollout_func, self, policy.tokenizer, policy.pad_token_id,
                                                 policy.eos_token_ids)
        # every eval (the loop's, evaluate()'s, each named set's) adds TRL's sampled metrics and eval_loss to
        # the greedy ones, through the task's evaluate_more hook (train/evaluate.py; eval_loss.py)
        self.session.task.evaluate_more = self._sampled_eval
        tag_model(self.model, ["trl", "grpo", "hasten"])
        self.run_dir: Path | None = None
        self._trained = False  # train() began (a second call is an error)
        self._finished = False  # train() returned: the session's engine is closed

    @property
    def model(self):
        return self.session.policy.model

    @property
    def processing_class(self):
        return self.session.policy.tokenizer

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's: the model is a mixture of experts (its config has output_router_logits) and the coefficient
        (router_aux_loss_coef, else the model config's own) is not 0; the learner then adds coef x the router
        load-balancing loss and logs it as aux_loss."""
        from ..train.learner import router_aux_coef

        return router_aux_coef(getattr(self.model, "config", None), self.args.router_aux_loss_coef) != 0

    @property
    def reward_func_names(self) -> list[str]:
        """The reward functions' names, in reward_funcs order: the keys of the rewards/<name>/mean metrics."""
        return [function.name for function in self.session.rewards]

    @property
    def entropy_coef(self) -> float:
        """The entropy bonus coefficient now: args.entropy_coef before training, then the one the last step
        left (the adaptive control moves it once per optimizer step, use_adaptive_entropy), from the run's
        metrics.jsonl (log_history holds means over logging windows)."""
        records = run_records(self.run_dir) if self.run_dir is not None else []
        steps = [record["entropy_coef"] for record in records if "entropy_coef" in record]
        return steps[-1] if steps else self.args.entropy_coef

    def get_high_entropy_mask(self, entropies, mask, threshold: float):
        """(B, T) bool: the `mask` tokens whose entropy is at least the `threshold` quantile of the masked
        entropies, as TRL's (the learner applies it with threshold = 1 - top_entropy_quantile). One process:
        hasten's learner takes the quantile per micro-batch on each rank."""
        from ..algo.losses import entropy_quantile_mask

        return entropy_quantile_mask(entropies, mask, threshold)

    @staticmethod
    def get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """(B, 1): 1 keeps a sequence, 0 drops one whose advantage is negative and whose mean token KL from
        the sampler exceeds the threshold (DeepSeek-V3.2; TRL's off_policy_mask_threshold)."""
        from ..algo.losses import off_policy_mask

        return off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold)

    @property
    def ref_model(self):
        """The KL reference model (beta > 0; None otherwise, or with LoRA, whose reference is the base)."""
        from ..models import Reference

        cfg, session = self.config, self.session
        if cfg.algo.beta > 0 and session.reference is None:
            # made now, before any update, as TRL's
            session.reference = Reference(session.policy, cfg.speed.offload_reference)
        return None if session.reference is None else session.reference.frozen

    @property
    def tools(self) -> list:
        """TRL's: the tools= callables, then each environment's methods bound to its first instance (two names
        of one class: two instances, so both sets, as TRL lists them); [] without tools or environments."""
        agent = self.session.agent
        if agent is None or not hasattr(agent, "tools"):  # none, or a rollout_func's
            return []
        found = [tool.fn for tool in agent.tools.values()]
        for methods in (agent.environments.schemas.values() if agent.environments is not None else ()):
            found += [tool.fn for tool in methods.values() if tool.fn not in found]
        return found

    @property
    def environments(self) -> list:
        """TRL's: the last batch's environment instances, one per rollout ([] before the first batch)."""
        agent = self.session.agent
        return list(agent.environments.last) if getattr(agent, "environments", None) is not None else []

    @property
    def _env_tools(self) -> dict:
        """TRL's private per-environment tools ({name: tools= callables + that environment's methods}), which
        TRL's multiple-environments test reads."""
        agent = self.session.agent
        shared = [tool.fn for tool in agent.tools.values()]
        return {name: shared + [tool.fn for tool in methods.values()]
                for name, methods in agent.environments.schemas.items()}

    @property
    def _environment_pool(self) -> dict:
        """TRL's private instance pools ({name: instances made so far}), which the same test reads."""
        return self.session.agent.environments.pool

    @property
    def _logs(self) -> dict:
        """TRL's private sample log, which TRL's log_extra test reads: the last step's samples (with
        log_completions=True) as {"prompt", "completion", "rewards": {name: ...}, "extra": {log_extra column:
        ...}, "images": []} (hasten trains text models only)."""
        table, names = self.session.completions, self.reward_func_names
        columns = [key for key in (table[0] if table else {}) if key not in ("prompt", "completion", "reward", *names)]
        return {"prompt": [row["prompt"] for row in table], "completion": [row["completion"] for row in table],
                "rewards": {name: [row[name] for row in table] for name in names},
                "extra": {key: [row.get(key) for row in table] for key in columns}, "images": []}

    @property
    def reward_weights(self):
        """(number of reward functions,) float32 tensor, as TRL's: reward_weights (1 each when unset), then 1
        for each environment class's get_reward."""
        import torch

        return torch.tensor([function.weight for function in self.session.rewards], dtype=torch.float32)

    @property
    def reward_funcs(self) -> list:
        return [function.fn for function in self.session.rewards]

    @property
    def reward_processing_classes(self) -> list:
        """One per reward_funcs entry, as TRL's: a reward model's tokenizer (the one given, or its own), None
        for a function."""
        from ..rewards.reward_model import RewardModel

        return [function.fn.tokenizer if isinstance(function.fn, RewardModel) else None
                for function in self.session.rewards]

    def train(self, resume_from_checkpoint: str | bool | None = None, **unsupported: Any) -> TrainOutput:
        """Run to args' end. resume_from_checkpoint: True = the newest checkpoint in output_dir, or a
        checkpoint / run directory path; the run continues bit-identically (train/loop.py)."""
        from ..train.trainer import train

        if unsupported:
            raise APIError(f"GRPOTrainer.train: {', '.join(unsupported)} not supported")
        if self._trained:
            raise APIError("GRPOTrainer.train: this trainer already ran (its reward pool and engine are closed); "
                           "make a new GRPOTrainer, with resume_from_checkpoint to continue")
        self._trained = True
        resume = self._resume_path(resume_from_checkpoint)
        cfg = self.config
        named = bool(self.eval_sets) and None not in self.eval_sets
        bridge = CallbackBridge(self.callbacks, self.args, self.state, self.model, self.processing_class,
                                cfg.algo.num_iterations, len(self.session.task.train_rows) / cfg.train.prompts_per_step,
                                cfg.output.log_every, self._evaluate_sets if named else None, self.eval_every)
        if resume is None:
            say_where(cfg, self.log)
        summary = train(cfg, self.log, resume, session=self.session, callbacks=[bridge])
        self._finished = True
        self.run_dir = Path(summary["run_dir"])
        losses = [record["loss"] for record in run_records(self.run_dir) if isinstance(record.get("loss"), float)]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else float("nan"),
                           {**summary, **bridge.summary})

    def get_train_dataloader(self):
        """TRL's: one batch per generation step, its rows as the loop draws them, each prompt num_generations
        times (api/loaders.py); num_workers is args.dataloader_num_workers (0 for a stream, as TRL)."""
        from .loaders import train_dataloader

        return train_dataloader(self.config, self.session.task.train_rows, self.args.dataloader_num_workers)

    def get_eval_dataloader(self, eval_dataset: Any = None):
        """TRL's: the eval rows (eval_dataset, a named set's name, or the trainer's), each num_generations_eval
        times; one worker for a stream, for this loader only (args keep their value), as TRL."""
        from .loaders import eval_dataloader

        data = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else (
            eval_dataset if eval_dataset is not None else self.eval_dataset)
        if data is None:
            raise APIError("Trainer: evaluation requires an eval_dataset.")
        rows = named_eval_sets(data)[None]
        workers = 0 if type(data).__name__ == "IterableDataset" else self.args.dataloader_num_workers
        group = self.args.num_generations_eval or self.config.generation.num_generations
        return eval_dataloader(rows, group, self.args.per_device_eval_batch_size, workers)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """transformers' evaluate(), as TRL's GRPOTrainer: on eval_dataset (default: the trainer's),
        num_generations sampled completions per prompt, their rewards and the GRPO loss without an update
        (eval_loss.py), metrics under TRL's names with `metric_key_prefix` ("eval_loss", "eval_reward",
        "eval_rewards/<f>/mean", ...; "eval_<name>_..." per named set), plus hasten's greedy accuracy and
        answer rate where the task judges answers; logged to log_history and on_evaluate like TRL's."""
        sets = named_eval_sets(eval_dataset) if eval_dataset is not None else self.eval_sets
        if not sets:
            raise APIError("GRPOTrainer.evaluate: there is no eval_dataset (pass one here or to GRPOTrainer)")
        metrics = self._evaluate_sets(sets, metric_key_prefix)
        metrics = {key: value for key, value in metrics.items() if key not in (ignore_keys or [])}
        bridge = CallbackBridge(self.callbacks, self.args, self.state, self.model, self.processing_class, 1, 1, 1)
        bridge.log_eval(metrics)
        return metrics

    def _evaluate_sets(self, sets: dict | None = None, prefix: str = "eval") -> dict[str, float]:
        import dataclasses

        from ..train.evaluate import evaluate
        from ..rollout.factory import make_engine
        from .callbacks import trl_record

        session, cfg = self.session, self.config
        engine = make_engine(cfg, session.policy, lambda line: None) if self._finished else session.engine
        metrics: dict[str, float] = {}
        for name, rows in (sets if sets is not None else self.eval_sets).items():
            label = prefix if name is None else f"{prefix}_{name}"
            task = dataclasses.replace(session.task, eval_rows=rows)
            started = time.perf_counter()
            found, _ = evaluate(task, engine, session.policy.tokenizer, session.rewards, len(rows),
                                cfg.eval.max_new_tokens, self.args.per_device_eval_batch_size,
                                cfg.generation.chat_template_kwargs, session.reward_logs.kwargs(),
                                cfg.generation.stop_strings)
            runtime = time.perf_counter() - started
            found.update({"seconds": runtime, "samples_per_second": len(rows) / max(runtime, 1e-9)})
            metrics.update({f"{label}_{key}": value for key, value in trl_record(found).items()})
        return metrics

    def _sampled_eval(self, engine, tokenizer, rows: list[dict], samples: list, max_new_tokens: int,
                      batch_size: int) -> dict[str, float]:
        """The task's evaluate_more: TRL's eval on `rows` (eval_loss.py), whose reward metrics replace the
        greedy ones. Seeded by the global step, apart from training's seeds (collect in train/trainer.py:
        seed x 1_000_003 + step, plus 1_000_000_007 per dynamic-sampling round): an eval neither repeats nor
        shifts a training draw, and a resumed run's evals draw what the uninterrupted run's did."""
        from ..models import Reference
        from .eval_loss import sampled_eval

        cfg, session = self.config, self.session
        group = self.args.num_generations_eval or cfg.generation.num_generations
        if cfg.algo.beta > 0 and session.reference is None:  # made before any update, the one training uses
            # (with LoRA: the adapter-disabled policy)
            session.reference = Reference(session.policy, cfg.speed.offload_reference)
        seed = cfg.train.seed * 1_000_003 + 2**40 + self.state.global_step * 1_000_003
        return sampled_eval(session, engine, rows, batch_size, group, seed, session.reference)

    def _resume_path(self, resume: str | bool | None) -> Path | None:
        from ..train.loop import find_checkpoint

        if not resume:
            return None
        cfg = self.config
        path = Path(cfg.output.dir) / cfg.output.name if resume is True else Path(resume)
        run_dir, checkpoint = find_checkpoint(path, total_steps=cfg.train.steps)
        check_same_config(cfg, run_dir.path / "config.yaml")
        return checkpoint

    def save_model(self, output_dir: str | None = None) -> Path:
        """The model (adapters only with LoRA) and tokenizer in HF format; default: args.output_dir, as TRL
        (so a script that loads output_dir afterwards gets this model even when the run itself went to
        `<output_dir>-2` because output_dir held an earlier run).

        Under torchrun every rank calls it (as with TRL) and rank 0 writes; FSDP's shards are gathered first.
        """
        from ..train import distributed, fsdp
        from ..train.outputs import save_model_files

        target = Path(output_dir) if output_dir else Path(self.config.output.dir) / self.config.output.name
        state = fsdp.full_model_state(self.model) if fsdp.is_sharded(self.model) else None  # every rank: a gather
        if distributed.is_main():
            target.mkdir(parents=True, exist_ok=True)
            save_model_files(self.model, self.processing_class, target, state)
        return target


def check_model_options(model, args: GRPOConfig) -> None:
    """TRL's construction errors that depend on the loaded model, with TRL's words (ValueError subclasses)."""
    from ..train.learner import is_mixture_of_experts

    if args.use_liger_kernel:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if hasattr(model, "peft_config") and hasattr(head, "base_layer"):  # a PEFT adapter wraps lm_head
            raise APIError("Applying a PEFT adapter to `lm_head` is not supported: the log-probabilities are "
                           "computed from `lm_head.weight` directly, so the adapter would never be trained. Remove "
                           "`'lm_head'` from your `target_modules`.")  # TRL's words; its test matches them
        raise APIError("GRPOTrainer: use_liger_kernel=True is not supported by hasten (its learner computes "
                       "log-probabilities in chunks itself: speed.logit_chunk_tokens)")

    coef = args.router_aux_loss_coef
    if coef and not is_mixture_of_experts(getattr(model, "config", None)):
        raise APIError(f"`router_aux_loss_coef` is set to {coef} but {type(model).__name__} is not a "
                       "Mixture-of-Experts model that returns its router logits, so there is no auxiliary loss to "
                       "weight.")

