"""The entropy bonus's coefficient: constant, or TRL's adaptive control (Skywork-OR1, arXiv:2505.22312).

The bonus (losses.entropy_term) keeps the policy from collapsing to
near-deterministic outputs: loss = policy loss - coefficient x H, H the mean
per-token entropy. Its coefficient is algo.entropy_coef (TRL's entropy_coef).
With algo.adaptive_entropy (TRL's use_adaptive_entropy) the coefficient moves
after every optimizer step, exactly as TRL 1.16 moves it:

- the step applies the coefficient only when the previous step's entropy was
  at or below algo.entropy_target (the first step: never, as TRL starts from
  an entropy of +inf);
- after the step, with H the entropy over the step's tokens (summed over its
  chunks, token-weighted), the coefficient goes up by algo.entropy_coef_delta
  when H <= target and down otherwise, within [entropy_coef_min, entropy_coef_max].

The controller's state (coefficient, last entropy) is part of the learner's
checkpoint state, so a resumed run continues it (TRL's entropy_ctrl_state.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EntropySettings:
    coef: float = 0.0  # algo.entropy_coef: the bonus's coefficient (adaptive: its start)
    adaptive: bool = False  # algo.adaptive_entropy
    coef_min: float = 0.0
    coef_max: float = 1.0
    coef_delta: float = 0.005
    target: float = 0.2  # nats per token

    @property
    def enabled(self) -> bool:
        """The bonus is in the loss (TRL: entropy_coef != 0 or adaptive, even after a decrement to 0)."""
        return self.coef != 0.0 or self.adaptive


class EntropyControl:
    """The coefficient each optimizer step applies, and its update from the step's entropy."""

    def __init__(self, settings: EntropySettings):
        self.settings = settings
        self.coef = settings.coef
        self.last_entropy = math.inf  # no measurement yet: adaptive control applies nothing at first

    def applied(self) -> float:
        """The coefficient this optimizer step applies."""
        if not self.settings.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.settings.target else 0.0

    def update(self, entropy_sum: float, tokens: float) -> None:
        """After an optimizer step: `entropy_sum` over its `tokens` (the bonus's tokens, every chunk, every rank)."""
        if not self.settings.adaptive:
            return
        settings = self.settings
        entropy = entropy_sum / max(tokens, 1.0)
        if entropy <= settings.target:
            self.coef = min(self.coef + settings.coef_delta, settings.coef_max)
        else:
            self.coef = max(self.coef - settings.coef_delta, settings.coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last_entropy = float(state["coef"]), float(state["last_entropy"])
