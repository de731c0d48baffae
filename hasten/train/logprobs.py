"""Per-token log-probs of completions under a causal LM: the plain padded pass.

This is the reference path the fast paths are checked against: prompt
(left-padded) and completion (right-padded) are concatenated into one padded
batch, positions come from the attention mask, and logits are computed only
for the last T+1 positions (`logits_to_keep`), which hold exactly the
completion predictions because prompts are left-padded. Logits are divided by
the sampling temperature, as TRL does, so these log-probs are the ones the
engine reports for the tokens it sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenStats:
    logps: torch.Tensor  # (N, T) log-prob of each completion token
    entropy: torch.Tensor | None  # (N, T) only when asked for; detached unless entropy_grad
    aux_loss: torch.Tensor | None = None  # () a mixture-of-experts model's router load-balancing loss, when asked for


def completion_logprobs(
    model,
    prompt_ids: torch.Tensor,  # (N, P) left-padded, one row per sample
    prompt_mask: torch.Tensor,  # (N, P)
    completion_ids: torch.Tensor,  # (N, T)
    completion_mask: torch.Tensor,  # (N, T)
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    router_aux: bool = False,
) -> TokenStats:
    """entropy_grad: the entropy keeps its gradient (the entropy bonus, algo.entropy_coef). router_aux: a
    mixture-of-experts model also returns its load-balancing loss over the whole batch (prompt tokens
    included), as TRL asks for it (output_router_logits=True)."""
    device = next(model.parameters()).device
    width = completion_ids.shape[1]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1).to(device)  # (N, P+T)
    attention = torch.cat([prompt_mask, completion_mask], dim=1).to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    outputs = model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                    logits_to_keep=width + 1, **({"output_router_logits": True} if router_aux else {}))
    logits = outputs.logits[:, :-1]  # (N, T, V): position t predicts completion token t
    logits = logits.float() / temperature
    targets = completion_ids.to(device)
    # log p(token) = logit(token) - logsumexp(logits): avoids a second (N, T, V) tensor.
    logps = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # (N, T)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            log_probs = torch.log_softmax(logits if entropy_grad else logits.detach(), dim=-1)
            entropy = -(log_probs.exp() * log_probs).sum(-1)  # (N, T)
    return TokenStats(logps=logps, entropy=entropy, aux_loss=outputs.aux_loss if router_aux else None)
