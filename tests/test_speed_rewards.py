"""Reward pool, cache and gate (hasten/rewards/): same scores as the plain runner, in order,
errors naming the function and sample, and the gate skipping exactly the failing samples."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from hasten.config import AlgoConfig, ConfigError, SpeedConfig
from hasten.rewards import RewardError, RewardFunction, score_rewards
from hasten.rewards.reward_cache import RewardCache
from hasten.rewards.scoring import RewardScorer

PROMPTS = [f"p{i // 4}" for i in range(12)]  # 3 prompts x 4 samples
COMPLETIONS = ["aa", "ab", "aa", "b", "xyz", "xyz", "x", "", "abc", "abcd", "abc", "a"]
COLUMNS = {"answer": [f"a{i // 4}" for i in range(12)]}
IDS = [[ord(c) for c in text] for text in COMPLETIONS]
CALLS: list[tuple[str, int, str]] = []  # (function, batch size, thread name)


def length(prompts, completions, **kwargs):
    CALLS.append(("length", len(completions), threading.current_thread().name))
    return [float(len(text)) for text in completions]


def vowels(prompts, completions, answer, **kwargs):
    CALLS.append(("vowels", len(completions), threading.current_thread().name))
    return [None if text == "" else sum(c in "aeiou" for c in text) + 0.1 * len(a) for text, a in
            zip(completions, answer)]


async def async_x(prompts, completions, **kwargs):
    return [float("x" in text) for text in completions]


def fragile(prompts, completions, **kwargs):
    if "abcd" in completions:
        raise ValueError("cannot score abcd")
    return [1.0] * len(completions)


def functions(**flags):
    return [RewardFunction("length", length, weight=0.5, **flags.get("length", {})),
            RewardFunction("vowels", vowels, **flags.get("vowels", {})),
            RewardFunction("async_x", async_x, weight=2.0)]


def plain():
    return score_rewards(functions(), PROMPTS, COMPLETIONS, COLUMNS, IDS)


def scored(scorer):
    return scorer.start(PROMPTS, COMPLETIONS, COLUMNS, IDS).join()


def same(a, b):
    assert a.names == b.names
    torch.testing.assert_close(a.per_function, b.per_function, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(a.total, b.total, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_pool_equals_serial_in_order(kind):
    speed = SpeedConfig(reward_workers=3, reward_pool=kind, reward_cache=False)
    scorer = RewardScorer(functions(length={"slow": True}, vowels={"slow": True}), speed)
    try:
        CALLS.clear()
        same(scored(scorer), plain())
        if kind == "thread":  # the slow functions ran on pool threads, in slices of 4
            pooled = [call for call in CALLS if call[2].startswith("hasten-reward")]
            assert sorted(size for _, size, _ in pooled) == [4] * 6
    finally:
        scorer.close()


def test_flags_as_attributes_of_a_user_function():
    def user_reward(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    user_reward.slow = True
    user_reward.deterministic = True
    scorer = RewardScorer([RewardFunction("user_reward", user_reward)], SpeedConfig())
    assert scorer.slow == [True] and scorer.cached == [True]
    scorer.close()


def test_slow_rewards_by_config_name_and_unknown_name():
    scorer = RewardScorer(functions(), SpeedConfig(slow_rewards=["vowels"], reward_cache=False))
    assert scorer.slow == [False, True, False]
    same(scored(scorer), plain())
    scorer.close()
    with pytest.raises(ConfigError, match="speed.slow_rewards names nope"):
        RewardScorer(functions(), SpeedConfig(slow_rewards=["nope"]))


@pytest.mark.parametrize("slow", [True, False])
def test_worker_errors_name_the_function_and_sample(slow):
    bad = RewardFunction("fragile", fragile, slow=slow)
    scorer = RewardScorer(functions() + [bad], SpeedConfig(reward_workers=2))
    with pytest.raises(RewardError, match=r"^reward error: function 'fragile' failed on sample 9 \(prompt \".*\"\): ValueError: "
                                          r"cannot score abcd$"):
        scored(scorer)
    scorer.close()


def test_process_pool_rejects_what_cannot_pickle():
    speed = SpeedConfig(reward_workers=2, reward_pool="process")
    with pytest.raises(RewardError, match="function 'lam' cannot run in a process pool"):
        RewardScorer([RewardFunction("lam", lambda prompts, completions, **k: [0.0] * len(completions),
                                     slow=True)], speed)


def test_cache_returns_identical_rewards_and_counts_hits():
    scorer = RewardScorer(functions(length={"deterministic": True}),
                          SpeedConfig(cache_rewards=["vowels"], reward_workers=0))
    expected = plain()
    CALLS.clear()
    first = scorer.start(PROMPTS, COMPLETIONS, COLUMNS, IDS)
    same(first.join(), expected)
    assert [size for name, size, _ in CALLS] == [12, 12]  # first sight: one call on all the misses
    assert first.metrics["reward_cache/hit_rate"] == 0
    CALLS.clear()
    second = scorer.start(PROMPTS, COMPLETIONS, COLUMNS, IDS)
    same(second.join(), expected)
    assert CALLS == []  # every deterministic score came from the cache
    assert second.metrics["reward_cache/hit_rate"] == pytest.approx(0.5)  # 24 hits of 48 lookups


def test_cache_key_includes_prompt_and_columns():
    scorer = RewardScorer(functions(vowels={"deterministic": True}), SpeedConfig())
    scored(scorer)
    other = dict(COLUMNS, answer=["a-much-longer-answer"] * 12)
    result = scorer.start(PROMPTS, COMPLETIONS, other, IDS).join()
    expected = score_rewards(functions(), PROMPTS, COMPLETIONS, other, IDS)
    same(result, expected)


def test_lru_evicts_least_recently_used():
    cache = RewardCache(max_size=2)
    cache.put(("f", b"1"), 1.0)
    cache.put(("f", b"2"), 2.0)
    assert cache.get(("f", b"1")) == 1.0  # 1 is now the most recent
    cache.put(("f", b"3"), 3.0)
    assert ("f", b"2") not in cache.entries and set(cache.entries) == {("f", b"1"), ("f", b"3")}


def gate(prompts, completions, **kwargs):
    return [float(text.startswith("a")) for text in completions]


def test_gate_skips_exactly_the_failing_samples():
    seen: list[str] = []

    def expensive(prompts, completions, **kwargs):
        seen.extend(completions)
        return [10.0] * len(completions)

    rewards = [RewardFunction("gate", gate), RewardFunction("expensive", expensive, slow=True)]
    scorer = RewardScorer(rewards, SpeedConfig(reward_workers=2),
                          AlgoConfig(gate_reward="gate", gate_failed_reward=-1.0))
    pending = scorer.start(PROMPTS, COMPLETIONS, COLUMNS, IDS)
    result = pending.join()
    scorer.close()
    passing = [text.startswith("a") for text in COMPLETIONS]
    assert sorted(seen) == sorted(text for text, ok in zip(COMPLETIONS, passing) if ok)
    for i, ok in enumerate(passing):
        assert result.total[i] == (11.0 if ok else -1.0)
        assert math.isnan(result.per_function[i, 1]) != ok  # skipped samples: "did not apply"
    assert pending.metrics["rewards/gate_failed"] == pytest.approx(1 - sum(passing) / 12)


def test_unknown_gate_is_a_config_error():
    with pytest.raises(ConfigError, match="algo.gate_reward 'syntax'"):
        RewardScorer(functions(), SpeedConfig(), AlgoConfig(gate_reward="syntax"))


def uneven(prompts, completions, **kwargs):
    """Breaks on any call holding more than 2 samples; every sample alone passes."""
    if len(completions) > 2:
        raise ValueError("too many at once")
    return [0.0] * len(completions)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_function_failing_only_together_is_named_by_its_first_failing_samples(workers):
    # The pool's slices and the plain call both name samples by their index in the whole batch.
    scorer = RewardScorer([RewardFunction("uneven", uneven, slow=bool(workers))],
                          SpeedConfig(reward_workers=workers, reward_cache=False))
    with pytest.raises(RewardError, match=r"^reward error: function 'uneven' failed on samples (\d+) to (\d+) together, "
                                          r"though each passes alone \(sample \2: prompt \".*\"\): ValueError: too many"):
        scored(scorer)
    scorer.close()


def test_a_small_cache_evicts_without_changing_a_score():
    """speed.reward_cache_size only bounds the LRU: a cache of one entry scores what a large one and no cache do."""
    results = []
    for size in (1, 50000):
        scorer = RewardScorer(functions(length={"deterministic": True}, vowels={"deterministic": True}),
                              SpeedConfig(reward_cache=True, reward_cache_size=size, reward_workers=0))
        results.append([scored(scorer) for _ in range(3)])  # the second and third rounds read the cache
        scorer.close()
    for small, large in zip(*results):
        same(small, plain())
        same(large, plain())
