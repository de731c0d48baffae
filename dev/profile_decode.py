"""Profile the lean engine's decode step (dev tool, not a benchmark).

    .venv/bin/python dev/profile_decode.py [--threads 1] [--rounds 9] [--lengths 64,256,512,1024]
                                           [--model smollm2-135m|tiny] [--rows 4] [--tokens 32]

Two measurements, each printed as a table:

1. GroupCache.attend_step alone at SmolLM2-135M's decode shapes (4 prompts x 8 generations, 3 KV
   heads of 3 query heads each, head_dim 64, prompt width 50) at each own length: the bytes it must
   read (own K+V, the prompts' K/V once per group), the rate it reads them at, and the rate of a
   plain `x.sum()` over as many bytes in the same process (what the machine streams), beside torch's
   fused CPU flash kernel on the own part merged with the prompt part by log-sum-exp weights (the
   alternative issue 38 named; measured no faster, so it is not in the engine) and speed.decode_attention's
   fused kernel (kernels/decode_attention.py). Timings alternate between the variants round by round; medians.
2. Per-token Python and dispatch overhead of a whole LeanEngine.generate: decode wall time per token
   (a generate minus a one-token generate) against the time inside top-level torch ops under
   torch.profiler, per token and per layer, and the number of ops per token.

Numbers from here go into commit messages and docs/speedups.md with the machine and its load.
"""

import argparse
import statistics
import time
import types

import torch

from hasten.kernels import decode_attention
from hasten.rollout import SamplingParams
from hasten.rollout.lean import GroupCache, LeanEngine

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--rounds", type=int, default=9)
parser.add_argument("--lengths", default="64,256,512,1024")
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--rows", type=int, default=4)
parser.add_argument("--tokens", type=int, default=32)
args = parser.parse_args()
torch.set_num_threads(args.threads)
PROMPTS, GENERATIONS, KV_HEADS, HEADS, HEAD_DIM, WIDTH = 4, 8, 3, 9, 64, 50
ROWS = PROMPTS * GENERATIONS


def cache_at(length: int) -> GroupCache:
    """A GroupCache with random prompt K/V and `length` own tokens written (the next step writes one more)."""
    embedding = types.SimpleNamespace(weight=torch.zeros(1))
    engine = types.SimpleNamespace(num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, scale=HEAD_DIM**-0.5, layers=[0],
                                   base=types.SimpleNamespace(model=types.SimpleNamespace(embed_tokens=embedding)))
    cache = GroupCache(engine, torch.ones(PROMPTS, WIDTH, dtype=torch.long), GENERATIONS, max(args.lengths_max, 2) + 1)
    cache.fused = False  # attend_step is torch's path; the fused kernel is its own column
    cache.prompt = [(torch.randn(PROMPTS, KV_HEADS, WIDTH, HEAD_DIM), torch.randn(PROMPTS, KV_HEADS, WIDTH, HEAD_DIM))]
    for keys, values in cache.own:
        keys.normal_(), values.normal_()
    cache.length = length - 1
    return cache


def flash_merged(cache, layer, query, key, value):
    """The own part through torch's fused CPU flash kernel, merged with the grid's prompt part by log-sum-exp."""
    own_keys, own_values = cache.own[layer]
    own_keys[:, :, cache.length], own_values[:, :, cache.length] = key[:, :, 0], value[:, :, 0]
    own_keys, own_values = own_keys[:, :, : cache.length + 1], own_values[:, :, : cache.length + 1]
    prompt_keys, prompt_values = cache.prompt[0]
    query = query.reshape(ROWS, KV_HEADS, -1, HEAD_DIM)  # (N, kv, group, D)
    own, own_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, own_keys, own_values, 0.0, False, scale=HEAD_DIM**-0.5)  # (N, kv, group, D), (N, kv, group)
    group = query.shape[2]
    grid = (query * HEAD_DIM**-0.5).view(PROMPTS, GENERATIONS, KV_HEADS, group, HEAD_DIM).transpose(1, 2)
    scores = grid.reshape(PROMPTS, KV_HEADS, -1, HEAD_DIM) @ prompt_keys.transpose(-1, -2)  # (B, kv, G*group, P)
    lse = torch.logsumexp(scores, -1, keepdim=True)
    prompt = (torch.exp(scores - lse) @ prompt_values).view(PROMPTS, KV_HEADS, GENERATIONS, group, HEAD_DIM)
    prompt = prompt.transpose(1, 2).reshape(ROWS, KV_HEADS, group, HEAD_DIM)
    prompt_lse = lse.view(PROMPTS, KV_HEADS, GENERATIONS, group).transpose(1, 2).reshape(ROWS, KV_HEADS, group)
    total = torch.logaddexp(prompt_lse, own_lse)
    out = prompt * torch.exp(prompt_lse - total)[..., None] + own * torch.exp(own_lse - total)[..., None]
    return out.reshape(ROWS, 1, -1)


def fused(cache, layer, query, key, value):
    """speed.decode_attention's kernel, as GroupCache.attend_step calls it."""
    own_keys, own_values = cache.own[layer]
    own_keys[:, :, cache.length], own_values[:, :, cache.length] = key[:, :, 0], value[:, :, 0]
    prompt_keys, prompt_values = cache.prompt[layer]
    return decode_attention.attend(query, cache.engine.scale, prompt_keys, prompt_values, cache.bias_rows,
                                   cache.prompt_of_row, own_keys, own_values, cache.length + 1)


def per_call(function, reps: int) -> float:
    function()
    start = time.perf_counter()
    for _ in range(reps):
        function()
    return (time.perf_counter() - start) / reps


def attention_table() -> None:
    print(f"attend_step, {ROWS} rows, {args.threads} thread(s): read rate in GB/s (time per call)")
    print(f"{'own length':>10} {'MB read':>8} {'x.sum()':>9} {'attend_step':>20} {'flash + merge':>20} "
          f"{'fused kernel':>20}")
    assert decode_attention.unavailable_reason() is None, decode_attention.unavailable_reason()
    for length in [int(item) for item in args.lengths.split(",")]:
        cache = cache_at(length)
        query = torch.randn(ROWS, HEADS, 1, HEAD_DIM)
        key, value = torch.randn(ROWS, KV_HEADS, 1, HEAD_DIM), torch.randn(ROWS, KV_HEADS, 1, HEAD_DIM)
        size = ROWS * KV_HEADS * length * HEAD_DIM * 4 * 2 + PROMPTS * KV_HEADS * WIDTH * HEAD_DIM * 4 * 2
        stream = torch.randn(size // 4)
        arguments = (cache, 0, query, key, value)
        variants = {"x.sum()": stream.sum, "attend_step": lambda a=arguments: GroupCache.attend_step(*a),
                    "flash + merge": lambda a=arguments: flash_merged(*a),
                    "fused kernel": lambda a=arguments: fused(*a)}
        for name in ("flash + merge", "fused kernel"):
            error = (variants[name]() - variants["attend_step"]()).abs().max().item()
            assert error < 1e-5, (name, error)
        reps = max(5, int(2e8 / size))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, function in variants.items():
                times[name].append(per_call(function, reps))
        median = {name: statistics.median(values) for name, values in times.items()}
        cells = [f"{size / median[name] / 1e9:6.1f} ({median[name] * 1e6:6.0f} us)" for name in variants]
        print(f"{length:>10} {size / 1e6:>8.1f} {cells[0].split('(')[0]:>9} {cells[1]:>20} {cells[2]:>20} "
              f"{cells[3]:>20}")


def overhead_table() -> None:
    if args.model == "tiny":
        from hasten.models.tiny import tiny_model, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        model = tiny_model(len(tokenizer))
    else:
        from hasten.config import ModelConfig
        from hasten.models import load_policy

        policy = load_policy(ModelConfig(name=args.model))
        model, tokenizer = policy.model, policy.tokenizer
    engine = LeanEngine(model, tokenizer.pad_token_id, [len(tokenizer) + 1])  # no EOS: every row runs all tokens
    prompt = tokenizer("Solve: what is 12 times 7? Think step by step.")["input_ids"]

    def generate(tokens: int):
        return engine.generate([prompt], args.rows, SamplingParams(max_new_tokens=tokens, temperature=1.0), seed=0)

    def op_time(tokens: int) -> tuple[float, int]:
        with torch.profiler.profile() as profile:
            generate(tokens)
        top = [event for event in profile.events() if event.cpu_parent is None]
        return sum(event.cpu_time_total for event in top) / 1e6, len(top)

    generate(args.tokens)
    full, one = [], []
    for _ in range(args.rounds):
        one.append(per_call(lambda: generate(1), 1))
        full.append(per_call(lambda: generate(args.tokens), 1))
    steps = args.tokens - 1
    wall = (statistics.median(full) - statistics.median(one)) / steps
    (ops_full, count_full), (ops_one, count_one) = op_time(args.tokens), op_time(1)
    in_ops, count = (ops_full - ops_one) / steps, (count_full - count_one) / steps
    layers = len(engine.layers)
    print(f"decode, {args.model}, {args.rows} rows x {args.tokens} tokens, {args.threads} thread(s), per token:")
    print(f"  wall {wall * 1e3:.2f} ms, in torch ops (profiled) {in_ops * 1e3:.2f} ms, outside "
          f"{(wall - in_ops) * 1e3:.2f} ms ({(wall - in_ops) / layers * 1e6:.0f} us per layer); "
          f"{count:.0f} top-level ops ({count / layers:.1f} per layer)")


args.lengths_max = max(int(item) for item in args.lengths.split(","))
attention_table()
overhead_table()
