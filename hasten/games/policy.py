"""The fruit-catcher policy (an MLP over observations) and episode rollouts.

The seed's policy was 10 -> 2048 -> 2048 -> 3 (~4M parameters) with GELU and
a residual LayerNorm. This is the same shape at width game.hidden_size
(default 128, ~18k parameters): on 2 CPU cores one epoch is 54,400
observations through the net twice (rollout, then learning), and at width
2048 that alone would cost seconds per epoch for a game a small net
already masters (docs/games.md has the numbers).

Observations are scaled to [0, 1] inside the module (x by width, y by
height), so the raw game state goes in and checkpoints need no separate
normalizer.

`play` runs whole episodes: it is the rollout of one GRPO epoch and also
the evaluator and `hasten play`. The policy is queried once per step for
all games together; actions are sampled from its softmax (or argmax when
greedy, or uniform for the random baseline).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from .fruit_catcher import NUM_ACTIONS, Draws, Rules, step

POLICY_FILE = "policy.pt"


class CatcherPolicy(nn.Module):
    """obs (N, D) -> action logits (N, 3): in -> GELU -> residual [LayerNorm -> Linear -> GELU] -> out."""

    def __init__(self, rules: Rules, hidden_size: int):
        super().__init__()
        scale = torch.ones(rules.observation_size)
        scale[0] = 1.0 / rules.width
        scale[1::3] = 1.0 / rules.width  # fruit x
        scale[2::3] = 1.0 / rules.height  # fruit y (active flags stay 0/1)
        self.register_buffer("scale", scale)
        self.inp = nn.Linear(rules.observation_size, hidden_size)
        self.norm = nn.LayerNorm(hidden_size)
        self.hidden = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, NUM_ACTIONS)
        # A near-zero output layer starts the policy near uniform: maximum
        # exploration, and group returns that differ by chance only.
        nn.init.normal_(self.out.weight, std=0.01)
        nn.init.zeros_(self.out.bias)

    def forward(self, observations: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.inp(observations * self.scale))  # (N, H)
        h = h + nn.functional.gelu(self.hidden(self.norm(h)))  # (N, H)
        return self.out(h)  # (N, 3)


@dataclass
class Episodes:
    """What a rollout keeps: enough to recompute log-probs and score every step."""

    observations: torch.Tensor  # (T, N, D) the state each action was chosen in
    actions: torch.Tensor  # (T, N) int64
    rewards: torch.Tensor  # (T, N) score change of each step
    final_states: torch.Tensor  # (N, D)

    @property
    def scores(self) -> torch.Tensor:
        return self.rewards.sum(dim=0)  # (N,) final score of each game


@torch.no_grad()
def play(policy: nn.Module | None, starts: torch.Tensor, rules: Rules, steps: int, generator: torch.Generator,
         mode: str = "sample", draws: Draws | None = None) -> Episodes:
    """Play `steps` steps from each row of `starts` (N, D).

    mode: "sample" (the policy's softmax), "greedy" (argmax) or "random"
    (uniform actions; `policy` may be None). `draws` are the spawn draws
    (steps, N); None draws fresh ones per game.
    """
    num_games = starts.shape[0]
    draws = Draws.sample(rules, steps, num_games, generator) if draws is None else draws
    observations = torch.empty(steps, num_games, rules.observation_size)  # (T, N, D)
    actions = torch.empty(steps, num_games, dtype=torch.long)  # (T, N)
    rewards = torch.empty(steps, num_games)  # (T, N)
    # The action draws are made up front too: one uniform per game and step.
    uniforms = torch.rand(steps, num_games, 1, generator=generator)  # (T, N, 1)
    state = starts
    for t in range(steps):
        observations[t] = state
        if mode == "random":
            actions[t] = (uniforms[t, :, 0] * NUM_ACTIONS).long().clamp(max=NUM_ACTIONS - 1)
        else:
            logits = policy(state)  # (N, 3)
            if mode == "greedy":
                actions[t] = logits.argmax(dim=1)
            else:
                # Inverse-CDF sampling with the pre-drawn uniforms: no per-step
                # generator calls, same result as a categorical draw.
                cdf = logits.softmax(dim=1).cumsum(dim=1)  # (N, 3)
                actions[t] = (uniforms[t] > cdf).sum(dim=1).clamp(max=NUM_ACTIONS - 1)
        state, rewards[t] = step(state, actions[t], draws.coins[t], draws.spawn_x[t], rules)
    return Episodes(observations, actions, rewards, state)


def save_policy(policy: CatcherPolicy, rules: Rules, hidden_size: int, directory: Path) -> Path:
    """Write directory/policy.pt: weights plus the rules and width to rebuild the module."""
    target = directory / POLICY_FILE
    state = {name: tensor.detach().clone() for name, tensor in _plain(policy).state_dict().items()}
    torch.save({"state_dict": state, "rules": asdict(rules), "hidden_size": hidden_size}, target)
    return target


def load_policy_checkpoint(path: str | Path) -> tuple[CatcherPolicy, Rules]:
    """A checkpoint directory (or its policy.pt) -> (policy in eval mode, rules)."""
    from ..errors import UserError

    path = Path(path)
    file = path / POLICY_FILE if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"checkpoint error: no {POLICY_FILE} at '{path}' (pass a fruit-catcher run's checkpoint/)")
    payload = torch.load(file, map_location="cpu", weights_only=True)
    rules = Rules(**payload["rules"])
    policy = CatcherPolicy(rules, payload["hidden_size"])
    policy.load_state_dict(payload["state_dict"])
    return policy.eval(), rules


def _plain(module: nn.Module) -> nn.Module:
    """The module under a torch.compile wrapper (its state_dict keys carry a prefix otherwise)."""
    return getattr(module, "_orig_mod", module)
