"""The run's plan (train/plan.py): resolved once in prepare, from the config, the model and the engine,
and what the learner then runs with."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hasten.config import ConfigError, load_config
from hasten.train.learner import Correction, LearningPlan
from hasten.train.trainer import GRPOJob, prepare


TINY = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)


@pytest.fixture
def data(tmp_path):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8)))
    (tmp_path / "rewards.py").write_text("def length(prompts, completions, **kw):\n"
                                          "    return [float(len(c)) for c in completions]\n")
    return tmp_path


def configured(data, profile=None, **overrides):
    pairs = {"model.name": "tiny", "task.name": "jsonl", "task.path": str(data / "data.jsonl"),
             "rewards.extra": [f"{data / 'rewards.py'}:length"], "output.dir": str(data / "runs"),
             "train.num_threads": 1, **overrides}
    return load_config(overrides=list(pairs.items()), profile=profile)


def test_baseline_and_conservative_plans_name_what_runs(data):
    lines = []
    baseline = prepare(configured(data, "baseline"), log=lines.append).plan
    assert (baseline.engine, baseline.model_impl, baseline.device) == ("hf", "transformers", "cpu")
    assert not baseline.learning.logprob_pass.packed and not baseline.learning.settings.skip_zero_advantage
    assert baseline.learning.correction == Correction()  # on-policy: sampling log-probs never read
    assert lines[-1] == baseline.describe() and "padded learning pass" in lines[-1] and "on-policy" in lines[-1]

    fast = prepare(configured(data, "conservative"), log=lines.append).plan
    assert (fast.engine, fast.model_impl) == ("lean", "native")
    assert fast.learning.logprob_pass.packed and fast.learning.settings.skip_zero_advantage
    assert "zero-advantage samples skipped" in fast.describe()
    assert not fast.decode_attention and "fused decode attention" not in fast.describe()  # head_dim 16: torch's


def test_the_sampler_correction_is_decided_once_from_the_config(data):
    stale = LearningPlan.resolve(configured(data, **{"algo.async_steps": 1}), sharded=False, model_config=TINY)
    assert stale.correction == Correction(stale=True) and "stale-weight ratios" in stale.describe()
    other = configured(data)
    other.generation.precision = "bf16"  # another implementation samples: truncated importance weights
    weighted = LearningPlan.resolve(other, sharded=False, model_config=TINY).correction
    assert weighted.cap == other.algo.vllm_importance_sampling_cap and weighted.sampler == "bf16_sampler"
    other.algo.async_steps = 1  # stale and bf16: the ratio against the sampler's own log-probs, no weights of 1
    both = LearningPlan.resolve(other, sharded=False, model_config=TINY)
    assert both.correction == Correction(stale=True) and "importance weights" not in both.describe()
    other.algo.async_steps = 0
    other.algo.vllm_importance_sampling_correction = False
    assert LearningPlan.resolve(other, sharded=False, model_config=TINY).correction.cap is None
    checkpointed = configured(data, **{"speed.gradient_checkpointing": True})
    chosen = LearningPlan.resolve(checkpointed, sharded=False, model_config=TINY).logprob_pass  # plain kernels under checkpointing
    assert not chosen.grouped_attention and not chosen.fast_linear


def test_the_learner_runs_the_plan_prepare_resolved(data):
    session = prepare(configured(data), log=lambda line: None)
    job = GRPOJob(session, log=lambda line: None)
    try:
        assert job.learner.logprob_pass is session.plan.learning.logprob_pass
        assert job.learner.settings is session.plan.learning.settings
        assert job.learner.correction is session.plan.learning.correction
    finally:
        job.close()


def test_a_loaded_lora_base_is_held_in_bf16_under_bf16_learning_only(data):
    """prepare holds the frozen LoRA base in bf16 where the learner reads it as bf16 only, says so on the plan
    line, and a step runs on it; fp32 learning, `hasten eval` and the guard's switch to fp32 keep it fp32."""
    import torch

    def bases(session):
        return {module.base_layer.weight.dtype for module in session.policy.model.modules()
                if hasattr(module, "lora_A")}

    lora = {"model.lora": True, "model.lora_r": 4, "train.precision": "bf16_fp32head", "train.steps": 1}
    lines = []
    session = prepare(configured(data, **lora), log=lines.append)
    assert session.plan.bf16_base and bases(session) == {torch.bfloat16}
    assert "LoRA base held in bf16" in lines[-1] == session.plan.describe()
    job = GRPOJob(session, log=lambda line: None)
    try:
        record = job.step(1)
        assert torch.isfinite(torch.tensor(record["loss"])) and bases(session) == {torch.bfloat16}
        # a checkpoint the NaN guard had switched to fp32 (disable_mixed_precision), resumed under another action
        state = job.state_dict()
        state["optimization"]["precision"]["mode"] = "fp32"
        job.save_model(data / "checkpoint")
        with pytest.raises(ConfigError, match="nan_guard_action=disable_mixed_precision"):
            job.load_state_dict(state, data / "checkpoint")
    finally:
        job.close()
    for overrides, evaluating in (({"train.precision": "fp32"}, False), ({}, True),
                                  ({"speed.nan_guard_action": "disable_mixed_precision"}, False)):
        session = prepare(configured(data, **{**lora, **overrides}), log=lambda line: None, evaluating=evaluating)
        assert not session.plan.bf16_base and bases(session) == {torch.float32}
        assert "LoRA base held in bf16" not in session.plan.describe()
