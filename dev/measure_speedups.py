"""Micro-measurements behind docs/speedups.md, one per speed feature that `hasten compare`
cannot isolate in a few steps. Development script (dev/): a lower bar than hasten/, but every
number in the docs that does not come from `hasten compare` / `hasten bench --ablate` comes
from here.

    python dev/measure_speedups.py [--only matmul,adamw,...] [--rounds 5]

Each measurement alternates its variants (A B A B ...) and reports medians; the machine is
shared, so read ratios, not absolute times. Prints one line per result, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def alternate(variants: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each zero-argument callable, run in alternation (one warm-up each)."""
    seconds = {name: [] for name in variants}
    for round_index in range(rounds + 1):
        for name, run in variants.items():
            started = time.perf_counter()
            run()
            if round_index:
                seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in seconds.items()}


def matmul(rounds):
    """fp32 vs bf16 vs fp16 matmul at SmolLM2-135M's MLP shape (4096 tokens x 576 -> 1536)."""
    x, w = torch.randn(4096, 576), torch.randn(576, 1536)
    variants = {str(dtype).split(".")[1]: (lambda a=x.to(dtype), b=w.to(dtype): a @ b)
                for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    return alternate(variants, rounds)


def autocast_pass(rounds):
    """Forward+backward of a SmolLM2-sized MLP block (576 -> 1536 -> 576) on 4096 tokens: fp32 vs bf16 autocast."""
    block = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.SiLU(), torch.nn.Linear(1536, 576))
    x = torch.randn(4096, 576)

    def fp32():
        block(x).square().mean().backward()

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x)
        out.float().square().mean().backward()

    return alternate({"fp32": fp32, "bf16 autocast": bf16}, rounds)


def adamw(rounds):
    """One AdamW step over SmolLM2-135M-shaped parameters: for_loop vs foreach vs fused."""
    from hasten.config import ModelConfig
    from hasten.models import load_policy

    model = load_policy(ModelConfig(), log=lambda text: None).model
    shapes = [p.shape for p in model.parameters()]
    del model
    variants = {}
    for kernel, kwargs in (("for_loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True})):
        params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        optimizer = torch.optim.AdamW(params, lr=1e-6, **kwargs)
        variants[kernel] = optimizer.step
    return alternate(variants, rounds)


def waiting(prompts, completions, **kwargs):
    time.sleep(0.02 * len(completions))
    return [1.0] * len(completions)

def busy(prompts, completions, **kwargs):  # pure-Python CPU work, ~10 ms per sample
    out = []
    for _ in completions:
        total = 0
        for i in range(200_000):
            total += i % 7
        out.append(float(total % 2))
    return out



def reward_pool(rounds):
    """32 samples of a slow reward: 20 ms of waiting (a subprocess, I/O) per sample; serial vs pool."""
    from hasten.config import SpeedConfig
    from hasten.rewards import RewardFunction
    from hasten.rewards.scoring import RewardScorer

    texts = [f"completion {i}" for i in range(32)]
    variants = {}
    for name, fn in (("wait", waiting), ("cpu", busy)):
        for label, speed in (("serial", SpeedConfig(reward_workers=0)),
                             ("threads x2", SpeedConfig(reward_workers=2)),
                             ("threads x4", SpeedConfig(reward_workers=4)),
                             ("processes x2", SpeedConfig(reward_workers=2, reward_pool="process"))):
            scorer = RewardScorer([RewardFunction(name, fn, slow=True)], speed)
            variants[f"{name} {label}"] = lambda s=scorer: s.start(texts, texts, {}, [[1]] * 32).join()
    return alternate(variants, rounds)


def reward_cache(rounds):
    """The built-in arithmetic rewards on 32 completions: plain call vs cached (all hits) vs key cost."""
    from hasten.config import SpeedConfig
    from hasten.rewards import RewardFunction, correctness_reward, format_reward
    from hasten.rewards.scoring import RewardScorer

    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(32)]
    completions = [[{"role": "assistant", "content": f"{i} + {i} = {2 * i}.\n<answer>{2 * i}</answer>"}]
                   for i in range(32)]
    columns = {"answer": [str(2 * i) for i in range(32)]}
    ids = [[1, 2, 3]] * 32
    functions = [RewardFunction("format", format_reward, 0.25), RewardFunction("correct", correctness_reward)]
    plain = RewardScorer(functions, SpeedConfig(reward_cache=False, reward_workers=0))
    cached = RewardScorer(functions, SpeedConfig(cache_rewards=["format", "correct"], reward_workers=0))
    cached.start(prompts, completions, columns, ids).join()
    return alternate({"uncached": lambda: plain.start(prompts, completions, columns, ids).join(),
                      "cached (all hits)": lambda: cached.start(prompts, completions, columns, ids).join()}, rounds)


def prefetch(rounds):
    """Drawing and tokenizing one step's 4 chat prompts (what prefetch hides)."""
    from hasten.config import TaskConfig
    from hasten.models.smollm2 import converted_dir
    from hasten.tasks import make_task
    from hasten.rollout.prompts import encode_prompt
    from hasten.tasks.sampler import PromptSampler
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_dir())
    sampler = PromptSampler(make_task(TaskConfig(name="arithmetic")).train_rows, 0)
    return alternate({"take 4 prompts": lambda: [encode_prompt(tokenizer, r["prompt"]) for r in sampler.next(4)]},
                     rounds)


def learning_pass(rounds):
    """One B1 rollout of SmolLM2-135M (4 x 8 samples, 64 new tokens), packed learning pass
    (forward + backward): fp32, bf16 autocast, and gradient checkpointing; plus how far bf16 log-probs
    are from fp32 ones, and the rollout's pack ratio."""
    import resource

    from hasten.config import load_config
    from hasten.rollout import SamplingParams
    from hasten.kernels.memory import set_gradient_checkpointing
    from hasten.train.packing import pack_ratio
    from hasten.rollout.prompts import encode_prompt
    from hasten.tasks.sampler import PromptSampler
    from hasten.train.packing import packed_logprobs
    from hasten.train.trainer import prepare

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "b1.yaml")
    session = prepare(cfg, log=lambda text: None)
    rows = PromptSampler(session.task.train_rows, 0).next(4)
    prompts = [encode_prompt(session.policy.tokenizer, r["prompt"]) for r in rows]
    rollout = session.engine.generate(prompts, 8, SamplingParams(64), seed=0)
    model = session.policy.model
    samples = torch.arange(rollout.num_samples)
    mask = rollout.completion_mask.bool()

    def run(mode):
        def go():
            set_gradient_checkpointing(model, mode == "checkpointing")
            if mode == "bf16 autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logps = packed_logprobs(model, rollout, samples, 1.0, False, 1024).logps
            else:
                logps = packed_logprobs(model, rollout, samples, 1.0, False, 1024).logps
            logps.sum().backward()
            model.zero_grad(set_to_none=True)
        return go

    result = alternate({mode: run(mode) for mode in ("fp32", "bf16 autocast", "checkpointing")}, rounds)
    set_gradient_checkpointing(model, False)
    with torch.no_grad():
        exact = packed_logprobs(model, rollout, samples, 1.0, False, 1024).logps[mask]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rounded = packed_logprobs(model, rollout, samples, 1.0, False, 1024).logps[mask]
    result["bf16_logp_abs_diff_mean"] = float((exact - rounded).abs().mean())
    result["bf16_logp_abs_diff_max"] = float((exact - rounded).abs().max())
    result["bf16_ratio_abs_dev_mean"] = float((rounded - exact).exp().sub(1).abs().mean())
    result["completion_tokens"] = float(rollout.completion_mask.sum())
    result["pack_ratio"] = pack_ratio(rollout, samples)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result


def compile_tiny(rounds):
    """Tiny model: compile time of the decoder layers, then a learning forward+backward eager vs compiled."""
    import copy

    from hasten.models import tiny
    from hasten.kernels.compile import compile_model

    eager = tiny.tiny_model(256)
    compiled = copy.deepcopy(eager)
    ids = torch.randint(0, 256, (8, 128))
    started = time.perf_counter()
    ok = compile_model(compiled, log=lambda text: None)
    compiled(input_ids=ids).logits.mean().backward()  # the first call compiles
    compile_seconds = time.perf_counter() - started

    def run(model):
        def go():
            model(input_ids=ids).logits.mean().backward()
        return go

    result = alternate({"eager": run(eager), "compiled": run(compiled)}, rounds)
    result.update(compiled_ok=float(ok), compile_seconds=compile_seconds)
    return result


def threads(rounds):
    """A 2048^3 fp32 matmul with 1 thread vs 2 (train.num_threads)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)

    def run(count):
        def go():
            torch.set_num_threads(count)
            a @ b
        return go

    result = alternate({"1 thread": run(1), "2 threads": run(2)}, rounds)
    torch.set_num_threads(os.cpu_count() or 1)
    return result


MEASUREMENTS = {"matmul": matmul, "autocast": autocast_pass, "adamw": adamw, "reward_pool": reward_pool,
                "reward_cache": reward_cache, "prefetch": prefetch, "learning_pass": learning_pass,
                "compile": compile_tiny, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(MEASUREMENTS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = {"load_average_before": os.getloadavg()[0], "cpus": os.cpu_count(), "torch": torch.__version__}
    for name in args.only.split(","):
        started = time.perf_counter()
        results[name] = MEASUREMENTS[name](args.rounds)
        print(f"{name} ({time.perf_counter() - started:.0f} s): "
              + ", ".join(f"{k} {v:.4g}" for k, v in results[name].items()), flush=True)
    results["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
