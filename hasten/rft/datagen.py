"""`hasten rft datagen`: rejection sampling. Sample, keep what the checker accepts, write records.

For each training question the engine samples `rft.oversample` completions
(default 10) at `rft.temperature` (default 0.6) from one prefill per
question; the task's checker (`Task.check`, the same one held-out accuracy
uses) judges each. A question yields one record (its first correct sample,
`rft.keep=one`) or one per distinct correct reasoning (`rft.keep=all`), and
nothing if no sample was correct. Any model can generate: the policy itself
(self-training, STaR-style) or a larger teacher given with `--model DIR`.

What is kept: the completion up to its last `</answer>`, so trailing text
after the answer never becomes a training target. A completion judged
correct without a closed tag is dropped (the checker reads `<answer>` tags,
so this is rare; it is counted in `dropped_unclosed`).

The report gives the fraction of questions with at least one correct sample
(pass@oversample at this temperature), the fraction of all samples that
were correct, and generation speed.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from ..config import Config
from ..errors import UserError
from ..rollout import SamplingParams
from ..tasks import Task, make_task
from .. import ticker
from ..ticker import Ticker
from ..rollout.prompts import encode_prompt
from ..train.preflight import check_writable_file
from .data import RFTRecord, trim_to_answer, write_records
from .prompts import load_generator, question_of


@dataclass
class DatagenReport:
    questions: int
    solved: int  # questions with at least one correct sample
    samples: int
    correct_samples: int
    records: int
    dropped_unclosed: int  # correct by the checker but without a closed </answer>
    generated_tokens: int
    seconds: float
    path: str

    @property
    def solved_fraction(self) -> float:
        return self.solved / max(self.questions, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "solved_fraction": self.solved_fraction,
                "correct_fraction": self.correct_samples / max(self.samples, 1),
                "tokens_per_second": self.generated_tokens / max(self.seconds, 1e-9)}


def select_records(task: Task, rows: list[dict], texts: list[str], oversample: int, keep: str,
                   counts: dict[str, int]) -> list[RFTRecord]:
    """Records from `texts` (group-major: oversample per row) that the task's checker accepts."""
    records = []
    for index, row in enumerate(rows):
        seen: set[str] = set()
        solved = False
        for text in texts[index * oversample:(index + 1) * oversample]:
            verdict = task.check(text, row)
            if verdict is None or not verdict.correct:
                continue
            counts["correct_samples"] += 1
            solved = True
            reasoning = trim_to_answer(text)
            if reasoning is None:
                counts["dropped_unclosed"] += 1
                continue
            if reasoning in seen or (keep == "one" and seen):
                continue
            seen.add(reasoning)
            records.append(RFTRecord(question_of(row), row.get("answer"), reasoning))
        counts["solved"] += solved
    return records


class NoRecords(UserError):
    """Rejection sampling kept nothing: there is no data set to write."""


def run_datagen(cfg: Config, log: Callable[[str], None] = print, engine=None, tokenizer=None) -> DatagenReport:
    """Generate, filter and write cfg.rft.data. `engine`/`tokenizer` replace the loaded model (tests)."""
    task = make_task(cfg.task)
    check_writable_file(cfg.rft.data, "rft.data")  # before minutes of sampling, not after
    if engine is None:
        policy, engine = load_generator(cfg, log)
        tokenizer = policy.tokenizer
    rft = cfg.rft
    sampling = SamplingParams(max_new_tokens=rft.max_new_tokens, temperature=rft.temperature)
    counts = {"correct_samples": 0, "dropped_unclosed": 0, "solved": 0}
    records: list[RFTRecord] = []
    rows = task.train_rows
    generated = 0
    started = time.perf_counter()
    ticker.configure(cfg.output.progress)
    with Ticker("datagen", total=len(rows), unit="question") as tick:  # moves per rft.prompts_per_batch questions
        for batch_index, start in enumerate(range(0, len(rows), rft.prompts_per_batch)):
            batch = rows[start:start + rft.prompts_per_batch]
            prompts = [encode_prompt(tokenizer, row["prompt"]) for row in batch]
            rollout = engine.generate(prompts, rft.oversample, sampling, seed=rft.seed * 1_000_003 + batch_index)
            generated += int(rollout.completion_mask.sum())
            texts = tokenizer.batch_decode(rollout.completion_token_lists(), skip_special_tokens=True)
            records += select_records(task, batch, texts, rft.oversample, rft.keep, counts)
            tick.note(f"{counts['solved']} solved, {len(records)} records, "
                      f"{generated / (time.perf_counter() - started):.0f} tok/s")
            tick.update(len(batch))
    seconds = time.perf_counter() - started
    log(f"datagen: {len(rows)} questions, {counts['solved']} solved, {len(records)} records, "
        f"{generated / max(seconds, 1e-9):.0f} tok/s")
    if not records:  # an empty file would only fail later, in `hasten sft`
        raise NoRecords(f"rft error: no sample was correct ({len(rows)} questions x {rft.oversample} samples), so "
                        f"nothing was written to {rft.data}; raise rft.oversample or rft.temperature, or start "
                        "from a stronger model")
    path = write_records(rft.data, records)
    return DatagenReport(
        questions=len(rows), solved=counts["solved"], samples=len(rows) * rft.oversample,
        correct_samples=counts["correct_samples"], records=len(records),
        dropped_unclosed=counts["dropped_unclosed"], generated_tokens=generated, seconds=seconds, path=str(path),
    )
