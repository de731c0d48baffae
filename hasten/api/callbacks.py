"""transformers TrainerCallbacks on hasten's loop: TrainerState, TrainerControl and the bridge Hook.

The loop (train/loop.py) tells its Hooks of the start, each step, evals,
saves and the end; `CallbackBridge` turns that into the TrainerCallback
calls that have a meaning here, with transformers' arguments
(args, state, control, model=, processing_class=, logs= / metrics=):

    on_train_begin   before the first step (or the first step after a resume)
    on_step_end      after every hasten step (one generation batch: num_iterations optimizer steps)
    on_log           every args.logging_steps: the mean of the steps since the last log, under TRL's
                     names (loss, grad_norm, learning_rate, reward, reward_std, rewards/<f>/mean,
                     completions/mean_length, kl, entropy, ...); appended to state.log_history;
                     at the end, transformers' summary entry (train_loss, train_runtime,
                     train_samples_per_second, train_steps_per_second, total_flos) with what
                     was not logged yet, as the last entry of log_history
    on_evaluate      after each held-out eval (metrics prefixed "eval_", or "eval_<name>_" for a
                     dict of eval datasets, under TRL's names, as transformers does)
    on_save          after each checkpoint
    on_train_end     after the last step (or a stop)

A callback that sets control.should_training_stop ends the run after that
step (a checkpoint is saved). Hooks hasten has no moment for (on_step_begin,
on_substep_end, on_pre_optimizer_step, on_optimizer_step, on_epoch_begin,
on_epoch_end, on_prediction_step, on_init_end) are an error when a callback
overrides them, rather than never being called. The state and control are
hasten's own small dataclasses with transformers' field names, so the
Python API does not import transformers unless the model needs it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..train.loop import Hook
from ..train.tracking import trl_record  # TRL's metric names, shared with the trackers
from .grpo_config import APIError

NOT_CALLED = ("on_init_end", "on_epoch_begin", "on_epoch_end", "on_step_begin", "on_substep_end",
              "on_pre_optimizer_step", "on_optimizer_step", "on_prediction_step", "on_push_begin")

@dataclass
class TrainerState:
    """transformers.TrainerState's fields that describe a hasten run; global_step counts optimizer steps."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: float = 0.0
    logging_steps: float = 10
    save_steps: float = 500
    eval_steps: float | None = None
    train_batch_size: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    total_flos: float = 0.0
    num_input_tokens_seen: int = 0


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


def instantiate(callbacks: list | None) -> list:
    """Callback instances (a class is instantiated, as transformers does); overrides hasten cannot call are errors."""
    result = []
    for callback in callbacks or []:
        instance = callback() if isinstance(callback, type) else callback
        for klass in type(instance).__mro__:
            if klass.__module__.startswith(("transformers", "trl")) or klass is object:
                break  # the library's own (no-op) hooks
            overridden = [name for name in NOT_CALLED if name in vars(klass)]
            if overridden:
                raise APIError(f"callbacks: {type(instance).__name__}.{overridden[0]} is never called by hasten "
                               "(it has no such moment); docs/trl.md lists the hooks it calls")
        result.append(instance)
    return result


class CallbackBridge(Hook):
    """The loop's Hook that drives TrainerCallbacks and keeps TrainerState (log_history) current."""

    def __init__(self, callbacks: list, args: Any, state: TrainerState, model: Any, tokenizer: Any,
                 iterations: int, prompts_per_epoch: float, log_every: int,
                 evaluate: Callable[[], dict[str, Any]] | None = None, eval_every: int = 0):
        """evaluate / eval_every: evals the trainer runs itself (named eval datasets), after every
        eval_every-th step (and before the first with args.eval_on_start), logged like the loop's."""
        self.callbacks, self.args, self.state, self.control = callbacks, args, state, TrainerControl()
        self.model, self.tokenizer = model, tokenizer
        self.iterations, self.prompts_per_epoch, self.log_every = iterations, prompts_per_epoch, log_every
        self.evaluate, self.eval_every = evaluate, eval_every
        self.window: list[dict[str, Any]] = []
        self.losses: list[float] = []  # every step's loss, for the summary's train_loss
        self.run_dir = None
        self.started = time.perf_counter()
        self.start_step = 0
        self.summary: dict[str, Any] = {}  # the final entry's train_* metrics (TrainOutput.metrics)

    def _call(self, hook: str, **kwargs: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                result = method(self.args, self.state, self.control, model=self.model,
                                processing_class=self.tokenizer, **kwargs)
                if isinstance(result, TrainerControl):  # transformers lets a hook return a new control
                    self.control = result

    def _advance(self, step: int) -> None:
        self.state.global_step = step * self.iterations
        self.state.epoch = step / self.prompts_per_epoch

    def on_begin(self, run, start: int) -> None:
        self.run_dir = run.path
        self.started, self.start_step = time.perf_counter(), start
        self._advance(start)
        self._call("on_train_begin")
        if start == 0 and self.evaluate is not None and getattr(self.args, "eval_on_start", False):
            self.log_eval(self.evaluate())

    def on_step(self, step: int, record: dict[str, Any]) -> bool:
        self._advance(step)
        self.window.append(record)
        if isinstance(record.get("loss"), (int, float)):
            self.losses.append(float(record["loss"]))
        self._call("on_step_end")
        if step % self.log_every == 0:
            self._log()
        if self.evaluate is not None and self.eval_every and step % self.eval_every == 0:
            self.log_eval(self.evaluate())
        return self.control.should_training_stop

    def _window_logs(self) -> dict[str, Any]:
        """The mean of the steps since the last log, under TRL's names; empties the window."""
        numeric = [{k: v for k, v in trl_record(r).items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                    and k != "step"} for r in self.window]
        keys = dict.fromkeys(key for record in numeric for key in record)
        self.window = []
        return {key: sum(r[key] for r in numeric if key in r) / sum(key in r for r in numeric) for key in keys}

    def _log(self) -> None:
        if not self.window:
            return
        logs = {**self._window_logs(), "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._call("on_log", logs=logs)

    def on_evaluate(self, step: int, metrics: dict[str, Any]) -> None:
        self._advance(step)
        self.log_eval({f"eval_{key}": value for key, value in trl_record(metrics).items()})

    def log_eval(self, metrics: dict[str, Any]) -> None:
        """Eval metrics, already prefixed, into log_history and on_evaluate (as transformers logs them);
        args.metric_for_best_model (where the args have it) moves state.best_metric, as transformers'."""
        self._track_best(metrics)
        self.state.log_history.append({**metrics, "epoch": self.state.epoch, "step": self.state.global_step})
        self._call("on_evaluate", metrics=metrics)

    def _track_best(self, metrics: dict[str, Any]) -> None:
        metric = getattr(self.args, "metric_for_best_model", None)
        if not metric:
            return
        name = metric if metric.startswith("eval_") else f"eval_{metric}"
        if name not in metrics:
            if "eval_loss" in metrics:  # a single eval set that lacks it: a misspelt metric, not a silent no-op
                raise APIError(f"metric_for_best_model: {name} is not an eval metric ({', '.join(sorted(metrics))})")
            return  # one set of a dict of eval sets
        greater = getattr(self.args, "greater_is_better", None)
        greater = not name.endswith("loss") if greater is None else greater
        best = self.state.best_metric
        if best is None or (metrics[name] > best if greater else metrics[name] < best):
            self.state.best_metric = float(metrics[name])

    def on_save(self, step: int, checkpoint) -> None:
        if getattr(self.args, "save_only_model", False):  # transformers': the model only, no optimizer/RNG state
            from ..train.outputs import STATE_FILE

            (Path(checkpoint) / STATE_FILE).unlink(missing_ok=True)
        self._call("on_save")

    def on_end(self, summary: dict[str, Any]) -> None:
        """transformers' final log entry: the metrics not yet logged (a last window shorter than
        logging_steps, as TRL merges them) with the run's train_runtime, train_*_per_second and train_loss."""
        runtime = max(time.perf_counter() - self.started, 1e-9)
        steps = self.state.global_step - self.start_step * self.iterations
        samples = steps * self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        self.summary = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(samples / runtime, 3),
                        "train_steps_per_second": round(steps / runtime, 3), "total_flos": 0.0,
                        "train_loss": sum(self.losses) / len(self.losses) if self.losses else float("nan")}
        logs = {**self._window_logs(), **self.summary, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._call("on_log", logs=logs)
        self._call("on_train_end")
