"""Where bf16 learning loses bits: one GRPO gradient under precision variants, against float64 (dev tool).

    .venv/bin/python dev/precision_audit.py [--out docs/results/DATE-precision/audit.json]

Takes one B1 rollout of SmolLM2-135M (generated once, cached in /tmp/hasten-b1-rollout.pt, as
dev/profile_learn.py), its group advantages (zero ones replaced by random ones, so every sample has a
gradient), and the DAPO policy-gradient loss with mu = 1 (ratio = 1, so the gradient is
-sum(A * grad log p) / tokens). The gradient of that loss is computed:

- in float64 (the reference), and in fp32;
- under the learning precisions hasten offers (train.precision: bf16 = full autocast, bf16_fp32head =
  autocast body, fp32 head and log-softmax);
- with bf16 rounding emulated in one op class at a time, everything else fp32, to say where the bits go:
  the head's inputs, the head's output (the logits), the attention projections, the MLP, the weight
  gradients' rounding to bf16.

For each it prints the relative error ||g - g64|| / ||g64|| of the whole gradient and per part (embedding
and tied head, attention, MLP, norms), the cosine with g64, and the mean |log p - log p64|. Numbers, not a
benchmark: nothing here is timed. The results page cites its output.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

from hasten.config import load_config
from hasten.kernels.precision import Precision, fp32_head
from hasten.train.packing import backbone_and_head, packed_logprobs

BF16 = torch.bfloat16
REFERENCE = "/tmp/hasten-b1-grad64.pt"  # the float64 gradient of the cached rollout


def rollout_and_advantages(cfg):
    from hasten.algo import group_advantages
    from hasten.rewards import score_rewards
    from hasten.rewards.batch import reward_inputs
    from hasten.rollout import SamplingParams
    from hasten.rollout.prompts import encode_prompt
    from hasten.tasks.sampler import PromptSampler
    from hasten.train.trainer import prepare

    session = prepare(cfg, log=lambda text: None)
    rows = PromptSampler(session.task.train_rows, cfg.train.seed).next(cfg.train.prompts_per_step)
    cache = "/tmp/hasten-b1-rollout.pt"
    if os.path.exists(cache):
        rollout = torch.load(cache, weights_only=False)
    else:
        prompts = [encode_prompt(session.policy.tokenizer, row["prompt"]) for row in rows]
        rollout = session.engine.generate(prompts, 8, SamplingParams(64, 1.0, 1.0, 0), seed=0)
        torch.save(rollout, cache)
    inputs = reward_inputs(session.policy.tokenizer, rows, rollout)
    scores = score_rewards(session.rewards, inputs.prompts, inputs.completions, inputs.columns,
                           inputs.completion_ids)
    advantages = group_advantages(scores.total, 8, "group")
    generator = torch.Generator().manual_seed(0)
    advantages = torch.where(advantages == 0, torch.randn(advantages.shape, generator=generator), advantages)
    return session.policy.model, rollout, advantages


def part_of(name: str) -> str:
    if "embed" in name or "lm_head" in name:
        return "embedding+head"
    if "self_attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    return "norms"


@contextlib.contextmanager
def bf16_linears(model, names: set[str], round_output: bool = True, round_inputs: bool = True):
    """The named Linears compute with bf16-rounded inputs and weight (and output, if round_output); fp32 else."""
    patched = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(part in name for part in names):
            def forward(x, module=module):
                weight = module.weight
                if round_inputs:
                    x, weight = x.to(BF16).float(), weight.to(BF16).float()  # exact products, fp32 sums
                out = F.linear(x, weight, module.bias)
                return out.to(BF16).float() if round_output else out
            module.forward = forward
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


@contextlib.contextmanager
def bf16_weight_grads(model):
    """Every weight gradient rounded to bf16 as it arrives (autocast's bf16 weight-gradient matmul output)."""
    handles = [p.register_hook(lambda g: g.to(BF16).float()) for p in model.parameters() if p.dim() == 2]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def gradient(model, rollout, advantages, context) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model.zero_grad(set_to_none=True)
    rows = torch.arange(rollout.completion_ids.shape[0])
    with context():  # backward inside too: the weight-gradient hooks must see it
        stats = packed_logprobs(model, rollout, rows, chunk_tokens=2048, grouped=True, shared_prefix=True)
        mask = rollout.completion_mask.to(stats.logps.dtype)
        loss = -(advantages[:, None].to(stats.logps.dtype) * stats.logps * mask).sum() / mask.sum()  # DAPO, mu = 1
        loss.backward()
    grads = {name: p.grad.detach().double().clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, (stats.logps.detach().double() * mask)


def compare(grads, logps, reference, reference_logps, mask) -> dict:
    parts: dict[str, list[float]] = {}
    total_error = total_norm = dot = own_norm = 0.0
    for name, exact in reference.items():
        error = float((grads[name] - exact).pow(2).sum())
        norm = float(exact.pow(2).sum())
        part = parts.setdefault(part_of(name), [0.0, 0.0])
        part[0] += error
        part[1] += norm
        total_error, total_norm = total_error + error, total_norm + norm
        dot += float((grads[name] * exact).sum())
        own_norm += float(grads[name].pow(2).sum())
    return {
        "relative_error": (total_error / total_norm) ** 0.5,
        "cosine": dot / (own_norm * total_norm) ** 0.5,
        "parts": {part: (error / norm) ** 0.5 for part, (error, norm) in parts.items()},
        "logp_mean_abs_error": float((logps - reference_logps).abs().sum() / mask.sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--only", help="run only the variants whose label contains this text")
    args = parser.parse_args()
    cfg = load_config("configs/b1.yaml")
    model, rollout, advantages = rollout_and_advantages(cfg)
    model.train()
    mask = rollout.completion_mask.double()
    print(f"rollout: {int(rollout.completion_mask.sum())} completion tokens, {rollout.completion_ids.shape[0]} "
          f"samples; torch {torch.__version__}, threads {torch.get_num_threads()}", file=sys.stderr)

    if os.path.exists(REFERENCE):  # the float64 pass takes minutes: kept for reruns of other variants
        reference, reference_logps = torch.load(REFERENCE)
    else:
        exact_model = copy.deepcopy(model).double()
        reference, reference_logps = gradient(exact_model, rollout, advantages.double(), contextlib.nullcontext)
        del exact_model
        torch.save((reference, reference_logps), REFERENCE)

    head = backbone_and_head(model)[1]

    def autocast(fp32_logits: bool):
        @contextlib.contextmanager
        def context():
            with Precision("bf16", torch.device("cpu")).autocast(), fp32_head(head, fp32_logits, onednn=True):
                yield
        return context

    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    mlp = {"gate_proj", "up_proj", "down_proj"}
    variants = {
        "fp32": contextlib.nullcontext,
        "bf16 autocast (train.precision=bf16)": autocast(False),
        "bf16 body, fp32 head + log-softmax (bf16_fp32head)": autocast(True),
        "emulated: head inputs only": lambda: bf16_linears(model, {"lm_head"}, round_output=False),
        "emulated: logits only (head output)": lambda: bf16_linears(model, {"lm_head"}, round_inputs=False),
        "emulated: head inputs + output": lambda: bf16_linears(model, {"lm_head"}),
        "emulated: attention projections": lambda: bf16_linears(model, attention),
        "emulated: MLP": lambda: bf16_linears(model, mlp),
        "emulated: attention + MLP (body)": lambda: bf16_linears(model, attention | mlp),
        "emulated: weight gradients rounded to bf16": lambda: bf16_weight_grads(model),
    }
    results = {}
    for label, context in variants.items():
        if args.only and args.only not in label:
            continue
        grads, logps = gradient(model, rollout, advantages, context)
        results[label] = compare(grads, logps, reference, reference_logps, mask)
        row = results[label]
        parts = " ".join(f"{part} {value:.4f}" for part, value in sorted(row["parts"].items()))
        print(f"{label:52s} rel {row['relative_error']:.4f} cos {row['cosine']:.5f} "
              f"|dlogp| {row['logp_mean_abs_error']:.5f}  [{parts}]", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"completion_tokens": int(rollout.completion_mask.sum()), "torch": torch.__version__,
                       "variants": results}, handle, indent=1)


if __name__ == "__main__":
    main()
