"""Profile the packed learning pass on one B1 rollout (dev tool, not a benchmark).

    .venv/bin/python dev/profile_learn.py [--rounds 3] [--profile] [--speed.key=value ...]

Generates one B1 rollout once (cached in /tmp/hasten-b1-rollout.pt), then times
log-probs + loss + backward + optimizer step, and with --profile prints the top
operators by self CPU time. Numbers from here go into commit messages; the
figures the README quotes come from `hasten bench`.
"""

import argparse
import os
import sys
import time

import torch

from hasten.bench.workloads import BenchOptions, HastenSide
from hasten.config import load_config, parse_override

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--profile", action="store_true")
args, extra = parser.parse_known_args()

cfg = load_config("configs/b1.yaml", [parse_override(item[2:]) for item in extra])
from hasten.train.trainer import prepare
from hasten.train.learner import Learner
from hasten.algo import group_advantages
from hasten.rewards import score_rewards
from hasten.rewards.batch import reward_inputs
from hasten.rollout.prompts import encode_prompt
from hasten.tasks.sampler import PromptSampler

started = time.perf_counter()
session = prepare(cfg, log=lambda t: None)
print(f"prepare {time.perf_counter() - started:.1f} s", file=sys.stderr)
cache = "/tmp/hasten-b1-rollout.pt"
sampler = PromptSampler(session.task.train_rows, cfg.train.seed)
rows = sampler.next(cfg.train.prompts_per_step)
if os.path.exists(cache):
    rollout = torch.load(cache, weights_only=False)
else:
    from hasten.rollout import SamplingParams
    prompts = [encode_prompt(session.policy.tokenizer, r["prompt"]) for r in rows]
    rollout = session.engine.generate(prompts, 8, SamplingParams(64, 1.0, 1.0, 0), seed=0)
    torch.save(rollout, cache)
inputs = reward_inputs(session.policy.tokenizer, rows, rollout)
scores = score_rewards(session.rewards, inputs.prompts, inputs.completions, inputs.columns, inputs.completion_ids)
advantages = group_advantages(scores.total, 8, "group")
advantages = torch.where(advantages == 0, torch.randn_like(advantages), advantages)  # always some gradient
print(f"completion tokens {int(rollout.completion_mask.sum())}, prompt tokens {int(rollout.prompt_mask.sum())}",
      file=sys.stderr)
learner = Learner.from_config(session.policy, cfg)
for index in range(args.rounds):
    started, cpu = time.perf_counter(), time.process_time()
    learner.step(rollout, advantages)
    print(f"learner.step {time.perf_counter() - started:.2f} s wall, {time.process_time() - cpu:.2f} s cpu",
          file=sys.stderr)
if args.profile:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        learner.step(rollout, advantages)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
