"""Experiment tracking: output.report_to = tensorboard | wandb | trackio | mlflow (none by default).

Each tracker is a loop Hook (train/loop.py). It receives every step's
record, exactly what metrics.jsonl holds, averaged over output.log_every
steps (the last window may be shorter), under TRL's "train/" prefix; every
held-out eval under "eval/"; and, with output.log_completions, the logged
step's prompts, completions and rewards as a table (TensorBoard: text).

A tracker whose package is missing is one error before the run directory
is created (`check_trackers`), never a silent skip. Where each writes:
  tensorboard  <run dir>/tensorboard/ (torch.utils.tensorboard, or tensorboardX when only it is installed)
  wandb        wandb.init(project=$WANDB_PROJECT or "hasten", name=<run dir name>, dir=<run dir>)
  trackio      trackio.init(project="hasten", name=<run dir name>)
  mlflow       mlflow.start_run(run_name=<run dir name>) on the configured tracking URI
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from typing import Any, Callable

from ..config import Config, ConfigError
from . import distributed
from .loop import Hook
from .outputs import RunDir

PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",), "trackio": ("trackio",),
            "mlflow": ("mlflow",)}


def check_trackers(cfg: Config) -> None:
    """ConfigError naming the first tracker in output.report_to whose package is not installed."""
    for name in cfg.output.report_to:
        packages = PACKAGES[name]
        if not any(importlib.util.find_spec(package) for package in packages):
            raise ConfigError(f"config error: output.report_to={name} needs the {' or '.join(packages)} package "
                              f"(pip install {packages[-1] if name == 'tensorboard' else packages[0]})")


def make_trackers(cfg: Config, run: RunDir, completions: Callable[[], list[dict]]) -> list[Hook]:
    """The run's tracker hook (none when output.report_to is empty, and on every torchrun rank but 0: one
    W&B / TensorBoard run per training run, not per process); `completions()`: the last step's table."""
    check_trackers(cfg)
    writers = [WRITERS[name](run) for name in cfg.output.report_to] if distributed.is_main() else []
    if not writers:
        return []
    return [Tracker(writers, cfg.output.log_every, completions if cfg.output.log_completions else None,
                    trl_record if cfg.output.tracker_names == "trl" else dict)]


# hasten's metrics.jsonl names -> TRL's log names (others keep hasten's name): what TRL's dashboards show
TRL_NAMES = {"reward_mean": "reward", "lr": "learning_rate", "completion_length": "completions/mean_length",
             "completion_length_max": "completions/max_length", "zero_variance_groups": "frac_reward_zero_std",
             "eos_fraction": "completions/eos_fraction", "seconds": "runtime"}


def trl_record(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record under TRL's log names (rewards/<f> is rewards/<f>/mean)."""
    out = {}
    for key, value in record.items():
        if key.startswith("rewards/") and not key.endswith("/std"):
            key = f"{key}/mean"
        out[TRL_NAMES.get(key, key)] = value
    return out


def numbers(record: dict[str, Any], prefix: str) -> dict[str, float]:
    """The record's finite numbers, keys prefixed; "step" left out."""
    return {f"{prefix}{key}": float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class Tracker(Hook):
    """Averages step records over log_every steps and hands them, evals and completions to the writers."""

    def __init__(self, writers: list, log_every: int, completions: Callable[[], list[dict]] | None,
                 rename: Callable[[dict], dict] = dict):
        """rename: a record under the names the trackers show (output.tracker_names)."""
        self.writers, self.log_every, self.completions, self.rename = writers, log_every, completions, rename
        self.window: list[dict[str, float]] = []
        self.total_steps = 0

    def on_step(self, step: int, record: dict[str, Any]) -> None:
        self.window.append(numbers(self.rename(record), "train/"))
        if step % self.log_every:
            return
        self._flush(step)

    def _flush(self, step: int) -> None:
        if not self.window:
            return
        keys = dict.fromkeys(key for record in self.window for key in record)
        means = {key: sum(r[key] for r in self.window if key in r) / sum(key in r for r in self.window)
                 for key in keys}
        self.window = []
        table = self.completions() if self.completions is not None else None
        for writer in self.writers:
            writer.scalars(step, means)
            if table:
                writer.table(step, table)

    def on_evaluate(self, step: int, metrics: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.scalars(step, numbers(self.rename(metrics), "eval/"))

    def on_end(self, summary: dict[str, Any]) -> None:
        self._flush(int(summary.get("steps", 0)))  # a last window shorter than log_every

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class TensorBoardWriter:
    def __init__(self, run: RunDir):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package; tensorboardX is the light one
            from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(log_dir=str(run.path / "tensorboard"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def table(self, step: int, rows: list[dict]) -> None:
        lines = "\n".join(json.dumps(row, default=str) for row in rows)
        self.writer.add_text("completions", f"```\n{lines}\n```", step)

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, run: RunDir):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hasten"), name=run.path.name,
                              dir=str(run.path), reinit=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, rows: list[dict]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = [[_cell(row.get(column)) for column in columns] for row in rows]
        self.run.log({"completions": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioWriter:
    def __init__(self, run: RunDir):
        import trackio

        self.trackio = trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "hasten"), name=run.path.name)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.trackio.log(values, step=step)

    def table(self, step: int, rows: list[dict]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = self.trackio.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])
        self.trackio.log({"completions": table}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class MlflowWriter:
    def __init__(self, run: RunDir):
        import mlflow

        self.mlflow = mlflow
        self.active = mlflow.start_run(run_name=run.path.name)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        # mlflow's metric names allow letters, digits, _ - . / and spaces: the keys here already fit.
        self.mlflow.log_metrics(values, step=step)

    def table(self, step: int, rows: list[dict]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.mlflow.log_table({c: [_cell(row.get(c)) for row in rows] for c in columns},
                              artifact_file=f"completions/step-{step}.json")

    def close(self) -> None:
        self.mlflow.end_run()


def _cell(value: Any) -> Any:
    """A table cell trackers accept: numbers and strings as they are, anything else as JSON text."""
    return value if isinstance(value, (int, float, str)) or value is None else json.dumps(value, default=str)


WRITERS: dict[str, Callable[[RunDir], Any]] = {"tensorboard": TensorBoardWriter, "wandb": WandbWriter,
                                               "trackio": TrackioWriter, "mlflow": MlflowWriter}
