"""The prompts' common prefix, computed once (speed.shared_prefix).

Prompts of one batch often begin with the same tokens: a chat template's
header, a system prompt, a few-shot or worked example. The demo
(configs/demo.yaml) puts one solved question before every question, so its
four prompts a step share most of their tokens, and its 64 evaluation
prompts share the same prefix. Without this, every prompt pays the full
forward (and, when learning, backward) of those tokens.

Where it applies:
- the packed learning pass with grouped attention (train/packing.py,
  kernels/grouped_attention.py): the prefix sits once, at the start of the
  first packed row; every row's prompt and completions attend to its keys
  and values (gathered across rows), so gradients from every group flow
  back into the one copy. Positions are unchanged: each row's own prompt
  tokens keep the positions they have after the prefix.
- the lean engine's prefill (rollout/lean.py): the prefix runs as one
  sequence, then every prompt's remainder runs against its keys and
  values; the decode steps see the same K/V as before.

Each prompt keeps at least its last token of its own (that position gives
the first logits), so a batch of identical prompts shares all but one
token. The math is the same as without it: only the float rounding of the
prefix's matmuls differs (they run on fewer rows). tests/test_shared_prefix.py
compares log-probs, entropies, gradients and sampled rollouts both ways.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def common_prefix(prompts: Sequence[Sequence[int] | torch.Tensor]) -> int:
    """The number of leading tokens every prompt shares, leaving each at least one token of its own;
    0 for fewer than two prompts (nothing to share)."""
    if len(prompts) < 2:
        return 0
    lists = [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    limit = min(len(p) for p in lists) - 1
    first = lists[0]
    length = 0
    while length < limit and all(p[length] == first[length] for p in lists[1:]):
        length += 1
    return max(length, 0)
