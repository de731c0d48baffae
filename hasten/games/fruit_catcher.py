"""Fruit-catcher: a small falling-fruit game, vectorized over thousands of games at once.

Rules (one step, every game at once):
1. The sprite (sprite_width cells wide, on the bottom row y = height - 1)
   moves left / stays / moves right (actions 0 / 1 / 2), clamped to the grid.
2. Every active fruit falls one row.
3. A fruit that reaches the bottom row is caught (+1 score) when
   |x - sprite_x| <= sprite_width // 2, else missed (-1), and is deactivated.
4. Spawning: when no fruit was removed this step and 1 <= active < max_fruits,
   a fruit spawns with probability spawn_probability, but only if the
   top-most active fruit is already at y >= spawn_gap; when no fruit is
   active one spawns for sure. A new fruit takes the first free slot, at
   y = 0 and a uniform x.
Observation: (1 + 3 * max_fruits) floats [sprite_x, (x, y, active) per slot];
a free slot reads (0, 0, 0).

Choices:
- The state IS the observation tensor (N, D), plus a score (N,): no second
  representation to keep in sync.
- Randomness comes in as tensors (`Draws`: a coin and an x per game and
  step), drawn in one batched call per episode. That keeps the step free of
  host syncs and Python branching, and lets the per-game reference
  (`reference_step`, loops and .item() as one would write it plainly) be fed
  the very same draws, so tests can demand equality rather than statistics.
- Everything is exact small integers stored as float32, so the vectorized
  and the reference steps agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEFT, STAY, RIGHT = 0, 1, 2
NUM_ACTIONS = 3


@dataclass(frozen=True)
class Rules:
    width: int = 20
    height: int = 15
    sprite_width: int = 3
    max_fruits: int = 3
    spawn_gap: int = 5
    spawn_probability: float = 0.5

    @property
    def observation_size(self) -> int:
        return 1 + 3 * self.max_fruits

    @property
    def reach(self) -> int:
        """How far from its centre the sprite catches: 1 for a 3-cell sprite."""
        return self.sprite_width // 2

    @classmethod
    def from_config(cls, game) -> Rules:
        """Rules from a config.GameConfig section."""
        return cls(game.width, game.height, game.sprite_width, game.max_fruits, game.spawn_gap,
                   game.spawn_probability)


@dataclass
class Draws:
    """The random numbers of `steps` steps for N games, drawn up front."""

    coins: torch.Tensor  # (steps, N) uniform [0, 1): spawn when < spawn_probability
    spawn_x: torch.Tensor  # (steps, N) float, uniform integers in [0, width)

    @classmethod
    def sample(cls, rules: Rules, steps: int, num_games: int, generator: torch.Generator) -> Draws:
        coins = torch.rand(steps, num_games, generator=generator)  # (steps, N)
        spawn_x = torch.randint(0, rules.width, (steps, num_games), generator=generator).float()  # (steps, N)
        return cls(coins, spawn_x)

    def repeat_games(self, times: int) -> Draws:
        """Each game's draws `times` times over, adjacent: the draws of G games in a group."""
        return Draws(self.coins.repeat_interleave(times, dim=1), self.spawn_x.repeat_interleave(times, dim=1))


def start_states(rules: Rules, num_starts: int, generator: torch.Generator) -> torch.Tensor:
    """(num_starts, D): the sprite at a uniform column, one fruit at y = 0 and a uniform x."""
    state = torch.zeros(num_starts, rules.observation_size)
    state[:, 0] = torch.randint(0, rules.width, (num_starts,), generator=generator).float()
    state[:, 1] = torch.randint(0, rules.width, (num_starts,), generator=generator).float()  # fruit 0: x
    state[:, 3] = 1.0  # fruit 0: active (y = 0)
    return state


def step(state: torch.Tensor, actions: torch.Tensor, coins: torch.Tensor, spawn_x: torch.Tensor,
         rules: Rules) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance every game one step: (state (N, D), score change (N,)). Pure; no host syncs."""
    num_games = state.shape[0]
    fruits = state[:, 1:].view(num_games, rules.max_fruits, 3)  # (N, F, 3)
    x, y, active = fruits[..., 0], fruits[..., 1], fruits[..., 2] > 0  # (N, F) each
    sprite = (state[:, 0] + (actions - STAY).to(state.dtype)).clamp(0, rules.width - 1)  # (N,)

    y = y + active.to(y.dtype)  # active fruits fall one row
    landed = active & (y >= rules.height - 1)  # (N, F)
    caught = landed & ((x - sprite[:, None]).abs() <= rules.reach)
    change = caught.sum(dim=1) - (landed & ~caught).sum(dim=1)  # (N,) +1 per catch, -1 per miss
    active = active & ~landed

    count = active.sum(dim=1)  # (N,) fruits still falling
    top = torch.where(active, y, torch.full_like(y, float("inf"))).amin(dim=1)  # (N,) inf when none
    random_spawn = (~landed.any(dim=1) & (count >= 1) & (count < rules.max_fruits)
                    & (coins < rules.spawn_probability) & (top >= rules.spawn_gap))
    spawn = random_spawn | (count == 0)  # (N,)
    first_free = (~active).to(torch.int8).argmax(dim=1)  # (N,) first free slot (any, when spawn is False)
    new = torch.nn.functional.one_hot(first_free, rules.max_fruits).bool() & spawn[:, None]  # (N, F)

    active = active | new
    x = torch.where(new, spawn_x[:, None], x)
    y = torch.where(new, torch.zeros_like(y), y)
    keep = active.to(state.dtype)
    fruits = torch.stack([x * keep, y * keep, keep], dim=2)  # (N, F, 3) free slots read (0, 0, 0)
    return torch.cat([sprite[:, None], fruits.view(num_games, -1)], dim=1), change.to(state.dtype)


def reference_step(state: torch.Tensor, actions: torch.Tensor, coins: torch.Tensor, spawn_x: torch.Tensor,
                   rules: Rules) -> tuple[torch.Tensor, torch.Tensor]:
    """The same step written the plain way: a loop over games and fruits, .item() per value.

    The baseline of bench B6 and the oracle of the equivalence test; kept
    deliberately straightforward.
    """
    new_state = state.clone()
    changes = torch.zeros(state.shape[0])
    for game in range(state.shape[0]):
        sprite = state[game, 0].item()
        action = actions[game].item()
        if action == LEFT:
            sprite = max(0.0, sprite - 1)
        elif action == RIGHT:
            sprite = min(float(rules.width - 1), sprite + 1)
        new_state[game, 0] = sprite
        removed, change, count, top = False, 0.0, 0, None
        for slot in range(rules.max_fruits):
            base = 1 + 3 * slot
            if new_state[game, base + 2].item() == 0:
                continue
            y = new_state[game, base + 1].item() + 1
            new_state[game, base + 1] = y
            if y >= rules.height - 1:
                change += 1.0 if abs(new_state[game, base].item() - sprite) <= rules.reach else -1.0
                new_state[game, base:base + 3] = 0.0
                removed = True
            else:
                count += 1
                top = y if top is None else min(top, y)
        if count == 0:
            spawn = True
        else:
            spawn = (not removed and count < rules.max_fruits and coins[game].item() < rules.spawn_probability
                     and top >= rules.spawn_gap)
        if spawn:
            for slot in range(rules.max_fruits):
                base = 1 + 3 * slot
                if new_state[game, base + 2].item() == 0:
                    new_state[game, base] = spawn_x[game].item()
                    new_state[game, base + 1] = 0.0
                    new_state[game, base + 2] = 1.0
                    break
        changes[game] = change
    return new_state, changes


def render(state: torch.Tensor, rules: Rules, score: float | None = None) -> str:
    """One game's state (D,) as text: 'o' fruits, '===' the sprite, '.' empty cells.

    Fruits are drawn on rows 0..height-2 only: one that reaches the bottom row
    is scored and removed in that same step.
    """
    grid = [["."] * rules.width for _ in range(rules.height)]
    values = state.tolist()
    for slot in range(rules.max_fruits):
        x, y, active = values[1 + 3 * slot: 4 + 3 * slot]
        if active:
            grid[int(y)][int(x)] = "o"
    sprite = int(values[0])
    for column in range(max(0, sprite - rules.reach), min(rules.width, sprite + rules.reach + 1)):
        grid[rules.height - 1][column] = "="
    lines = ["".join(row) for row in grid]
    if score is not None:
        lines.append(f"score {score:+g}")
    return "\n".join(lines)
