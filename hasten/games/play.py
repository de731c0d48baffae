"""`hasten play`: watch a trained game policy, as text frames or a PNG strip.

    hasten play --task fruit-catcher --checkpoint runs/<run>/checkpoint
                [--episodes 2] [--steps 100] [--every 10] [--mode sample|greedy|random]
                [--seed 0] [--png strip.png]

Each episode prints a frame every `--every` steps (and the last one), then
its final score; the last line compares the policy's mean final score with a
uniform-random policy on the same starts and spawn draws. `--png` draws the
first episode's frames side by side (matplotlib, no display needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .fruit_catcher import Draws, Rules, render, start_states
from .policy import Episodes, load_policy_checkpoint, play


@dataclass
class Showing:
    """What to play and how to show it."""

    checkpoint: str
    episodes: int = 2
    steps: int = 100
    every: int = 10
    mode: str = "sample"
    seed: int = 0
    png: str | None = None


def frames_of(episodes: Episodes, game: int, every: int) -> list[tuple[int, torch.Tensor, float]]:
    """(step, state, score so far) every `every` steps of one game, the final state included."""
    steps = episodes.actions.shape[0]
    scores = torch.cat([torch.zeros(1), episodes.rewards[:, game].cumsum(dim=0)])  # (T + 1,)
    picked = [(t, episodes.observations[t, game], float(scores[t])) for t in range(0, steps, every)]
    return picked + [(steps, episodes.final_states[game], float(scores[steps]))]


def show(showing: Showing, write=print) -> dict[str, float]:
    """Play and print the episodes; returns {"score_mean": ..., "random_score_mean": ...}."""
    policy, rules = load_policy_checkpoint(showing.checkpoint)
    generator = torch.Generator().manual_seed(showing.seed)
    starts = start_states(rules, showing.episodes, generator)
    draws = Draws.sample(rules, showing.steps, showing.episodes, generator)
    episodes = play(policy, starts, rules, showing.steps, generator, showing.mode, draws)
    baseline = play(None, starts, rules, showing.steps, generator, "random", draws)
    for game in range(showing.episodes):
        write(f"== episode {game + 1} ({showing.mode})")
        for step, state, score in frames_of(episodes, game, showing.every):
            write(f"-- step {step}")
            write(render(state, rules, score))
        write(f"final score {float(episodes.scores[game]):+g}")
    result = {"score_mean": float(episodes.scores.mean()), "random_score_mean": float(baseline.scores.mean())}
    write(f"mean final score over {showing.episodes} episodes: policy {result['score_mean']:+.2f}, "
          f"random policy {result['random_score_mean']:+.2f} (same starts and fruits)")
    if showing.png:
        write(f"wrote {save_strip(frames_of(episodes, 0, showing.every), rules, Path(showing.png))}")
    return result


def save_strip(frames: list[tuple[int, torch.Tensor, float]], rules: Rules, path: Path) -> Path:
    """One image per frame, side by side: fruits orange, sprite blue."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(1.3 * len(frames), 1.3 * rules.height / rules.width + 0.4), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(frames), squeeze=False)[0]
    for axis, (step, state, score) in zip(axes, frames):
        image = torch.ones(rules.height, rules.width, 3)  # (H, W, RGB) white
        text_rows = render(state, rules).splitlines()
        for y, line in enumerate(text_rows):
            for x, cell in enumerate(line):
                if cell == "o":
                    image[y, x] = torch.tensor([1.0, 0.55, 0.0])
                elif cell == "=":
                    image[y, x] = torch.tensor([0.1, 0.3, 0.9])
        axis.imshow(image.numpy(), interpolation="nearest")
        axis.set_title(f"t={step} {score:+g}", fontsize=7)
        axis.set_xticks([])
        axis.set_yticks([])
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path
