"""B6 of `hasten bench`: fruit-catcher GRPO epochs/s, vectorized against the plain way.

Three rows, measured in alternation (one epoch of each per round, A B C A B C):
  hasten vectorized        train/policy_loop.epoch_step: the game stepped on
                           tensors for all games at once (no host syncs), one
                           learning pass over every decision;
  hasten compiled          the same with game.compile (torch.compile of the
                           policy); when compile cannot run here the row is
                           left out and a note says why (the logged fallback);
  reference per-step       the seed recipe written the plain way: the policy
                           queried for all games each step (as the seed did),
                           the game advanced by `reference_step` (a Python loop
                           over games and fruits with .item() calls), returns
                           and group normalisation in Python loops, and the
                           loss summed step by step over 100 forward passes.
Same rules, sizes (17 starts x 32 games x 100 steps; --quick: 2 x 4 x 10),
policy width, seeds, optimizer and REINFORCE-style loss (one pass per epoch:
algo.num_iterations 1, the recipe's). Each side trains its own copy of the
same initial policy for `rounds` epochs; the score column is the mean final
score of each side's last epoch (all start near random: the figure for
learning is `hasten train --task fruit-catcher`, docs/games.md).

Both sides run on train.num_threads threads of the fruit-catcher defaults
(1: the game's ops are small). Rollouts of the reference run under no_grad,
like hasten's: not crippled.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from ..config import load_config
from ..games.fruit_catcher import Rules, reference_step, start_states
from ..games.policy import CatcherPolicy
from ..train.optimization import Optimization, OptimizerSettings
from ..train.policy_loop import GameSession, compile_policy, epoch_step
from .report import Result, Row

QUICK_GAME = [("game.num_starts", 2), ("game.games_per_start", 4), ("game.episode_steps", 10),
              ("game.hidden_size", 16)]


def b6_config(quick: bool):
    overrides = [("task.name", "fruit-catcher"), ("algo.num_iterations", 1), ("output.progress", "off")]
    return load_config(overrides=overrides + (QUICK_GAME if quick else []))


def reference_epoch(policy: CatcherPolicy, optimization: Optimization, rules: Rules, cfg, epoch: int) -> float:
    """One epoch of the seed recipe, the plain way; returns the mean final score."""
    game = cfg.game
    generator = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + epoch)
    state = start_states(rules, game.num_starts, generator).repeat_interleave(game.games_per_start, dim=0)
    num_games = state.shape[0]
    observations, actions, rewards = [], [], []
    for _ in range(game.episode_steps):
        with torch.no_grad():
            probs = policy(state).softmax(dim=1)
        action = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        coins = torch.rand(num_games, generator=generator)
        spawn_x = torch.randint(0, rules.width, (num_games,), generator=generator).float()
        observations.append(state)
        actions.append(action)
        state, change = reference_step(state, action, coins, spawn_x, rules)
        rewards.append(change)
    returns, running = [None] * game.episode_steps, torch.zeros(num_games)
    for t in reversed(range(game.episode_steps)):
        running = rewards[t] + game.gamma * running
        returns[t] = running
    total_loss = 0.0
    for t in range(game.episode_steps):
        grouped = returns[t].view(game.num_starts, game.games_per_start)
        advantages = ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)).view(-1)
        log_probs = policy(observations[t]).log_softmax(dim=1)
        chosen = log_probs[torch.arange(num_games), actions[t]]
        entropy = -(log_probs.exp() * log_probs).sum(dim=1).mean()
        total_loss = total_loss + (-(chosen * advantages).mean() - game.entropy_coef * entropy) / game.episode_steps
    total_loss.backward()
    optimization.step(float(total_loss.detach()))  # clip, AdamW, schedule: the same update as hasten's side
    return float(sum(rewards).mean())


def _session(cfg, module: CatcherPolicy, compiled: bool, log) -> GameSession:
    rules = Rules.from_config(cfg.game)
    example = torch.zeros(cfg.game.num_starts * cfg.game.games_per_start, rules.observation_size)
    policy = compile_policy(module, compiled, example, log)
    return GameSession(cfg, rules, module, policy, _optimization(module, cfg))


def _optimization(module: torch.nn.Module, cfg) -> Optimization:
    return Optimization(list(module.parameters()), OptimizerSettings.for_training(cfg), cfg.speed, lambda text: None)


def run_b6(opts) -> Result:
    cfg = b6_config(opts.quick)
    rounds = opts.rounds("B6")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.train.num_threads or threads)
    try:
        return _measure(cfg, rounds, opts)
    finally:
        torch.set_num_threads(threads)


def _measure(cfg, rounds: int, opts) -> Result:
    game = cfg.game
    result = Result("B6", f"fruit-catcher GRPO epoch: {game.num_starts} starts x {game.games_per_start} games x "
                          f"{game.episode_steps} steps (s/epoch; ratio = reference / hasten)")
    rules = Rules.from_config(game)
    torch.manual_seed(cfg.train.seed)
    initial = CatcherPolicy(rules, game.hidden_size)
    fallback: list[str] = []
    sides: dict[str, Any] = {"hasten vectorized": _session(cfg, copy.deepcopy(initial), False, opts.log)}
    started = time.perf_counter()
    compiled = _session(cfg, copy.deepcopy(initial), True, fallback.append)
    compile_seconds = time.perf_counter() - started
    if fallback:
        result.notes.append(f"compiled row left out: {fallback[0]}")
        opts.log(fallback[0])
    else:
        sides["hasten compiled"] = compiled
    reference = copy.deepcopy(initial)
    reference_optimization = _optimization(reference, cfg)
    for name, session in sides.items():  # one unmeasured epoch: allocator and (compile) graph warm-up
        opts.log(f"B6: warm-up epoch, {name}")
        epoch_step(session, 0)

    seconds: dict[str, list[float]] = {name: [] for name in [*sides, "reference per-step"]}
    scores: dict[str, float] = {}
    for round_index in range(rounds):
        opts.log(f"B6: round {round_index + 1}/{rounds}")
        for name, session in sides.items():
            begun = time.perf_counter()
            scores[name] = epoch_step(session, round_index + 1)["reward_mean"]
            seconds[name].append(time.perf_counter() - begun)
        begun = time.perf_counter()
        scores["reference per-step"] = reference_epoch(reference, reference_optimization, rules,
                                                       cfg, round_index + 1)
        seconds["reference per-step"].append(time.perf_counter() - begun)

    for name in sides:
        extra = {"epochs_per_s": len(seconds[name]) / sum(seconds[name]), "score": scores[name]}
        if name == "hasten compiled":
            extra["compile_s"] = compile_seconds
        result.rows.append(Row(name, "hasten", "s/epoch", seconds[name], extra=extra))
    name = "reference per-step"
    result.rows.append(Row(name, "peer", "s/epoch", seconds[name], baseline="hasten vectorized",
                           extra={"epochs_per_s": len(seconds[name]) / sum(seconds[name]), "score": scores[name]}))
    result.settings["both"] = {"starts": game.num_starts, "games_per_start": game.games_per_start,
                               "steps": game.episode_steps, "hidden_size": game.hidden_size, "lr": cfg.train.lr,
                               "gamma": game.gamma, "entropy_coef": game.entropy_coef, "num_iterations": 1,
                               "threads": torch.get_num_threads(), "rounds": rounds}
    result.notes.append("score: mean final score of each side's last measured epoch (near random after a few "
                        "epochs; learning curves come from `hasten train --task fruit-catcher`)")
    return result
