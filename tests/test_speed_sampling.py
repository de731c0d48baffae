"""Curriculum ordering, prefetch keeping the row stream exact, and dynamic sampling
never handing the learner a zero-variance group (hasten/algo/, hasten/tasks/curriculum.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rollout_of

from hasten.config import load_config
from hasten.rewards import RewardScores
from hasten.tasks.curriculum import CurriculumSampler, complexity_difficulty
from hasten.algo.dynamic_sampling import informative_groups, refill
from hasten.train.feeder import Feeder
from hasten.rewards.batch import RewardInputs, ScoredBatch
from hasten.tasks.sampler import PromptSampler
from hasten.train.learner import Learner
from hasten.train.trainer import train

ROWS = [{"prompt": "x" * (1 + (7 * i) % 40), "answer": str(i)} for i in range(40)]  # lengths 1..40, shuffled


def by_length(rows):
    return sorted(range(len(rows)), key=lambda i: (len(rows[i]["prompt"]) + len(rows[i]["answer"]), i))


def test_length_curriculum_draws_from_a_growing_easy_pool_then_the_full_mix():
    sampler = CurriculumSampler(ROWS, seed=3, strategy="length", warmup_steps=4, prompts_per_step=2)
    order = by_length(ROWS)
    pools = []
    for _ in range(4):
        pools.append(sampler.pool_size(1))
        picked = [ROWS.index(row) for row in sampler.next(2)]
        assert len(set(picked)) == 2
        assert all(order.index(i) < sampler.pool_size(1) for i in picked), picked  # only the easiest rows
    assert pools == [10, 18, 25, 33]  # a quarter of 40, growing linearly towards all of it
    assert not sampler.warming_up
    assert sampler.next(6) == PromptSampler(ROWS, 3).next(6)  # after warmup: the plain seeded shuffle


def test_complexity_counts_control_structures_and_operators():
    easy = {"prompt": "print hello"}
    hard = {"prompt": "if x > 1: for i in y: return i * 2"}
    assert complexity_difficulty(easy) < complexity_difficulty(hard)


def test_success_rate_prefers_prompts_that_scored_high():
    sampler = CurriculumSampler(ROWS, seed=0, strategy="success_rate", warmup_steps=100, prompts_per_step=4)
    assert sampler.depends_on_feedback
    sampler.observe([ROWS[5], ROWS[9], ROWS[2]], [1.0, 0.0, 0.5])
    ranked = sampler.easiest()
    assert ranked[0] == 5 and ranked[-1] == 9  # unseen rows rank at the mean of the seen (0.5), with row 2


@pytest.mark.parametrize("strategy", ["off", "length"])
def test_prefetch_keeps_the_exact_row_stream(tokenizer, strategy):
    def sampler():
        if strategy == "off":
            return PromptSampler(ROWS, 7)
        return CurriculumSampler(ROWS, 7, "length", warmup_steps=3, prompts_per_step=4)

    plain, ahead = Feeder(sampler(), tokenizer, 4, prefetch=False), Feeder(sampler(), tokenizer, 4, prefetch=True)
    for count in (4, 2, 4, 1, 4, 4, 3):  # refills (2, 1, 3) interleaved with full batches
        rows_a, ids_a = plain.take(count)
        rows_b, ids_b = ahead.take(count)
        assert rows_a == rows_b and ids_a == ids_b
    assert ahead.pending is not None  # the next batch was being drawn in the background
    ahead.close()


# ------------------------------------------------------------------ dynamic sampling


ROLLOUTS = {}


def scored(model, tokenizer, rewards: list[float], seed: int) -> ScoredBatch:
    """A round with the given rewards; rollouts are reused (only their shapes matter here)."""
    if seed not in ROLLOUTS:
        ROLLOUTS[seed] = rollout_of(model, tokenizer, num_generations=4, max_new_tokens=6, seed=seed)  # 3 x 4
    rollout = ROLLOUTS[seed]
    count = rollout.num_samples
    inputs = RewardInputs(["p"] * count, ["c"] * count, ["c"] * count, {}, rollout.completion_token_lists())
    total = torch.tensor(rewards)
    return ScoredBatch([{"prompt": f"row{seed}-{g}"} for g in range(3)], rollout, inputs,
                       RewardScores(total[:, None], total, ["r"]))


FLAT, MIXED = [1.0] * 4, [0.0, 1.0, 0.0, 0.0]


def test_refill_replaces_flat_groups_and_respects_the_cap(model, tokenizer):
    first = scored(model, tokenizer, FLAT + MIXED + FLAT, seed=0)
    draws = []

    def draw(count, round_index):
        draws.append(count)
        return scored(model, tokenizer, (MIXED + FLAT + FLAT)[: 4 * 3], seed=round_index)

    batch, metrics = refill(first, draw, max_rounds=5, pad_token_id=tokenizer.pad_token_id)
    assert draws == [2, 1]  # 2 missing, one informative group per round
    assert batch.num_groups == 3 and informative_groups(batch.scores.total, 4) == [0, 1, 2]
    assert metrics == {"dynamic/rounds": 2, "dynamic/dropped_groups": 2 + 2 + 2, "dynamic/groups": 3}
    assert batch.rollout.completion_ids.shape[0] == 12 and batch.rollout.prompt_ids.shape[0] == 3

    capped, metrics = refill(first, draw, max_rounds=1, pad_token_id=tokenizer.pad_token_id)
    assert capped.num_groups == 2 and metrics["dynamic/rounds"] == 1  # stops at the cap, trains on fewer

    nothing, metrics = refill(scored(model, tokenizer, FLAT * 3, seed=0), lambda c, r: scored(
        model, tokenizer, FLAT * 3, seed=r), max_rounds=2, pad_token_id=tokenizer.pad_token_id)
    assert nothing is None and metrics["dynamic/groups"] == 0


FLAT_FOR_SOME = '''
def half_flat(prompts, completions, flat, **kwargs):
    """Flat (0) for rows marked flat; otherwise a score that varies with the sample."""
    return [0.0 if is_flat else float(len(text) % 3) for is_flat, text in zip(flat, completions)]
'''


def test_the_learner_never_sees_a_zero_variance_group(tmp_path, monkeypatch):
    rows = [{"prompt": f"row {i}:", "flat": i % 2 == 0} for i in range(20)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(FLAT_FOR_SOME)
    seen = []
    original = Learner.step

    def recording(self, rollout, advantages, *args, **options):
        seen.append(advantages.view(-1, rollout.num_generations).clone())
        return original(self, rollout, advantages, *args, **options)

    monkeypatch.setattr(Learner, "step", recording)
    cfg = load_config(overrides=list({
        "model.name": "tiny", "task.name": "jsonl", "task.path": str(tmp_path / "data.jsonl"),
        "rewards.extra": [f"{tmp_path / 'rewards.py'}:half_flat"], "train.steps": 3, "train.prompts_per_step": 4,
        "generation.num_generations": 4, "generation.max_new_tokens": 6, "eval.num_examples": 0,
        "output.dir": str(tmp_path / "runs"), "output.progress": "off", "output.plot": False,
        "algo.dynamic_sampling": True, "algo.dynamic_sampling_max_rounds": 3,
    }.items()))
    summary = train(cfg, log=lambda text: None)
    records = [json.loads(line) for line in open(f"{summary['run_dir']}/metrics.jsonl")]
    assert any(r["dynamic/dropped_groups"] > 0 for r in records)  # flat rows were generated and dropped
    for advantages in seen:  # (groups, G): a flat group would be all zeros
        assert (advantages.abs().sum(dim=1) > 0).all()
