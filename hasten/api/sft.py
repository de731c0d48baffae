"""SFTConfig / SFTTrainer: TRL 1.16's SFT surface over the SFT core `hasten sft` runs (rft/: SFTJob,
examples, eval loss) and the shared loop; this module maps TRL's arguments onto it.

Datasets, as TRL reads them:
  prompt + completion  loss on the completion only (TRL's completion_only_loss default); a
                       conversational prompt goes through the chat template with the generation
                       prompt, a conversational completion contributes its message contents
  text                 language modelling: loss on every token after the first
  messages             the chat template of the whole conversation, as text (TRL's default
                       assistant_only_loss=False: loss on every token)
Every completion and text ends with EOS, as TRL appends it. Examples longer
than max_length keep their start (TRL's truncation_mode="keep_start"); one
left with no target token is dropped, with a log line.

Mapping (docs/trl.md): per_device_train_batch_size x gradient_accumulation_steps
examples per optimizer step (sft.batch_size), split into
gradient_accumulation_steps micro-batches; each step's loss is the token
mean over the whole step, as TRL's (num_items_in_batch). num_train_epochs
must be whole; max_steps > 0 replaces it (epochs repeat until that many
steps, as TRL's), and an IterableDataset needs it (its first max_steps x batch
rows are read, then repeat as epochs). packing=None
keeps hasten's packed rows (a block mask: every example sees only itself,
so the loss is the unpacked one); False runs the padded batch. TRL's
preparation options (packing_strategy, eval_packing, skip_prepare_dataset)
are sft_rows.py's; chat_template_path and peft prompt learning are applied
where the model is built (inputs.py); the router aux coefficient follows the
model's config as TRL's (None = the config's own).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config, load_config, set_key, validate
from .callbacks import CallbackBridge, TrainerState, instantiate
from .grpo_config import APIError, TrainingConfig, TrainingFields
from .runs import TrainOutput, check_same_config, run_records, say_where, tag_model
from .inputs import build_policy, is_prompt_learning, model_name
from .sft_rows import prepare


@dataclass
class _SFTFields(TrainingFields):
    learning_rate: float = 2e-5
    max_length: int | None = 1024
    packing: bool | None = None  # None: hasten's exact packing (block mask); False: padded batches
    completion_only_loss: bool | None = None  # None / True: prompt-completion rows train on the completion
    dataset_text_field: str = "text"
    eval_strategy: str = "no"  # no | steps | epoch: the eval loss on eval_dataset (token mean over its targets)
    eval_steps: float | None = None
    per_device_eval_batch_size: int = 8
    router_aux_loss_coef: float | None = None  # None: the model config's own (absent: no aux loss), as TRL
    chat_template_path: str | None = None  # a .jinja/.j2 file, or a tokenizer directory whose template is cloned
    dataset_kwargs: dict | None = None  # {"skip_prepare_dataset": True}: rows are input_ids (+ labels) as given
    packing_strategy: str = "bfd"  # bfd: whole examples; wrapped: rows concatenated, cut into max_length blocks
    eval_packing: bool | None = None  # None: as packing
    assistant_only_loss: bool = False  # conversations train on the assistant messages' tokens only
    loss_type: str = "nll"  # nll | dft (sft.loss)
    metric_for_best_model: str | None = None  # state.best_metric follows this eval metric (no checkpoint choice)
    greater_is_better: bool | None = None  # None: True unless the metric is a loss
    padding_free: bool = False  # True: hasten's packing (a block mask: no padding, each example sees itself)
    gradient_checkpointing_kwargs: dict | None = None  # {"use_reentrant": bool} only


class SFTConfig(TrainingConfig, _SFTFields):
    """TRL's SFTConfig surface; `overrides()` gives hasten's config keys (sft:, model:, output:)."""

    fields_class = _SFTFields

    def overrides(self) -> list[tuple[str, Any]]:
        if self.max_steps <= 0 and (self.num_train_epochs != int(self.num_train_epochs) or self.num_train_epochs < 1):
            raise self._error(f"num_train_epochs must be a whole number >= 1 for SFT (got {self.num_train_epochs})")
        if self.profile is not None or self.tf32:
            raise self._error(f"{'profile' if self.profile is not None else 'tf32'} is not supported for SFT "
                              "(hasten sft --profile has SFT's own profiles)")
        if self.completion_only_loss is False:
            raise self._error("completion_only_loss=False is not supported (prompt-completion rows train on the "
                              "completion; use a 'text' column for loss on every token)")
        mode = self._precision_mode()
        pairs = [("sft.epochs", max(1, int(self.num_train_epochs))), ("sft.max_steps", max(0, self.max_steps)),
                 ("sft.lr", self.learning_rate),
                 ("sft.batch_size", self.per_device_train_batch_size * self.gradient_accumulation_steps),
                 ("sft.gradient_accumulation_steps", self.gradient_accumulation_steps),
                 ("sft.warmup_steps", 0), ("sft.warmup_from_zero", True), ("sft.lr_schedule", self._schedule()),
                 ("sft.weight_decay", self.weight_decay), ("sft.max_grad_norm", self.max_grad_norm),
                 ("sft.seed", self.seed), ("sft.loss", self._loss_type()),
                 ("sft.adamw", {"fused": "fused", "foreach": "foreach"}[self._optimizer()]),
                 ("sft.precision", mode or "auto"), ("sft.compile", "on" if self.torch_compile else "off"),
                 ("eval.num_examples", 0), ("eval.at_start", False)]
        if self.adam_beta1 != 0.9 or self.adam_beta2 != 0.999:
            raise self._error("adam_beta1 / adam_beta2 other than 0.9 / 0.999 are not supported for SFT")
        if self.padding_free and not self.packing and self.max_length is not None:  # TRL's check, in its words
            raise self._error("When `padding_free=True` without packing, `max_length` is not enforced. Either "
                              "enable packing (packing=True), provide already truncated inputs, or set "
                              "max_length=None")
        if self.router_aux_loss_coef is not None:  # None: resolved from the model once it is loaded
            pairs.append(("sft.router_aux_loss_coef", self.router_aux_loss_coef))
        if self.packing_strategy not in ("bfd", "wrapped"):
            raise self._error(f"packing_strategy={self.packing_strategy!r} is not supported (bfd, wrapped)")
        if set(self.dataset_kwargs or {}) - {"skip_prepare_dataset"}:  # TRL's only key
            raise self._error(f"dataset_kwargs: only skip_prepare_dataset is supported (got "
                              f"{', '.join(sorted(self.dataset_kwargs))})")
        if self.packing is not None or self.padding_free:
            pairs.append(("sft.packing", bool(self.packing or self.padding_free)))
        if self.gradient_checkpointing is not None:
            pairs.append(("sft.gradient_checkpointing", self.gradient_checkpointing))
        checkpointing = dict(self.gradient_checkpointing_kwargs or {})
        if set(checkpointing) - {"use_reentrant"}:
            raise self._error(f"gradient_checkpointing_kwargs: only use_reentrant is supported (got "
                              f"{', '.join(sorted(checkpointing))}); hasten calls transformers' checkpointing itself")
        reentrant = bool(checkpointing.get("use_reentrant", False))
        pairs.append(("sft.gradient_checkpointing_reentrant", reentrant))
        if reentrant and self.gradient_checkpointing and "model_impl" not in (self.speed or {}):
            pairs.append(("speed.model_impl", "hf"))  # the native Llama checkpoints non-reentrantly only
        pairs += [(f"speed.{key}", value) for key, value in (self.speed or {}).items()]
        return pairs

    def _loss_type(self) -> str:
        if self.loss_type not in ("nll", "dft"):
            raise self._error(f"loss_type={self.loss_type!r} is not supported (nll, dft)")
        return self.loss_type

    def steps_and_warmup(self, num_examples: int) -> tuple[int, list[tuple[str, Any]]]:
        """Optimizer steps of the run, and the output / warmup keys that depend on them."""
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        steps = self.max_steps if self.max_steps > 0 else int(self.num_train_epochs) * -(-num_examples // batch)
        return steps, [("sft.warmup_steps", self._warmup(steps)), *self._output(steps)]


class SFTTrainer:
    def __init__(self, model: Any, args: SFTConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, callbacks: list | None = None,
                 peft_config: Any = None, formatting_func: Callable[[dict], str] | None = None,
                 compute_metrics: Callable[[Any], dict[str, float]] | None = None,
                 log: Callable[[str], None] = print, **others: Any):
        import torch

        unexpected = {name: value for name, value in others.items() if value not in (None, (None, None))}
        if unexpected:
            raise APIError(f"SFTTrainer: {next(iter(unexpected))} is not supported by hasten (docs/trl.md)")
        args = args if args is not None else SFTConfig(f"{model_name(model).rstrip('/').split('/')[-1]}-SFT")
        args = _from_training_arguments(args)
        if not isinstance(args, SFTConfig):
            raise APIError(f"SFTTrainer: args must be a hasten SFTConfig (got {type(args).__name__})")
        if train_dataset is None:
            raise APIError("SFTTrainer: `train_dataset` is required")
        skip = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset"))
        for dataset in [train_dataset, *(eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset])]:
            if getattr(dataset, "format", {}).get("type") == "custom" and not skip:  # TRL's refusal, in its words
                raise APIError("SFTTrainer: a Dataset.with_transform() dataset is not supported without "
                               "dataset_kwargs={'skip_prepare_dataset': True} and a transform that returns "
                               "trainer-ready rows (input_ids, labels); or materialize it with Dataset.map() first")
        self.args, self.log, self.callbacks = args, log, instantiate(callbacks)
        self.formatting_func, self.compute_metrics = formatting_func, compute_metrics
        rows = self._formatted(_rows(_head(train_dataset, args), "train_dataset"))
        base = [("model.name", model_name(model)), ("task.name", "dataset"), *args.overrides()]
        steps, more = args.steps_and_warmup(len(rows))
        self.config: Config = load_config(None, base + more, profile=None)
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        self.policy = build_policy(model, self.config, processing_class, peft_config, log,
                                   chat_template_path=args.chat_template_path, prompt_learning=True)
        if is_prompt_learning(self.policy.model) and self.config.sft.packing:  # virtual tokens: the peft forward
            if args.packing or args.padding_free:
                raise APIError("SFTConfig: packing=True is not supported with prompt or prefix tuning (the virtual "
                               "tokens come from peft's own forward, which hasten runs on padded batches)")
            self.config.sft.packing = False
        if rows and isinstance(rows[0], dict) and ("image" in rows[0] or "images" in rows[0]):
            if getattr(getattr(self.policy.model, "config", None), "vision_config", None) is None:  # TRL's words
                raise APIError("The dataset appears to be vision-related (contains 'image' or 'images' keys), but the "
                               "provided model does not seem to be a vision-language model. Please check your model "
                               "and dataset.")
            raise APIError("SFTTrainer: image datasets are not supported by hasten (it trains text-only models)")
        tag_model(self.policy.model, ["trl", "sft", "hasten"])
        self.config.sft.router_aux_loss_coef = self._router_coefficient()
        if self.aux_loss_enabled and self.config.sft.packing:  # the router loss comes from the padded pass
            if args.packing:
                raise APIError("SFTConfig: packing=True is not supported on a mixture-of-experts model with "
                               "router_aux_loss_coef != 0 (hasten's router aux loss needs the padded pass)")
            self.config.sft.packing = False
        # TRL's processed rows (input_ids and labels; packed: + seq_lengths), or the rows as given (skip_prepare)
        self.examples, self.train_dataset = prepare(rows, self.policy.tokenizer, self.policy.eos_token_ids[0], args,
                                                    log, packing=bool(args.packing))
        self.train_dataset = train_dataset if self.train_dataset is None else self.train_dataset
        if len(self.examples) != len(rows):  # wrapped blocks, or rows without a target: the steps count examples
            steps, more = args.steps_and_warmup(len(self.examples))
            for key, value in more:
                set_key(self.config, key, value)
            validate(self.config)
        # TRL's eval_dataset: one dataset, or a dict of them (each logged as eval_<name>_loss); kept prepared
        self.eval_sets, self.eval_dataset = self._eval_sets(eval_dataset)
        self.eval_examples = [example for examples in self.eval_sets.values() for example in examples]
        if args.eval_strategy not in ("no", "steps", "epoch"):
            raise APIError(f"SFTConfig: eval_strategy={args.eval_strategy!r} is not supported (no | steps | epoch)")
        self.state = TrainerState(max_steps=steps, num_train_epochs=args.num_train_epochs,
                                  logging_steps=args.logging_steps, save_steps=args.save_steps,
                                  train_batch_size=args.per_device_train_batch_size)
        self.run_dir: Path | None = None

    @property
    def model(self):
        return self.policy.model

    def _formatted(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """TRL's formatting_func: each row becomes the text it returns, trained as language modelling."""
        if self.formatting_func is None:
            return rows
        texts = [self.formatting_func(row) for row in rows]
        if not all(isinstance(text, str) for text in texts):
            raise APIError("SFTTrainer: formatting_func must return one string per example")
        return [{self.args.dataset_text_field: text} for text in texts]

    @property
    def aux_loss_enabled(self) -> bool:
        """TRL's: a mixture-of-experts model (its config has output_router_logits) and router_aux_loss_coef
        != 0; each micro-batch's loss then adds coef x the router load-balancing loss, logged as aux_loss."""
        from ..rft.sft import router_aux_coefficient

        return router_aux_coefficient(getattr(self.model, "config", None), self.config.sft.router_aux_loss_coef) != 0

    def _router_coefficient(self) -> float:
        """TRL's router_aux_loss_coef: None takes the model config's own (absent: 0, no aux loss); a value on
        a model without router logits is TRL's error."""
        from ..train.learner import is_mixture_of_experts

        config = getattr(self.model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        given = self.args.router_aux_loss_coef
        if given is None:
            return float(getattr(text, "router_aux_loss_coef", None) or 0.0) if is_mixture_of_experts(config) else 0.0
        if given and not is_mixture_of_experts(config):
            raise APIError(f"SFTConfig: `router_aux_loss_coef` is set to {given} but {type(self.model).__name__} is "
                           "not a Mixture-of-Experts model that returns its router logits, so there is no auxiliary "
                           "loss to weight.")
        return float(given)

    def _eval_sets(self, eval_dataset: Any) -> tuple[dict[str | None, list], Any]:
        """{name or None: Examples} and the prepared dataset(s), shaped as given (one, or a dict by name)."""
        if eval_dataset is None:
            return {}, None
        named = dict(eval_dataset) if isinstance(eval_dataset, dict) else {None: eval_dataset}
        if not named:
            raise APIError("SFTTrainer: eval_dataset is an empty dict")
        packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing  # TRL's rule
        sets, shown = {}, {}
        for name, dataset in named.items():
            label = "eval_dataset" if name is None else f"eval_dataset['{name}']"
            sets[name], shown[name] = prepare(self._formatted(_rows(dataset, label)), self.policy.tokenizer,
                                              self.policy.eos_token_ids[0], self.args, self.log, bool(packing), label)
            shown[name] = dataset if shown[name] is None else shown[name]  # skip_prepare_dataset: as given
        return sets, shown.get(None, shown)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """transformers' evaluate(): the loss over eval_dataset's target tokens (default: the trainer's), with
        mean_token_accuracy and entropy as TRL logs them, under "<prefix>_..." ("<prefix>_<name>_..." for each
        set of a dict); logged to log_history and on_evaluate."""
        sets = self._eval_sets(eval_dataset)[0] if eval_dataset is not None else self.eval_sets
        if not sets:
            raise APIError("SFTTrainer.evaluate: there is no eval_dataset (pass one here or to SFTTrainer)")
        metrics: dict[str, float] = {}
        bridge = CallbackBridge(self.callbacks, self.args, self.state, self.model, self.processing_class, 1, 1, 1)
        for name, examples in sets.items():  # one log entry per set, as transformers evaluates a dict
            label = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            found = self._loss_on(examples)
            runtime = found.pop("seconds")
            found.update({"runtime": runtime, "samples_per_second": len(examples) / max(runtime, 1e-9),
                          "steps_per_second": -(-len(examples) // self.args.per_device_eval_batch_size)
                          / max(runtime, 1e-9)})
            found.pop("num_examples")
            found = {f"{label}_{key}": value for key, value in found.items() if key not in (ignore_keys or [])}
            bridge.log_eval(found)
            metrics.update(found)
        return metrics

    @property
    def processing_class(self):
        return self.policy.tokenizer

    def train(self, resume_from_checkpoint: str | bool | None = None) -> TrainOutput:
        from ..rft.sft import SFTJob
        from ..train import loop
        from ..train.tracking import make_trackers

        cfg = self.config
        resume = None
        if resume_from_checkpoint:
            path = Path(cfg.output.dir) / cfg.output.name if resume_from_checkpoint is True \
                else Path(resume_from_checkpoint)
            run_dir, resume = loop.find_checkpoint(path)
            check_same_config(cfg, run_dir.path / "config.yaml")
        evaluator = self.evaluate_loss if self.eval_examples and self.args.eval_strategy != "no" else None
        job = SFTJob(self.policy.model, self.examples, cfg, self.policy.pad_token_id, self.log, self.policy.tokenizer,
                     evaluator)
        if resume is None:
            say_where(cfg, self.log)
        run, checkpoint = loop.open_run(cfg, resume)
        steps_per_epoch = max(1, -(-len(self.examples) // cfg.sft.batch_size))
        if evaluator is not None:  # the loop evaluates every eval_every steps and after the last
            every = self.args.eval_steps or self.args.logging_steps
            job.eval_every = int(steps_per_epoch) if self.args.eval_strategy == "epoch" else \
                max(1, math.ceil(every * job.total_steps) if every < 1 else int(every))
        bridge = CallbackBridge(self.callbacks, self.args, self.state, self.model, self.processing_class, 1,
                                steps_per_epoch, cfg.output.log_every)
        hooks = make_trackers(cfg, run, list) + [bridge]
        summary = loop.run(job, cfg, run, self.log, checkpoint, created=resume is None, callbacks=hooks)
        self.run_dir = Path(summary["run_dir"])
        losses = [r["loss"] for r in run_records(self.run_dir) if isinstance(r.get("loss"), float)]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else float("nan"), summary)

    def evaluate_loss(self) -> dict[str, float]:
        """The mean cross-entropy over eval_dataset's target tokens (TRL's eval_loss), in eval mode; a dict of
        eval datasets gives <name>_loss, <name>_runtime, ... for each (TRL's eval_<name>_loss)."""
        metrics: dict[str, float] = {}
        for name, examples in self.eval_sets.items():
            prefix = "" if name is None else f"{name}_"
            metrics.update({f"{prefix}{key}": value for key, value in self._loss_on(examples).items()})
        return metrics

    def _loss_on(self, examples: list) -> dict[str, float]:
        """rft/batches.py's eval_loss (the SFT core's, on the padded batches training takes) with TRL's names."""
        from ..rft.batches import eval_loss

        started = time.perf_counter()
        found = eval_loss(self.policy.model, examples, self.policy.pad_token_id, self.args.per_device_eval_batch_size,
                          keep_logits=self.compute_metrics is not None)
        metrics = found.means()
        if self.compute_metrics is not None:
            metrics.update(self._user_metrics(found.logits, found.labels))
        return {**metrics, "seconds": time.perf_counter() - started, "num_examples": len(examples)}

    def _user_metrics(self, logits: list, labels: list) -> dict[str, float]:
        """compute_metrics(EvalPrediction(predictions=logits (N, L, V), label_ids=labels (N, L))), the batches
        padded to one length with -100, as transformers concatenates them; its keys join the eval metrics."""
        import torch
        from transformers import EvalPrediction

        width = max(batch.shape[1] for batch in labels)
        logits = torch.cat([torch.nn.functional.pad(batch, (0, 0, 0, width - batch.shape[1]), value=-100.0)
                            for batch in logits])
        labels = torch.cat([torch.nn.functional.pad(batch, (0, width - batch.shape[1]), value=-100)
                            for batch in labels])
        metrics = self.compute_metrics(EvalPrediction(predictions=logits.numpy(), label_ids=labels.numpy()))
        return {key.removeprefix("eval_"): float(value) for key, value in dict(metrics).items()}

    def save_model(self, output_dir: str | None = None) -> Path:
        from ..train.outputs import save_model_files

        cfg = self.config
        target = Path(output_dir) if output_dir else Path(cfg.output.dir) / cfg.output.name  # args.output_dir, as TRL
        target.mkdir(parents=True, exist_ok=True)
        save_model_files(self.model, self.processing_class, target)
        return target


def _from_training_arguments(args: Any) -> Any:
    """transformers' TrainingArguments as SFT args, as TRL takes them: an SFTConfig with its values (the
    fields it sets away from TrainingArguments' defaults, and its learning rate, whose default differs)."""
    if isinstance(args, SFTConfig) or type(args).__name__ != "TrainingArguments":
        return args
    import dataclasses

    reference = type(args)(output_dir=args.output_dir)  # the defaults as __post_init__ normalizes them
    given = {item.name: getattr(args, item.name) for item in dataclasses.fields(args)
             if item.init and item.name not in ("output_dir", "logging_dir", "report_to")
             and getattr(args, item.name) != getattr(reference, item.name)}
    given["report_to"] = "none" if args.report_to in ([], ["none"], "none", None) else args.report_to
    return SFTConfig(args.output_dir, **{"learning_rate": args.learning_rate, **given})


def _head(dataset: Any, args: SFTConfig) -> Any:
    """An IterableDataset (datasets' streaming one) as the rows max_steps reads from it, as a list."""
    try:
        from datasets import IterableDataset
    except ImportError:  # no datasets: nothing can be one
        return dataset
    if not isinstance(dataset, IterableDataset):
        return dataset
    if args.max_steps <= 0:
        raise APIError("SFTTrainer: train_dataset is an IterableDataset, which needs max_steps > 0 (as TRL)")
    need = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
    return list(itertools.islice(iter(dataset), need))


def _rows(dataset: Any, argument: str = "train_dataset") -> list[dict[str, Any]]:
    if isinstance(dataset, (str, Path)):
        return _file_rows(str(dataset))
    if type(dataset).__name__ == "IterableDataset":  # datasets' streaming one: read it whole (eval sets)
        dataset = list(dataset)
    if getattr(dataset, "format", {}).get("type") == "custom":  # with_transform: its rows are what it returns
        return [dataset[index] for index in range(len(dataset))]
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):
        return dataset.to_list()
    if isinstance(dataset, (list, tuple)) and all(isinstance(row, dict) for row in dataset) and dataset:
        return list(dataset)
    raise APIError(f"SFTTrainer: {argument} must be a non-empty list of dicts, a datasets.Dataset or a file path")


def _file_rows(path: str) -> list[dict[str, Any]]:
    """SFT rows from a file: the readers of tasks/data.py without GRPO's "prompt" requirement."""
    from ..tasks.data import FORMATS, READERS

    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS or not Path(path).is_file():
        raise APIError(f"SFTTrainer: {path} is not a {', '.join(FORMATS)} file")
    return READERS[suffix](Path(path))[0]
