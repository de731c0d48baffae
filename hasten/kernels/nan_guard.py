"""NaN/Inf guard (speed.nan_guard): never apply an update built from a non-finite loss or gradient.

Before each optimizer step the learner asks `allow(loss, grad_norm)`. A
non-finite value skips the step (gradients are dropped and the lr schedule
does not advance: as if the update never happened) and is logged. After
nan_guard_patience skipped steps in a row it acts, per nan_guard_action:

    lower_lr                 multiply the learning rate by nan_guard_lr_factor
    disable_mixed_precision  switch autocast off (fp32 from then on)
    stop                     raise TrainingDiverged: the run stops, no NaN weights saved

A finite step resets the count. The gradient norm is the one clipping already
computes (clip_grad_norm_ returns it, inf or NaN included), so the guard
costs one host sync per optimizer step.
"""

from __future__ import annotations

import math
from typing import Callable

from ..config import SpeedConfig
from ..errors import UserError


class TrainingDiverged(UserError):
    """Non-finite losses or gradients for nan_guard_patience steps in a row, with action=stop."""


class NanGuard:
    def __init__(self, speed: SpeedConfig, lower_lr: Callable[[float], None], disable_mixed_precision: Callable[[], None],
                 log: Callable[[str], None] = print):
        self.patience = speed.nan_guard_patience
        self.action = speed.nan_guard_action
        self.lr_factor = speed.nan_guard_lr_factor
        self.lower_lr = lower_lr
        self.disable_mixed_precision = disable_mixed_precision
        self.log = log
        self.in_a_row = 0
        self.skipped = 0  # over the run
        self.actions = 0

    def allow(self, loss: float, grad_norm: float) -> bool:
        """True: apply the update. False: skip it (and maybe act)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        self.log(f"nan guard: skipped an update (loss {loss}, grad norm {grad_norm}; {self.in_a_row} in a row)")
        if self.in_a_row >= self.patience:
            self.in_a_row = 0
            self.actions += 1
            if self.action == "stop":
                raise TrainingDiverged(f"training diverged: non-finite loss or gradient in {self.patience} "
                                       "updates in a row (speed.nan_guard_action=stop)")
            if self.action == "lower_lr":
                self.lower_lr(self.lr_factor)
                self.log(f"nan guard: learning rate multiplied by {self.lr_factor}")
            else:
                self.disable_mixed_precision()
                self.log("nan guard: mixed precision switched off (fp32 from now on)")
        return False

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped, "actions": self.actions}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row, self.skipped, self.actions = state["in_a_row"], state["skipped"], state["actions"]
