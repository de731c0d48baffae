"""pass@k for the code task: the unbiased estimator of Chen et al. (2021, the HumanEval paper).

For each problem, draw n samples at code.pass_temperature, count the c that
pass every test, and estimate pass@k = 1 - C(n - c, k) / C(n, k), averaged
over problems (computed as a product, which stays exact for large n). Greedy
pass@1 is the held-out accuracy the generic evaluator already measures (a
completion is correct when all its tests pass); it is repeated here under
its usual name. With code.pass_n = 0 only the greedy number is reported,
which keeps evaluation during training cheap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from hasten.rewards.code import SandboxSettings, run_completions


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples (from n, c correct) is correct."""
    if n - c < k:
        return 1.0
    result = 1.0
    for drawn in range(n - c + 1, n + 1):
        result *= 1.0 - k / drawn
    return 1.0 - result


@dataclass
class PassAtK:
    settings: SandboxSettings
    k_values: list[int] = field(default_factory=lambda: [1, 5])
    num_samples: int = 0  # n per problem; 0 = greedy only
    temperature: float = 0.8
    seed: int = 0

    def __call__(self, engine, tokenizer, rows: list[dict], samples: list[dict], max_new_tokens: int,
                 batch_size: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        judged = [sample["correct"] for sample in samples if sample.get("correct") is not None]
        if judged:
            metrics["pass@1_greedy"] = sum(judged) / len(judged)
        if self.num_samples <= 0 or not rows:
            return metrics
        correct_counts = self.count_correct(engine, tokenizer, rows, max_new_tokens, batch_size)
        for k in sorted(set(self.k_values)):
            if k <= self.num_samples:
                metrics[f"pass@{k}"] = sum(pass_at_k(self.num_samples, c, k) for c in correct_counts) / len(rows)
        metrics["pass_n"] = self.num_samples
        metrics["sampled_correct_fraction"] = sum(correct_counts) / (len(rows) * self.num_samples)
        return metrics

    def count_correct(self, engine, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int) -> list[int]:
        """Number of the n samples per row that pass every test."""
        from hasten.rollout import SamplingParams
        from hasten.rollout.prompts import encode_prompt

        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature)
        per_batch = max(1, batch_size // self.num_samples)  # prompts x n samples ~ batch_size sequences
        counts: list[int] = []
        for start in range(0, len(rows), per_batch):
            batch = rows[start:start + per_batch]
            rollout = engine.generate([encode_prompt(tokenizer, row["prompt"]) for row in batch],
                                      self.num_samples, sampling, seed=self.seed + start)
            texts = tokenizer.batch_decode(rollout.completion_token_lists(), skip_special_tokens=True)
            jobs: list[tuple[str, dict]] = []
            for index, text in enumerate(texts):  # group-major: sample i belongs to row i // n
                row = batch[index // self.num_samples]
                jobs.append((text, row))
            passed = [result is not None and result.status == "pass" for result in run_completions(
                self.settings, [text for text, _ in jobs], {"preamble": [row.get("preamble") for _, row in jobs],
                                                           "tests": [row["tests"] for _, row in jobs]})]
            for offset in range(len(batch)):
                counts.append(sum(passed[offset * self.num_samples:(offset + 1) * self.num_samples]))
        return counts
