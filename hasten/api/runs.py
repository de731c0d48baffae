"""What GRPOTrainer and SFTTrainer share about a run: its result, its tags, where it writes, its resume check.

Both trainers run hasten's one loop (train/loop.py) in output_dir; these are
the pieces around it that the two TRL trainers must agree on: transformers'
TrainOutput, TRL's model tags, the line said when output_dir is taken, the
rule that a resumed run continues its own config, and the metrics records a
finished run leaves (training_loss is their mean loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Config, load_config, to_dict
from .grpo_config import APIError


@dataclass
class TrainOutput:
    """transformers' TrainOutput: (global_step, training_loss, metrics); metrics is the run's summary."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


def tag_model(model, tags: list[str]) -> None:
    """TRL's model tags, which transformers writes to the model card on push_to_hub; hasten's native forward
    model (models/llama.py) keeps them in the same attribute."""
    if hasattr(model, "add_model_tags"):
        model.add_model_tags(tags)
    else:
        model.model_tags = [*(getattr(model, "model_tags", None) or []),
                            *(tag for tag in tags if tag not in (getattr(model, "model_tags", None) or []))]


def say_where(cfg: Config, log: Callable[[str], None]) -> None:
    """The log line for a fresh run whose output_dir is taken (outputs.RunDir.create does the move)."""
    from ..train import distributed
    from ..train.outputs import aside_name, holds_run

    target = Path(cfg.output.dir) / cfg.output.name
    if not distributed.is_main() or not target.is_dir() or not any(target.iterdir()):
        return
    if holds_run(target):
        log(f"output_dir {target} holds an earlier run: it is kept as {aside_name(target)} and this run writes "
            f"{target} (resume_from_checkpoint=True would have continued it)")
    else:
        log(f"output_dir {target} holds files that are not a hasten run; this run gets a fresh directory "
            "beside it")


def check_same_config(cfg: Config, saved_path: Path) -> None:
    """A resumed run continues the saved config; an argument that changes what is learned is an error.
    A larger max_steps (train.steps) continues the run to the new end, as TRL does (the schedule is the
    new length's; loop.open_run records it in the run's config.yaml)."""
    saved = load_config(saved_path)
    ignored = {("output", "progress"), ("output", "plot"), ("output", "earlier_run")}
    now, before = to_dict(cfg), to_dict(saved)
    for section, values in now.items():
        for key, value in values.items():
            if (section, key) == ("train", "steps") and value >= before[section][key]:
                continue
            if (section, key) not in ignored and before[section].get(key) != value:
                raise APIError(f"resume_from_checkpoint: {section}.{key} is {value!r} now but "
                               f"{before[section].get(key)!r} in {saved_path}; a resumed run continues its own "
                               "config (use the arguments it was started with)")


def run_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics.jsonl records, one per logged step."""
    from ..train.outputs import read_json_lines

    return read_json_lines(run_dir / "metrics.jsonl")
