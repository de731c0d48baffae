"""SFT batches and their loss: packed rows with a block mask, or the plain padded batch.

An example is prompt ids + completion ids (the reasoning and EOS). Only
completion tokens are targets: the prompt is context, never learned. A
multi-turn tool conversation (sft.source=task, rft/demonstrations.py) also
carries `target_mask` over its completion: 0 marks tool-result tokens, which
the model reads as context but never learns (GRPO's tool_mask).

Packed (sft.packing, the fast path): examples are placed first-fit
decreasing into rows of at most `pack_length` tokens,

    [prompt 1 completion 1][prompt 2 completion 2][prompt 3 ...]  (one row)

with a block-diagonal causal mask (train/packing.py's `block_mask`, every
example its own segment) and positions restarting at 0 for every example,
so each example sees exactly what it would see alone. The last completion
token is only a target, so it is not an input. Logits are computed only at
the positions that predict a completion token, in checkpointed chunks: the
49k-wide vocabulary projection never runs on prompt tokens, and the full
(tokens x vocab) matrix never exists.

Padded (the plain path, what a transformers Trainer does): examples are
right-padded to the longest, labels are -100 on prompt and padding, and
the logits of every position are computed.

Both return the SUM of the per-token negative log-likelihood and the number
of target tokens; the caller divides by the optimizer batch's total, so
gradient accumulation over micro-batches equals one big batch, and the two
paths give the same loss and gradients (tests/test_rft.py, 1e-4 in fp32).

`eval_loss` is the padded path without gradients, in eval mode: the SFT
eval loss (TRL's eval_loss, mean_token_accuracy, entropy) of an example set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..train.packing import block_mask, backbone_and_head

IGNORE = -100  # label of a position that is not a target (transformers' convention)


@dataclass(frozen=True)
class Example:
    prompt_ids: list[int]
    completion_ids: list[int]  # the targets: reasoning tokens then EOS
    target_mask: tuple[int, ...] | None = None  # per completion token, 1 = a target; None = all are

    def __post_init__(self):
        if self.target_mask is not None and len(self.target_mask) != len(self.completion_ids):
            raise ValueError(f"target_mask has {len(self.target_mask)} entries for "
                             f"{len(self.completion_ids)} completion tokens")

    @property
    def input_length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids) - 1  # the last token is only a target

    @property
    def num_targets(self) -> int:
        return len(self.completion_ids) if self.target_mask is None else sum(self.target_mask)

    def is_target(self, index: int) -> bool:
        return self.target_mask is None or bool(self.target_mask[index])


@dataclass
class PackedSFTBatch:
    input_ids: torch.Tensor  # (R, L) examples packed in rows, zero-padded at the end of short rows
    position_ids: torch.Tensor  # (R, L) restarting at 0 for every example
    attention_mask: torch.Tensor  # (R, 1, L, L) bool, True = may attend
    source_row: torch.Tensor  # (M,) row of the position that predicts each target
    source_position: torch.Tensor  # (M,) its column
    targets: torch.Tensor  # (M,) the completion token predicted there

    @property
    def num_targets(self) -> int:
        return self.targets.numel()


@dataclass
class PaddedSFTBatch:
    input_ids: torch.Tensor  # (B, L) right-padded
    attention_mask: torch.Tensor  # (B, L) 1 = real token
    labels: torch.Tensor  # (B, L) the token itself on completion positions, IGNORE elsewhere

    @property
    def num_targets(self) -> int:
        return int((self.labels[:, 1:] != IGNORE).sum())


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= capacity, longest first (an oversize item gets a bin)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for slot, free in enumerate(room):
            if lengths[index] <= free:
                bins[slot].append(index)
                room[slot] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(capacity - lengths[index])
    return bins


def pack_examples(examples: list[Example], pack_length: int) -> PackedSFTBatch:
    rows = first_fit([example.input_length for example in examples], pack_length)
    width = max(sum(examples[i].input_length for i in row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)  # -1 = padding (packing.PAD_SEGMENT)
    sources: list[tuple[int, int, int]] = []  # (row, position, target)
    for row, members in enumerate(rows):
        offset = 0
        for segment, index in enumerate(members, start=1):  # segment 0 would be a shared prefix; none here
            example = examples[index]
            tokens = example.prompt_ids + example.completion_ids
            length = example.input_length
            input_ids[row, offset:offset + length] = torch.tensor(tokens[:-1])
            position_ids[row, offset:offset + length] = torch.arange(length)
            segments[row, offset:offset + length] = segment
            first_source = offset + len(example.prompt_ids) - 1  # the last prompt token predicts completion[0]
            sources += [(row, first_source + j, token) for j, token in enumerate(example.completion_ids)
                        if example.is_target(j)]
            offset += length
    source = torch.tensor(sources, dtype=torch.long)  # (M, 3)
    return PackedSFTBatch(input_ids, position_ids, block_mask(segments), *source.unbind(dim=1))


def pad_examples(examples: list[Example], pad_token_id: int) -> PaddedSFTBatch:
    width = max(len(e.prompt_ids) + len(e.completion_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, example in enumerate(examples):
        tokens = torch.tensor(example.prompt_ids + example.completion_ids)
        input_ids[row, :tokens.numel()] = tokens
        attention_mask[row, :tokens.numel()] = 1
        labels[row, len(example.prompt_ids):tokens.numel()] = tokens[len(example.prompt_ids):]
        if example.target_mask is not None:  # tool-result tokens: context, not targets
            start = len(example.prompt_ids)
            masked = torch.tensor(example.target_mask, dtype=torch.bool).logical_not()
            labels[row, start:start + masked.numel()][masked] = IGNORE
    return PaddedSFTBatch(input_ids, attention_mask, labels)


def _token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, dft: bool) -> torch.Tensor:
    """Sum over targets of -log p (nll), or of -p.detach() x log p (dft: DFT's reward-rectified SFT, as
    TRL's dft_loss); ignored targets add 0."""
    nll = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="none")  # (n,)
    return (nll * torch.exp(-nll).detach()).sum() if dft else nll.sum()


@dataclass
class TokenTally:
    """What a training pass counts beside its loss: targets whose most likely token is the target (TRL's
    mean_token_accuracy is correct / targets)."""

    correct: float = 0.0


def _correct(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many targets are the argmax of their logits (n, V) x (n,); ignored targets never count."""
    return ((logits.detach().argmax(-1) == targets) & (targets != IGNORE)).sum()


def _chunk_nll(head, hidden: torch.Tensor, targets: torch.Tensor, dft: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()  # (chunk, V); fp32 for the softmax whatever the autocast dtype
    return _token_loss_sum(logits, targets, dft), _correct(logits, targets)


def packed_nll_sum(model, batch: PackedSFTBatch, chunk_tokens: int = 1024, backbone=None,
                   dft: bool = False, tally: TokenTally | None = None) -> torch.Tensor:
    """Sum of -log p(target) over the batch's completion tokens, from a packed pass.

    `backbone` replaces the decoder call (a torch.compile'd one); default: the model's own.
    tally: gets the count of correctly predicted targets (from the forward; a recompute adds nothing).
    """
    decoder, head = backbone_and_head(model)
    device = head.weight.device
    hidden = (backbone or decoder)(
        input_ids=batch.input_ids.to(device),
        attention_mask=batch.attention_mask.to(device),
        position_ids=batch.position_ids.to(device),
    ).last_hidden_state  # (R, L, H)
    hidden = hidden[batch.source_row.to(device), batch.source_position.to(device)]  # (M, H)
    targets = batch.targets.to(device)  # (M,)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (head, hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens], dft)
        # Recomputed in backward: a chunk's (chunk x 49k) logits are the largest activation of the pass.
        nll, correct = (checkpoint(_chunk_nll, *args, use_reentrant=False) if torch.is_grad_enabled()
                        else _chunk_nll(*args))
        total = total + nll
        if tally is not None:
            tally.correct += float(correct)
    return total


def padded_nll_sum(model, batch: PaddedSFTBatch, backbone=None, router_aux: bool = False, dft: bool = False,
                   tally: TokenTally | None = None):
    """The plain reference: full logits on every position of a padded batch, prompt and padding ignored.
    router_aux: returns (nll, the mixture-of-experts model's router load-balancing loss over the batch's
    unpadded tokens) instead, as the model's own forward computes it (output_router_logits=True).
    tally: gets the count of correctly predicted targets."""
    device = next(model.parameters()).device
    forward = backbone or model
    outputs = forward(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                      **({"output_router_logits": True} if router_aux else {}))
    # (B, L, V): a prompt-tuning peft model returns its virtual tokens' logits first; the inputs' are the last L
    logits = outputs.logits[:, -batch.input_ids.shape[1]:]
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])  # (B*(L-1), V): position t predicts t+1
    targets = batch.labels[:, 1:].reshape(-1).to(device)  # (B*(L-1),)
    nll = _token_loss_sum(shifted, targets, dft)
    if tally is not None:
        tally.correct += float(_correct(shifted, targets))
    return (nll, outputs.aux_loss) if router_aux else nll


@dataclass
class EvalLoss:
    """Sums over an eval set's target tokens; the means are what TRL logs (eval_loss, mean_token_accuracy,
    entropy). logits / labels: each batch's (B, L, V) logits and (B, L) labels, when kept."""

    loss_sum: float = 0.0
    targets: float = 0.0
    correct: float = 0.0
    entropy_sum: float = 0.0
    logits: list[torch.Tensor] | None = None
    labels: list[torch.Tensor] | None = None

    def means(self) -> dict[str, float]:
        count = max(self.targets, 1.0)
        return {"loss": self.loss_sum / count, "mean_token_accuracy": self.correct / count,
                "entropy": self.entropy_sum / count}


def eval_loss(model, examples: list[Example], pad_token_id: int, batch_size: int, keep_logits: bool = False
              ) -> EvalLoss:
    """The loss training takes (padded batches, the same targets), without gradients and in eval mode, in
    batches of `batch_size` examples; keep_logits keeps what transformers' compute_metrics receives."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    found = EvalLoss(logits=[] if keep_logits else None, labels=[] if keep_logits else None)
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = pad_examples(examples[start:start + batch_size], pad_token_id)
            logits = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device)
                           ).logits[:, -batch.input_ids.shape[1]:].float()  # (B, L, V): as padded_nll_sum
            predictions = logits[:, :-1]  # (B, L-1, V): position t predicts token t+1
            targets = batch.labels[:, 1:].to(device)  # (B, L-1)
            counted = targets != IGNORE  # (B, L-1)
            found.loss_sum += float(_token_loss_sum(predictions.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                    dft=False))
            found.targets += float(counted.sum())
            found.correct += float(((predictions.argmax(-1) == targets) & counted).sum())  # TRL's token accuracy
            log_probs = torch.log_softmax(predictions, dim=-1)
            found.entropy_sum += float((-(log_probs.exp() * log_probs).sum(-1) * counted).sum())
            if keep_logits:
                found.logits.append(logits.cpu())
                found.labels.append(batch.labels)
    model.train(was_training)
    return found
