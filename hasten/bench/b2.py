"""B2 of `hasten bench` (docs/benchmarks.md): decode, hasten's engines against transformers' generate and vLLM.

`run_b2` times every engine `hasten_engines` builds (plus lean with speed.speculative when
--speculative asks) on the same prompts, round by round, with EOS unable to end a row, beside
transformers' generate and vLLM's LLM.generate. `run_b2_batches` (--batch-sizes) sweeps the
decode batch size for the lean engine with and without speculative decoding. Both run on the
B1 setup that workloads.py builds (`HastenSide`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from . import cost
from .report import Result, Row, Work, generation_flops
from .workloads import BenchOptions, HastenSide, peer_model_dir


def hasten_engines(policy, notes: list[str] | None = None, hf_policy=None) -> dict[str, Any]:
    """hasten's engines for B2, each built so no sampled token ends a row (an empty EOS list).

    The kv-cache engine needs transformers' model (hf_policy; default: policy).

    Add a faster engine here and it becomes a B2 row. `hasten.rollout.lean`'s
    LeanEngine is picked up when the module exists and builds.
    """
    from ..rollout import KVCacheEngine

    hf_policy = hf_policy or policy
    engines: dict[str, Any] = {"kv-cache": KVCacheEngine(hf_policy.model, hf_policy.pad_token_id, [])}
    try:
        from ..rollout.lean import LeanEngine
    except ImportError:
        return engines
    try:
        engines["lean"] = LeanEngine(policy.model, policy.pad_token_id, [])
    except Exception as error:  # a module still being written must not stop the bench
        if notes is not None:
            notes.append(f"LeanEngine did not build: {type(error).__name__}: {error}")
    from ..device import cpu_has_native_bf16

    if "lean" in engines and cpu_has_native_bf16():  # generation.precision=bf16 (AMX / AVX512-BF16 only)
        engines["lean bf16"] = LeanEngine(policy.model, policy.pad_token_id, [], sample_precision="bf16")
    from ..device import cpu_int8_unavailable_reason

    if "lean" in engines and cpu_int8_unavailable_reason() is None:  # generation.precision=int8
        engines["lean int8"] = LeanEngine(policy.model, policy.pad_token_id, [], sample_precision="int8")
    from ..rollout import vllm_engine

    if vllm_engine.available():  # speed.engine=vllm, as training builds it (hasten[vllm] installed)
        try:
            engines["vllm"] = vllm_engine.VLLMEngine(policy.model, policy.pad_token_id, [])
        except Exception as error:
            if notes is not None:
                notes.append(f"VLLMEngine did not build: {type(error).__name__}: {error}")
    return engines


def speculative_engines(side: HastenSide, opts: BenchOptions, eos_token_ids: list[int]) -> dict[str, Any]:
    """`lean+ngram`, `lean+draft(layers:8)`, ...: the lean engine with speed.speculative, as training builds it."""
    import copy

    from ..rollout.lean import LeanEngine
    from ..rollout.factory import speculative

    policy, engines = side.session.policy, {}
    for choice in opts.speculative:
        cfg = copy.deepcopy(side.cfg)
        cfg.speed.speculative = "ngram" if choice == "ngram" else "draft"
        cfg.speed.draft_model, cfg.speed.speculative_tokens = choice, opts.speculative_tokens
        name = "lean+ngram" if choice == "ngram" else f"lean+draft({choice})"
        engines[name] = speculative(cfg, policy, LeanEngine(policy.model, policy.pad_token_id, eos_token_ids),
                                    opts.log)
    return engines


def spec_extra(rollouts: list) -> dict[str, float]:
    """Mean spec/* counters over a row's measured runs (empty for engines without them)."""
    keys = {key for rollout in rollouts for key in rollout.stats}
    return {key: statistics.mean(rollout.stats[key] for rollout in rollouts) for key in sorted(keys)}


def run_b2(side: HastenSide, opts: BenchOptions) -> Result:
    from .peers import hf_generate, VllmGenerate

    num_prompts, group, new_tokens = (2, 4, 8) if opts.quick else opts.decode_shape
    policy, rounds = side.session.policy, opts.rounds("B2")
    _, prompts = side.prompts(num_prompts)
    sampling = side.sampling(new_tokens)
    result = Result("B2", f"decode: {num_prompts} prompts x {group} samples x {new_tokens} new tokens, EOS ignored")
    result.settings["workload"] = {"prompts": num_prompts, "samples_per_prompt": group, "new_tokens": new_tokens,
                                   "temperature": sampling.temperature, "top_p": sampling.top_p,
                                   "top_k": sampling.top_k, "prompt_tokens": [len(p) for p in prompts]}

    runners: dict[str, tuple[str, Callable[[Any, int], int]]] = {}
    hf_policy = side.hf_policy()
    last: dict[str, list] = {}  # the measured rollouts of each hasten engine, for its spec/* counters
    engines = {**hasten_engines(policy, result.notes, hf_policy), **speculative_engines(side, opts, [])}

    def hasten_run(params, seed, name, engine):
        rollout = engine.generate(prompts, group, params, seed)
        last.setdefault(name, []).append(rollout)
        return int(rollout.completion_mask.sum())

    for name, engine in engines.items():
        runners[name] = ("hasten", lambda params, seed, name=name, engine=engine:
                         hasten_run(params, seed, name, engine))
    result.settings["hasten"] = {"engines": list(runners), "eos_token_ids": [], "prefill": "once per prompt",
                                 "speculative_tokens": opts.speculative_tokens}
    if "hf" in opts.peers:
        runners["hf generate"] = ("peer", lambda params, seed: hf_generate(
            hf_policy.model, prompts, group, params, seed, policy.pad_token_id))
        result.settings["hf generate"] = {
            "do_sample": True, "num_return_sequences": group, "max_new_tokens": new_tokens,
            "min_new_tokens": new_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "top_k": sampling.top_k, "padding": "left", "prefill": "once per sample"}
    if "vllm" in opts.peers:
        try:
            with tempfile.TemporaryDirectory() as workdir:
                vllm = VllmGenerate(peer_model_dir(side.cfg.model.name, Path(workdir)), side.cfg.model.dtype)
            runners["vllm LLM.generate"] = ("peer", lambda params, seed: vllm(prompts, group, params, seed))
        except Exception as error:
            result.notes.append(f"vllm skipped: {type(error).__name__}: {error}")
    else:
        result.notes.append("vllm not measured: the `vllm` package does not import here")

    for name, (_, run) in runners.items():  # warm-up: thread pools, first allocations
        run(side.sampling(2), 0)
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    tokens: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(rounds):
        for index, (name, (_, run)) in enumerate(runners.items()):
            opts.log(f"B2: round {round_index + 1}/{rounds} {name}")
            opts.progress(round_index * len(runners) + index, rounds * len(runners))
            started = time.perf_counter()
            tokens[name].append(run(sampling, round_index))
            seconds[name].append(time.perf_counter() - started)
    opts.progress(rounds * len(runners), rounds * len(runners))
    prompt_tokens = sum(len(p) for p in prompts)
    # weight reads at least: one per step, or one per k+1 tokens where a drafter lets a step verify k (a bound)
    reads = {name: new_tokens / ((opts.speculative_tokens + 1) if "+" in name else 1) for name in runners}
    for name, (role, _) in runners.items():
        result.rows.append(Row(name, role, "tok/s", seconds[name], work=tokens[name],
                               flops=[generation_flops(side.size, prompt_tokens, t) for t in tokens[name]],
                               phases=[{"decode": decode_work(side, prompts, t, reads[name], name)} for t in tokens[name]],
                               extra=spec_extra(last.get(name, [])[1:])))  # [0]: the warm-up
    result.notes.append("seed r for round r on every engine; rounds alternate engines")
    return result


def decode_work(side: HastenSide, prompts: list[list[int]], generated: float, reads: float, engine: str) -> Work:
    """B2's decode: FLOPs, and the weights read `reads` times plus each token's KV read (report.py's floor)."""
    precision = "bf16" if engine.endswith("bf16") else "fp32"
    return Work(generation_flops(side.size, sum(len(p) for p in prompts), generated),
                cost.decode_floor_bytes(side.shape, int(reads), generated, min(len(p) for p in prompts), precision),
                precision)


def run_b2_batches(side: HastenSide, opts: BenchOptions) -> Result:
    """Decode tokens/s per batch size, the lean engine with and without speculative decoding.

    `sampled b=N`: N rows, groups of min(8, N) samples, B2's sampling, EOS ignored.
    `greedy b=N`: N prompts x 1, greedy, EOS ends a row (as the held-out eval runs).
    FLOPs per token do not count the drafts or the rejected positions: the limit counts the useful work.
    """
    from ..rollout import SamplingParams
    from ..rollout.lean import LeanEngine

    policy, rounds = side.session.policy, opts.rounds("B2")
    new_tokens = 8 if opts.quick else opts.decode_shape[2]
    result = Result("B2-batch", f"decode per batch size ({', '.join(map(str, opts.batch_sizes))} rows), "
                                f"{new_tokens} new tokens, lean with and without speculative decoding")
    variants = {"lean": {False: LeanEngine(policy.model, policy.pad_token_id, []),
                         True: LeanEngine(policy.model, policy.pad_token_id, policy.eos_token_ids)}}
    for name, engine in speculative_engines(side, opts, []).items():
        variants[name] = {False: engine}
    for name, engine in speculative_engines(side, opts, policy.eos_token_ids).items():
        variants[name][True] = engine
    result.settings["workload"] = {"batch_sizes": list(opts.batch_sizes), "new_tokens": new_tokens,
                                   "speculative": list(opts.speculative), "k": opts.speculative_tokens}
    for batch in opts.batch_sizes:
        group = min(8, batch)
        for mode, greedy in (("sampled", False), ("greedy", True)):
            count, samples = (batch, 1) if greedy else (max(batch // group, 1), group)
            _, prompts = side.prompts(count)
            sampling = SamplingParams(new_tokens, temperature=0.0) if greedy else side.sampling(new_tokens)
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            work: dict[str, list[float]] = {name: [] for name in variants}
            rollouts: dict[str, list] = {name: [] for name in variants}
            for name, engines in variants.items():  # warm-up at this shape
                engines[greedy].generate(prompts, samples, sampling, 0)
            for round_index in range(rounds):
                for name, engines in variants.items():
                    opts.log(f"B2-batch: {mode} b={batch} round {round_index + 1}/{rounds} {name}")
                    started = time.perf_counter()
                    rollout = engines[greedy].generate(prompts, samples, sampling, round_index)
                    seconds[name].append(time.perf_counter() - started)
                    work[name].append(float(rollout.completion_mask.sum()))
                    rollouts[name].append(rollout)
            prompt_tokens = sum(len(p) for p in prompts)  # prefilled once per prompt
            for name in variants:
                result.rows.append(Row(f"{mode} b={count * samples} {name}", "hasten", "tok/s", seconds[name],
                                       work=work[name], extra=spec_extra(rollouts[name]),
                                       flops=[generation_flops(side.size, prompt_tokens, t) for t in work[name]]))
    result.notes.append("rows of one batch size and mode alternate engines round by round; seed r for round r")
    return result
