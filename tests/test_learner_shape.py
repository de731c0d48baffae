"""The GRPO update reads in one screen (STYLE.md 22): `Learner.step` is log-probs, the loss from the registry,
backward, the optimizer. Optional terms are built into the loss inputs (train/step_inputs.py) or added by the
loss layer (algo/losses.add_optional_terms); rank reductions live with the optimizer and distributed.py."""

from __future__ import annotations

import ast
from pathlib import Path

LEARNER = Path(__file__).resolve().parent.parent / "hasten" / "train" / "learner.py"


def learner_step() -> ast.FunctionDef:
    tree = ast.parse(LEARNER.read_text())
    learner = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Learner")
    return next(node for node in learner.body if isinstance(node, ast.FunctionDef) and node.name == "step")


def test_step_is_under_forty_lines():
    step = learner_step()
    assert step.end_lineno - step.lineno < 40


def test_step_calls_the_registry_loss_backward_and_the_optimizer_without_feature_branches():
    source = ast.unparse(learner_step())
    for part in ("self.loss_fn(", "self.optimization.backward(", "self._logprobs(", "_optimizer_step("):
        assert part in source
    # rank reductions, the FSDP hook and the optional terms' settings are not read in the step itself
    for name in ("distributed.", "fsdp.", "entropy_term", "high_entropy_mask", "aux_loss", "top_entropy_quantile",
                 "skip_zero_advantage", "zero_missing_gradients"):
        assert name not in source, name
