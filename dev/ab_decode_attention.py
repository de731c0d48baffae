"""A/B in one process: LeanEngine.generate with speed.decode_attention on and off, alternating (dev tool).

    .venv/bin/python dev/ab_decode_attention.py [--tokens 64] [--rounds 5] [--threads 2]

SmolLM2-135M, 4 chat-templated arithmetic prompts x 8 samples (B1's batch shape), EOS ignored so every
row generates --tokens tokens, shared prefix on as in the default profile. Prints the median seconds per
generate of each side and ms per token. Not a benchmark: numbers go into commit messages and docs/results
with the machine and its load; the side-by-side claims come from `hasten bench`.
"""

import argparse
import statistics
import time

import torch

from hasten.config import ModelConfig
from hasten.models import load_policy
from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--threads", type=int, default=2)
args = parser.parse_args()
torch.set_num_threads(args.threads)
policy = load_policy(ModelConfig(name="smollm2-135m"))
tokenizer = policy.tokenizer
questions = ["What is 17 + 25?", "Compute 8 * 9 - 4.", "What is 144 / 12?", "Solve 3 * (7 + 2)."]
prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
           for q in questions]
prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
engines = {fused: LeanEngine(policy.model, tokenizer.pad_token_id, [len(tokenizer) + 5], shared_prefix=True,
                             decode_attention=fused) for fused in (False, True)}  # no EOS: every row runs
sampling = SamplingParams(max_new_tokens=args.tokens, temperature=1.0)
times = {fused: [] for fused in engines}
for engine in engines.values():
    engine.generate(prompts, 8, sampling, seed=0)
for round_ in range(args.rounds):
    for fused, engine in engines.items():
        start = time.perf_counter()
        engine.generate(prompts, 8, sampling, seed=round_)
        times[fused].append(time.perf_counter() - start)
print(f"prompt lengths {[len(p) for p in prompts]}, 32 rows x {args.tokens} tokens, {args.threads} threads")
for fused, values in times.items():
    median = statistics.median(values)
    print(f"decode_attention={fused}: median {median:.3f} s ({median / args.tokens * 1e3:.1f} ms a token); "
          f"rounds {[round(v, 2) for v in values]}")
