"""GRPO on a small tensor policy: the loop behind `hasten train --task fruit-catcher`.

One epoch (a "step" in train.steps, metrics.jsonl and the progress view):
  1. draw game.num_starts start states and repeat each game.games_per_start
     times: G games from the same start form one GRPO group; with
     game.shared_draws (default) they also share the spawn draws, so the
     same fruits fall in all G games and returns differ by the actions alone
     (common random numbers: far less noise in the advantages than games
     whose fruits differ; docs/games.md measures both);
  2. play all games for game.episode_steps steps at once (games/policy.py),
     sampling actions from the policy; the reward of a step is its score change;
  3. discounted returns G_t = r_t + gamma * G_{t+1} per game;
  4. group-relative advantages per (start, step): each game's return against
     the other G - 1 games of its start at the same step (algo.group_advantages,
     algo.scale_rewards);
  5. one learning pass over every (game, step) decision: each decision is a
     one-token "sequence" for the shared loss registry (LOSSES[algo.loss]), so
     the clipped surrogate, num_iterations and every variant apply unchanged
     (with one token, they all reduce to the mean over decisions), minus
     game.entropy_coef x the mean policy entropy;
  6. the optimization layer the language-model learner uses
     (train/optimization.py: AdamW, warmup/cosine from train:, clipping at
     train.max_grad_norm, the NaN guard).
This is REINFORCE with a group baseline, as in the seed recipe; with
num_iterations > 1 the ratio against the sampling policy is clipped as in PPO.

What it shares with the language-model loop: the config, advantages, losses,
the optimization layer, and the outer loop (train/loop.py: evals, full-state
checkpoints with checkpoint/policy.pt, resume, signals, summary, plot).
What it does not need: an engine, a tokenizer, reward functions.

Held-out evaluation plays game.eval_games games from starts and draws seeded
by task.seed (fixed, so numbers compare across epochs), sampling and greedy;
the summary also holds a uniform-random policy on the same games.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..algo import LOSSES, LossInputs, LossSettings, group_advantages, zero_variance_fraction
from ..config import Config, ConfigError
from ..games.fruit_catcher import Draws, Rules, start_states
from ..games.policy import POLICY_FILE, CatcherPolicy, Episodes, play, save_policy
from ..kernels.allocator import check_in_process as check_allocator
from . import loop
from .tracking import check_trackers, make_trackers
from .optimization import Optimization, OptimizerSettings
from .outputs import RunDir
from ..kernels.runtime import configure_threads


@dataclass
class GameSession:
    cfg: Config
    rules: Rules
    module: CatcherPolicy  # the parameters (saved, optimized)
    policy: nn.Module  # what is called: the module, or its torch.compile wrapper
    optimization: Optimization  # AdamW, schedule, clipping, NaN guard (train/optimization.py)


def compile_policy(module: nn.Module, enabled: bool, example: torch.Tensor, log: Callable[[str], None]) -> nn.Module:
    """torch.compile(module) when asked and it works here; else the module itself, saying why.

    The compiled module is run once on `example` so that a missing compiler
    toolchain fails here, with a logged fallback, not in the middle of a run.
    """
    if not enabled:
        return module
    try:
        compiled = torch.compile(module)
        compiled(example)
        with torch.no_grad():
            compiled(example)
        return compiled
    except Exception as error:  # inductor needs a C++ compiler; anything else is the same fallback
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        log(f"game.compile: torch.compile is unavailable here ({type(error).__name__}: {reason[:160]}); "
            "running the eager policy")
        return module


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """rewards (T, N) -> returns (T, N), G_t = sum_{k >= t} gamma^(k - t) r_k, as one matmul."""
    steps = rewards.shape[0]
    offsets = torch.arange(steps)[None, :] - torch.arange(steps)[:, None]  # (T, T) k - t
    discount = torch.where(offsets >= 0, gamma ** offsets.clamp(min=0).to(rewards.dtype), 0.0)  # (T, T)
    return discount @ rewards  # (T, N)


def game_advantages(episodes: Episodes, cfg: Config) -> torch.Tensor:
    """Advantages (T * N,) of every decision, step-major; games are group-major within a step."""
    returns = discounted_returns(episodes.rewards, cfg.game.gamma)  # (T, N), N = starts x G
    # (T, N) flattened row by row keeps each start's G games adjacent: groups of G, as the LM loop's.
    return group_advantages(returns.reshape(-1), cfg.game.games_per_start, cfg.algo.scale_rewards)


def learn(session: GameSession, episodes: Episodes, advantages: torch.Tensor) -> dict[str, float]:
    """num_iterations optimizer steps on one epoch of decisions; returns loss metrics."""
    cfg = session.cfg
    steps, num_games = episodes.actions.shape
    count = steps * num_games
    observations = episodes.observations.reshape(count, -1)  # (T*N, D)
    actions = episodes.actions.reshape(count, 1)  # (T*N, 1)
    mask = torch.ones(count, 1)  # (T*N, 1) every decision counts: one "token" per sequence
    loss_fn = LOSSES[cfg.algo.loss]
    settings = LossSettings(cfg.algo.epsilon, cfg.algo.epsilon_high, 0.0)  # no reference policy for games
    old_logps = None
    metrics: dict[str, float] = {}
    for _ in range(cfg.algo.num_iterations):
        log_probs = session.policy(observations).log_softmax(dim=1)  # (T*N, 3)
        chosen = log_probs.gather(1, actions)  # (T*N, 1)
        if old_logps is None:
            old_logps = chosen.detach()  # the sampling policy: nothing has been updated yet
        inputs = LossInputs(logps=chosen, old_logps=old_logps, ref_logps=None, advantages=advantages,
                            completion_mask=mask, total_tokens=float(count), total_sequences=count,
                            max_completion_length=1)
        loss, loss_metrics = loss_fn(inputs, settings)
        entropy = -(log_probs.exp() * log_probs).sum(dim=1).mean()
        session.optimization.backward(loss - cfg.game.entropy_coef * entropy)
        grad_norm = session.optimization.step(float(loss.detach()))
        metrics = {**loss_metrics, "loss": float(loss.detach()), "entropy": float(entropy.detach()),
                   "grad_norm": grad_norm}
    return metrics


def epoch_step(session: GameSession, epoch: int) -> dict[str, float]:
    """One GRPO epoch; returns its metrics record."""
    cfg, game = session.cfg, session.cfg.game
    lr = session.optimization.lr
    generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + epoch)
    started = time.perf_counter()
    starts = start_states(session.rules, game.num_starts, generator)  # (S, D)
    games = starts.repeat_interleave(game.games_per_start, dim=0)  # (S*G, D) group-major
    draws = None
    if game.shared_draws:  # the same fruits fall in every game of a group: only the actions differ
        draws = Draws.sample(session.rules, game.episode_steps, game.num_starts, generator)  # (T, S)
        draws = draws.repeat_games(game.games_per_start)  # (T, S*G)
    episodes = play(session.policy, games, session.rules, game.episode_steps, generator, draws=draws)
    advantages = game_advantages(episodes, cfg)  # (T*S*G,)
    played = time.perf_counter()
    metrics = learn(session, episodes, advantages)
    finished = time.perf_counter()
    scores = episodes.scores  # (N,)
    return {
        "step": epoch,
        "reward_mean": float(scores.mean()),  # the final score, mean over games
        "reward_std": float(scores.std()),
        "rewards/caught": float((episodes.rewards > 0).float().sum(dim=0).mean()),  # per game
        "rewards/missed": float((episodes.rewards < 0).float().sum(dim=0).mean()),
        "zero_variance_groups": zero_variance_fraction(scores, game.games_per_start),
        **metrics,
        "lr": lr,
        "time/generate": played - started,  # the rollout: the game's generation phase
        "time/learn": finished - played,
        "time/step": finished - started,
        "games_per_second": scores.numel() / (finished - started),
    }


def evaluate_game(policy: nn.Module | None, rules: Rules, cfg: Config, mode: str = "sample") -> dict[str, float]:
    """Mean final score (and catches, misses) over game.eval_games held-out games."""
    generator = torch.Generator().manual_seed(cfg.task.seed)
    starts = start_states(rules, cfg.game.eval_games, generator)
    episodes = play(policy, starts, rules, cfg.game.episode_steps, generator, mode)
    return {
        "score_mean": float(episodes.scores.mean()),
        "caught": float((episodes.rewards > 0).float().sum(dim=0).mean()),
        "missed": float((episodes.rewards < 0).float().sum(dim=0).mean()),
    }


def run_game_eval(session: GameSession) -> dict[str, float]:
    started = time.perf_counter()
    sampled = evaluate_game(session.policy, session.rules, session.cfg, "sample")
    greedy = evaluate_game(session.policy, session.rules, session.cfg, "greedy")
    return {**sampled, "score_greedy": greedy["score_mean"], "num_games": session.cfg.game.eval_games,
            "seconds": time.perf_counter() - started}


def evaluate_checkpoint(cfg: Config) -> dict[str, float]:
    """`hasten eval --task fruit-catcher --model CHECKPOINT`: the held-out eval, plus a random policy's score.

    The rules come from the checkpoint; game.eval_games, game.episode_steps
    and task.seed from `cfg`.
    """
    from ..games.policy import load_policy_checkpoint

    configure_threads(cfg.train.num_threads)
    policy, rules = load_policy_checkpoint(cfg.model.name)
    sampled = evaluate_game(policy, rules, cfg, "sample")
    return {**sampled, "score_greedy": evaluate_game(policy, rules, cfg, "greedy")["score_mean"],
            "random_score_mean": evaluate_game(None, rules, cfg, "random")["score_mean"],
            "num_games": cfg.game.eval_games}


def prepare_game(cfg: Config, log: Callable[[str], None] = print) -> GameSession:
    if cfg.algo.beta > 0:  # say so rather than ignore it: a game run keeps no reference policy
        raise ConfigError(f"config error: algo.beta must be 0 for {cfg.task.name} (got {cfg.algo.beta}): "
                          "game policies train without a reference model")
    configure_threads(cfg.train.num_threads)
    check_allocator(cfg.speed.allocator, log)  # asked for another than this process runs on: one line says so
    random.seed(cfg.train.seed)
    torch.manual_seed(cfg.train.seed)
    rules = Rules.from_config(cfg.game)
    module = CatcherPolicy(rules, cfg.game.hidden_size)
    example = torch.zeros(cfg.game.num_starts * cfg.game.games_per_start, rules.observation_size)
    policy = compile_policy(module, cfg.game.compile, example, log)
    optimization = Optimization(list(module.parameters()), OptimizerSettings.for_training(cfg), cfg.speed, log)
    return GameSession(cfg, rules, module, policy, optimization)


class GameJob:
    """Game epochs as the loop's Job; state = the optimization layer's (the epochs' draws are seeded by step)."""

    def __init__(self, session: GameSession):
        cfg = self.cfg = session.cfg
        self.session = session
        self.started = time.perf_counter()
        self.total_steps, self.eval_at_start, self.eval_every = cfg.train.steps, cfg.eval.at_start, cfg.eval.every
        self.resume_command = "hasten train --resume"
        self.random_policy = evaluate_game(None, session.rules, cfg, "random") if cfg.game.eval_games else {}

    def step(self, step: int) -> dict[str, Any]:
        return epoch_step(self.session, step)

    def evaluate(self, step: int, run: RunDir) -> dict[str, Any] | None:
        return run_game_eval(self.session) if self.cfg.game.eval_games else None

    def save_model(self, directory: Path) -> None:
        save_policy(self.session.module, self.session.rules, self.cfg.game.hidden_size, directory)

    def state_dict(self) -> dict[str, Any]:
        return {"optimization": self.session.optimization.state_dict()}

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        payload = torch.load(directory / POLICY_FILE, map_location="cpu", weights_only=True)
        with torch.no_grad():  # in place: the optimizer's state stays attached to these parameters
            for name, parameter in self.session.module.state_dict().items():
                parameter.copy_(payload["state_dict"][name])
        self.session.optimization.load_state_dict(state["optimization"])

    def summary(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"seconds": time.perf_counter() - self.started}
        if self.random_policy:
            extra["random_policy"] = self.random_policy
        return extra

    def close(self) -> None:
        pass


def train_policy(cfg: Config, log: Callable[[str], None] = print, resume: Path | None = None) -> dict:
    """Train a game policy with GRPO; the same run directory and summary shape as `trainer.train`."""
    check_trackers(cfg)  # before anything is written
    job = GameJob(prepare_game(cfg, log))
    run, checkpoint = loop.open_run(cfg, resume)
    return loop.run(job, cfg, run, log, checkpoint, created=resume is None, callbacks=make_trackers(cfg, run, list))
