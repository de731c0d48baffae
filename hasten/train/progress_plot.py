"""progress.png: a run's reward, held-out eval and training curves, drawn from its logs (matplotlib, Agg).

outputs.RunDir.plot calls it with the run's records at each eval and at the end (output.plot).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


# metrics.jsonl key -> panel title, the plot's bottom row
TRAINING_PANELS = (("loss", "loss"), ("kl", "KL to the reference"), ("entropy", "entropy (nats/token)"),
                   ("completion_length", "completion length (tokens)"), ("time/step", "step time (s)"))


def plot(directory: Path, steps: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Path | None:
    """Draw directory/progress.png from a run's metrics.jsonl and eval.jsonl records; None when there is
    nothing to draw yet."""
    reward = _series(steps, "reward_mean")
    reward_std = dict(zip(*_series(steps, "reward_std")))
    per_function = {
        _reward_name(key): _series(steps, key)
        for key in _keys_in_order(steps)
        if key.startswith("rewards/") and not key.endswith("/std")
    }
    eval_keys = ("accuracy", "answer_rate")
    fractions = any(_series(evals, key)[0] for key in eval_keys)
    if not fractions:  # games report mean final scores, not fractions
        eval_keys = ("score_mean", "score_greedy")
    eval_curves = {key: _series(evals, key) for key in eval_keys}
    has_train = bool(reward[0]) or any(xs for xs, _ in per_function.values())
    has_eval = any(xs for xs, _ in eval_curves.values())
    if not (has_train or has_eval):
        return None

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 7), layout="constrained")
    FigureCanvasAgg(figure)
    panels = figure.subplot_mosaic([["reward"] * 3 + ["eval"] * 2, [key for key, _ in TRAINING_PANELS]])
    left, right = panels["reward"], panels["eval"]

    left.set_title("training reward")
    left.set_xlabel("step")
    left.set_ylabel("reward")
    if reward[0]:
        left.plot(*reward, linewidth=2, color="black", label="reward (mean)")
        banded = [(s, v, reward_std[s]) for s, v in zip(*reward) if s in reward_std]
        if banded:
            xs = [s for s, _, _ in banded]
            left.fill_between(
                xs,
                [v - d for _, v, d in banded],
                [v + d for _, v, d in banded],
                color="black",
                alpha=0.1,
                linewidth=0,
                label="± std",
            )
    for name, (xs, ys) in per_function.items():
        if xs:
            left.plot(xs, ys, linewidth=1, alpha=0.8, label=name)
    _finish_panel(left, has_train, "no training steps logged yet")

    right.set_title("held-out eval")
    right.set_xlabel("step")
    right.set_ylabel("fraction" if fractions else "mean final score")
    for key, (xs, ys) in eval_curves.items():
        if xs:
            right.plot(xs, ys, marker="o", linewidth=1.5, label=key.replace("_", " "))
    if has_eval and fractions:
        right.set_ylim(-0.02, 1.02)
    _finish_panel(right, has_eval, "no eval results yet")
    for key, title in TRAINING_PANELS:
        xs, ys = _series(steps, key)
        panels[key].set_title(title, fontsize="medium")
        panels[key].set_xlabel("step")
        if xs:
            panels[key].plot(xs, ys, linewidth=1.2)
        _finish_panel(panels[key], bool(xs), "not logged")

    target = directory / "progress.png"
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        figure.savefig(temporary, format="png", dpi=100)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
    return target


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records holding a number under `key`; a record
    without a "step" counts as the step after its position in the file."""
    steps, values = [], []
    for position, record in enumerate(records):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        step = record.get("step", position + 1)
        steps.append(step)
        values.append(value)
    return steps, values


def _keys_in_order(records: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(key for record in records for key in record))


def _reward_name(key: str) -> str:
    """'rewards/correct' and 'rewards/correct/mean' both read as 'correct'."""
    return key.removeprefix("rewards/").removesuffix("/mean")


def _finish_panel(axes, has_data: bool, note: str) -> None:
    if has_data:
        axes.grid(alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
    else:
        axes.text(0.5, 0.5, note, ha="center", va="center", transform=axes.transAxes, color="gray")
        axes.set_xticks([])
        axes.set_yticks([])
