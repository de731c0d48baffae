"""Samples that cannot move the weights are left out of the learning pass (speed.skip_zero_advantage).

With beta = 0 (no KL term, TRL's default) every policy-gradient loss here
(algo/losses.py) is, per token, -min(r * A, clip(r) * A), optionally times an
importance weight, times the loss mask. A sample whose advantage A is exactly
0 therefore has a loss of exactly 0 and a gradient of exactly 0, whatever its
log-probs are; so does a sample whose loss mask is empty (e.g. a truncated
completion under algo.mask_truncated_completions), with or without a KL term.
Yet the plain pass runs its forward and backward like any other sample's.

Those samples are common: a group whose rewards are all equal (all right, all
wrong) has A = 0 in every sample, and with integer rewards a sample whose
reward equals its group's mean has A = 0 too. On the demo (configs/demo.yaml)
about a quarter of the groups were all-equal in the first ten steps. TRL runs
them all.

What stays the same: every normaliser is the whole batch's (total tokens,
total sequences, the chunk's own tokens for bnpo and the clip metrics:
`LossInputs.chunk_mask`), so the loss and the gradient are the plain pass's
up to float rounding (fewer rows in the matmuls). When every sample of a step
is skipped, the gradient is a zero tensor, not None, so AdamW still decays
its moments as the plain path's zero gradient makes it do (and so for a
parameter only skipped samples touched, e.g. a mixture-of-experts expert).

What changes:
- `entropy`, and the sampler-mismatch metrics (`async/*`, `vllm/*`,
  `bf16_sampler/*`), are over the tokens that went through the pass (the
  plain pass's cover all of them); a step where none did reports none of
  them. All-equal groups are often the confident ones, so `entropy` reads a
  little higher than the plain pass's. `learn/skipped_samples` says what
  fraction was left out.
- A skipped sample's log-probs are never computed, so one that is not
  finite cannot make the loss NaN (0 * inf) and trip the NaN guard or the
  fp16 GradScaler as it would in the plain pass.
- With dropout (model.lora_dropout > 0) fewer rows draw fewer random
  numbers, so the masks differ from the plain pass's: equal in
  distribution, not within rounding.

Not with FSDP (every rank must run the same forwards: its all-gathers are
collectives); tests/test_zero_advantage.py compares gradients, losses and the
AdamW state both ways for every loss.
"""

from __future__ import annotations

import torch


def learning_rows(rows: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, beta: float,
                  entropy_bonus: bool = False) -> torch.Tensor:
    """The samples of `rows` (indices into the batch) whose loss can have a gradient, in order; `rows`
    itself when none is left out (the learner then knows the chunk is whole).

    advantages: (N,) of the whole batch; mask: (N, T) the loss mask. A sample
    is left out when its loss mask is empty, or, without a KL term (beta == 0)
    and without the entropy bonus (algo.entropy_coef), when its advantage is exactly 0.
    """
    keep = mask[rows.to(mask.device)].sum(dim=1).cpu() > 0
    if beta == 0 and not entropy_bonus:
        keep &= advantages[rows.to(advantages.device)].cpu() != 0
    return rows if bool(keep.all()) else rows[keep.to(rows.device)]
