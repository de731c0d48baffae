"""`speed.*` is exact: every key under `speed` leaves what is learned unchanged, and a named test shows it.

EQUIVALENCE maps each `speed` key to the test that shows it (bit for bit, within fp32 reordering, or the same
sampling distribution). test_every_speed_key_has_an_equivalence_test walks SpeedConfig's fields and fails on a
key with no entry, an entry whose file or function is missing, or a test that never names the key: the test's
own code (decorators included, docstring not), or a helper in its file that it calls, must pass the key as a
keyword, read or write `speed.<key>`, or hold the key (or `speed.<key>`) as a string. A key that changes
learning does not belong here: it moves to algo, generation or train (hasten/config_yaml.py's MOVED).

Below the table: the equivalence tests no other file had (learning-pass switches set through the config, the
NaN guard on a finite run, the process switches, the compiled decoder, the vLLM engine's memory settings).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from conftest import learner_step, rollout_of
from hasten.config import Config, SpeedConfig, set_key

TESTS = Path(__file__).parent

EQUIVALENCE: dict[str, str] = {
    # generation
    "engine": "tests/test_speed_exact.py::test_the_engine_choice_samples_the_same_rollout",
    "model_impl": "tests/test_native_llama.py::test_speed_model_impl_learns_the_same",
    "engine_weights": "tests/test_engine_weights.py::test_training_with_shared_weights_learns_what_the_copy_learns",
    "decode_attention": "tests/test_decode_attention.py::test_the_engine_samples_the_same_with_the_fused_kernel",
    "shared_prefix": "tests/test_shared_prefix.py::test_learner_step_is_the_same_with_and_without",
    "speculative": "tests/test_speculative.py::test_speculative_settings_from_the_config_keep_the_exact_distribution",
    "speculative_tokens":
        "tests/test_speculative.py::test_speculative_settings_from_the_config_keep_the_exact_distribution",
    "draft_model": "tests/test_speculative.py::test_speculative_settings_from_the_config_keep_the_exact_distribution",
    "ngram_size": "tests/test_speculative.py::test_speculative_settings_from_the_config_keep_the_exact_distribution",
    "vllm_server": "tests/test_speed_exact.py::test_vllm_memory_settings_reach_only_the_engines_memory",
    "vllm_memory_fraction": "tests/test_speed_exact.py::test_vllm_memory_settings_reach_only_the_engines_memory",
    "vllm_kv_cache_mb": "tests/test_speed_exact.py::test_vllm_memory_settings_reach_only_the_engines_memory",
    "vllm_max_model_len": "tests/test_speed_exact.py::test_vllm_memory_settings_reach_only_the_engines_memory",
    "prefetch": "tests/test_speed_sampling.py::test_prefetch_keeps_the_exact_row_stream",
    # rewards
    "reward_workers": "tests/test_speed_rewards.py::test_pool_equals_serial_in_order",
    "reward_pool": "tests/test_speed_rewards.py::test_pool_equals_serial_in_order",
    "slow_rewards": "tests/test_speed_rewards.py::test_slow_rewards_by_config_name_and_unknown_name",
    "reward_cache": "tests/test_speed_rewards.py::test_a_small_cache_evicts_without_changing_a_score",
    "cache_rewards": "tests/test_speed_rewards.py::test_cache_returns_identical_rewards_and_counts_hits",
    "reward_cache_size": "tests/test_speed_rewards.py::test_a_small_cache_evicts_without_changing_a_score",
    # learning
    "packed_learning": "tests/test_packing.py::test_learner_gradients_are_the_same_with_and_without_packing",
    "logit_chunk_tokens": "tests/test_speed_exact.py::test_learning_pass_switches_give_the_same_step",
    "grouped_attention": "tests/test_speed_exact.py::test_learning_pass_switches_give_the_same_step",
    "min_pack_ratio": "tests/test_speed_learning.py::test_pack_ratio_and_min_pack_ratio_fallback",
    "skip_zero_advantage": "tests/test_zero_advantage.py::test_skipping_gives_the_plain_loss_gradients_and_metrics",
    "token_budget": "tests/test_microbatch.py::test_learner_gradient_is_the_same_with_a_token_budget",
    "fast_linear": "tests/test_fast_linear.py::test_learner_loss_and_gradients_are_the_same_with_fast_linear",
    "optimizer": "tests/test_speed_learning.py::test_adamw_kernels_give_the_for_loop_update",
    "gradient_checkpointing": "tests/test_speed_learning.py::test_gradient_checkpointing_gives_the_same_gradients",
    "offload_reference": "tests/test_speed_learning.py::test_reference_offload_gives_the_same_kl_and_stays_on_cpu",
    "compile": "tests/test_speed_exact.py::test_the_compiled_decoder_gives_the_eager_step",
    "compile_mode": "tests/test_speed_exact.py::test_the_compiled_decoder_gives_the_eager_step",
    "nan_guard": "tests/test_speed_exact.py::test_the_nan_guard_leaves_a_finite_run_unchanged",
    "nan_guard_patience": "tests/test_speed_exact.py::test_the_nan_guard_leaves_a_finite_run_unchanged",
    "nan_guard_action": "tests/test_speed_exact.py::test_the_nan_guard_leaves_a_finite_run_unchanged",
    "nan_guard_lr_factor": "tests/test_speed_exact.py::test_the_nan_guard_leaves_a_finite_run_unchanged",
    # the process
    "keep_freed_memory": "tests/test_speed_exact.py::test_process_switches_leave_the_step_unchanged",
    "allocator": "tests/test_allocator.py::test_cli_reexecutes_and_results_do_not_change",
    "adaptive_threads": "tests/test_speed_exact.py::test_process_switches_leave_the_step_unchanged",
}


# ------------------------------------------------------------------ the walk


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _reached(name: str, functions: dict[str, ast.FunctionDef]) -> list[ast.FunctionDef]:
    """The test function and every function of its file that it calls, directly or through another."""
    seen, todo = [], [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in functions:
            continue
        seen.append(current)
        todo += [node.func.id for node in ast.walk(functions[current])
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)]
    return [functions[name] for name in seen]


def _names_key(function: ast.FunctionDef, key: str) -> bool:
    """`key=` as a keyword, `speed.<key>` as an attribute, or the key as a string; the docstring does not count."""
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    nodes = [node for part in [*function.decorator_list, *body] for node in ast.walk(part)]
    pattern = re.compile(rf"(^|speed\.){re.escape(key)}(=|$)")
    for node in nodes:
        if isinstance(node, ast.keyword) and node.arg == key:
            return True
        if isinstance(node, ast.Attribute) and node.attr == key and (
                (isinstance(node.value, ast.Attribute) and node.value.attr == "speed")
                or (isinstance(node.value, ast.Name) and node.value.id == "speed")):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.search(node.value):
            return True
    return False


def problem(key: str, where: str | None) -> str | None:
    """Why `where` does not show that speed.<key> leaves learning unchanged, or None when it does."""
    if where is None:
        return f"speed.{key} has no equivalence test: add one and name it in EQUIVALENCE (or move the key)"
    path, _, name = where.partition("::")
    file = TESTS.parent / path
    if not file.is_file():
        return f"speed.{key}: {path} does not exist"
    functions = _functions(ast.parse(file.read_text()))
    if name not in functions:
        return f"speed.{key}: {path} has no function {name}"
    if not any(_names_key(function, key) for function in _reached(name, functions)):
        return f"speed.{key}: {where} never names {key} (pass it as {key}=, speed.{key}, or '{key}')"
    return None


def test_every_speed_key_has_an_equivalence_test():
    keys = [field.name for field in dataclasses.fields(SpeedConfig)]
    problems = [message for key in keys if (message := problem(key, EQUIVALENCE.get(key))) is not None]
    assert not problems, "\n".join(problems)
    assert set(EQUIVALENCE) <= set(keys), f"EQUIVALENCE names keys speed does not have: {set(EQUIVALENCE) - set(keys)}"


def test_the_walk_cannot_be_fooled():
    """A missing entry, a missing function, and a real test that never names the key are each refused."""
    assert "no equivalence test" in problem("packed_learning", None)
    assert "has no function" in problem("packed_learning", "tests/test_packing.py::test_that_does_not_exist")
    # a genuine equivalence test, but of another key: its docstring may mention anything, its code does not
    assert "never names packed_learning" in problem(
        "packed_learning", "tests/test_speed_rewards.py::test_cache_returns_identical_rewards_and_counts_hits")
    assert problem("packed_learning", EQUIVALENCE["packed_learning"]) is None


# ------------------------------------------------------------------ equivalence tests no other file had


def _speed(**settings):
    """configure(cfg) for learner_step: these speed.* keys, set through the config's own setter."""
    def configure(cfg: Config) -> None:
        cfg.train.max_grad_norm = 0.0  # the gradients as the loss gives them
        for key, value in settings.items():
            set_key(cfg, f"speed.{key}", value)
    return configure


def _same_step(model, tokenizer, rollout, advantages, plain: dict, other: dict) -> None:
    metrics, gradients = learner_step(model, tokenizer, rollout, advantages, _speed(**plain))
    other_metrics, other_gradients = learner_step(model, tokenizer, rollout, advantages, _speed(**other))
    assert other_metrics["loss"] == pytest.approx(metrics["loss"], abs=1e-6)
    assert len(gradients) == len(other_gradients)
    for a, b in zip(gradients, other_gradients):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_engine_choice_samples_the_same_rollout(model, tokenizer):
    """speed.engine=hf and =lean (and auto, which picks lean for this model) built by the factory from the config:
    the same seeded tokens and masks, sampling log-probs within fp32 reordering."""
    from hasten.models import Policy
    from hasten.rollout import SamplingParams
    from hasten.rollout.factory import make_engine

    from conftest import encode

    policy = Policy(model, tokenizer, "tiny")
    prompts, sampling = encode(tokenizer), SamplingParams(max_new_tokens=12, temperature=1.0)
    rollouts = {}
    for choice in ("hf", "lean", "auto"):
        cfg = Config()
        _speed(engine=choice)(cfg)
        rollouts[choice] = make_engine(cfg, policy, log=lambda text: None).generate(prompts, 4, sampling, seed=3)
    for choice in ("lean", "auto"):
        assert torch.equal(rollouts[choice].completion_ids, rollouts["hf"].completion_ids)
        assert torch.equal(rollouts[choice].completion_mask, rollouts["hf"].completion_mask)
        assert (rollouts[choice].sampling_logprobs - rollouts["hf"].sampling_logprobs).abs().max() < 1e-5


@pytest.mark.parametrize("plain, other", [
    ({"grouped_attention": False}, {"grouped_attention": True}),
    ({"logit_chunk_tokens": 0}, {"logit_chunk_tokens": 7}),  # all logits at once, or in 7-token checkpointed chunks
])
def test_learning_pass_switches_give_the_same_step(short_model, tokenizer, plain, other):
    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    advantages = torch.linspace(-1.0, 1.0, rollout.num_samples)
    _same_step(short_model, tokenizer, rollout, advantages, plain, other)


@pytest.mark.parametrize("guard", [
    {"nan_guard": True, "nan_guard_patience": 1, "nan_guard_action": "stop", "nan_guard_lr_factor": 0.1},
    {"nan_guard": True, "nan_guard_patience": 5, "nan_guard_action": "lower_lr", "nan_guard_lr_factor": 0.9},
    {"nan_guard": True, "nan_guard_action": "disable_mixed_precision"},
])
def test_the_nan_guard_leaves_a_finite_run_unchanged(short_model, tokenizer, guard):
    """On finite losses and gradients the guard only looks: three optimizer steps give the weights, bit for bit,
    that the same steps give with the guard off (what it does on a non-finite step: test_speed_learning.py)."""
    from hasten.models import Policy
    from hasten.train.learner import Learner

    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    advantages = torch.linspace(-1.0, 1.0, rollout.num_samples)
    weights = []
    for settings in ({"nan_guard": False}, guard):
        cfg = Config()
        cfg.train.lr, cfg.train.lr_schedule = 1e-2, "constant"
        _speed(**settings)(cfg)
        model = copy.deepcopy(short_model)
        learner = Learner.from_config(Policy(model, tokenizer, "tiny"), cfg, log=lambda text: None)
        for _ in range(3):
            learner.step(rollout, advantages)
        weights.append([parameter.detach().clone() for parameter in model.parameters()])
    for a, b in zip(*weights):
        assert torch.equal(a, b)


def test_process_switches_leave_the_step_unchanged(short_model, tokenizer):
    """speed.keep_freed_memory changes how glibc keeps freed pages, speed.adaptive_threads how many intra-op
    threads a phase gets: the step is the same bit for bit after the first, within fp32 reordering for the
    second (a thread count splits a reduction differently)."""
    from hasten.kernels.runtime import keep_freed_memory
    from hasten.kernels.threads import ThreadGovernor

    rollout = rollout_of(short_model, tokenizer, num_generations=4)
    advantages = torch.linspace(-1.0, 1.0, rollout.num_samples)
    settings = {"keep_freed_memory": False, "adaptive_threads": False}
    before, before_gradients = learner_step(short_model, tokenizer, rollout, advantages, _speed(**settings))
    keep_freed_memory()  # what the trainer does at start with speed.keep_freed_memory=true (process-wide)
    after, after_gradients = learner_step(short_model, tokenizer, rollout, advantages,
                                          _speed(keep_freed_memory=True))
    assert after["loss"] == before["loss"]
    assert all(torch.equal(a, b) for a, b in zip(before_gradients, after_gradients))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):  # the counts the governor picks between on this machine's cores
            torch.set_num_threads(count)
            ThreadGovernor(enabled=True)  # adaptive_threads=true: only ever sets the intra-op count
            metrics, gradients = learner_step(short_model, tokenizer, rollout, advantages,
                                              _speed(adaptive_threads=True))
            assert metrics["loss"] == pytest.approx(before["loss"], abs=1e-6)
            for a, b in zip(before_gradients, gradients):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_the_compiled_decoder_gives_the_eager_step(short_model, tokenizer):
    """speed.compile with speed.compile_mode=default: torch.compile'd decoder layers give the eager loss and
    gradients within fp32 reordering. Skipped where torch cannot compile here (no compiler)."""
    from hasten.kernels.compile import compile_model, compile_unavailable

    reason = compile_unavailable(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"torch.compile unavailable here: {reason}")
    rollout = rollout_of(short_model, tokenizer, num_generations=2, max_new_tokens=6)
    advantages = torch.linspace(-1.0, 1.0, rollout.num_samples)
    cfg = Config()
    _speed(compile=True, compile_mode="default")(cfg)
    compiled = copy.deepcopy(short_model)
    assert compile_model(compiled, cfg.speed.compile_mode, log=lambda text: None)
    eager_metrics, eager = learner_step(short_model, tokenizer, rollout, advantages, _speed())
    metrics, gradients = learner_step(compiled, tokenizer, rollout, advantages, _speed(compile=True))
    assert metrics["loss"] == pytest.approx(eager_metrics["loss"], abs=1e-5)
    for a, b in zip(eager, gradients):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_vllm_memory_settings_reach_only_the_engines_memory(monkeypatch):
    """speed.vllm_memory_fraction, vllm_kv_cache_mb and vllm_max_model_len size vLLM's memory; speed.vllm_server
    says where it runs. The factory passes them as the engine's memory arguments (or its URL) and nothing else:
    the same model, tokens and dtype whatever they are. The sampling itself (the same distribution, TIS-corrected
    as any other sampler) is tests/test_vllm_engine.py's, where vLLM is installed."""
    from hasten.models import load_policy
    from hasten.config import ModelConfig
    from hasten.rollout import factory, vllm_engine, vllm_server

    built = []
    monkeypatch.setattr(factory, "check_engine_installed", lambda cfg: None)
    monkeypatch.setattr(vllm_engine, "VLLMEngine", lambda *args: built.append(("local", args)))
    monkeypatch.setattr(vllm_server, "VLLMServerEngine", lambda *args: built.append(("server", args)))
    policy = load_policy(ModelConfig(name="tiny"), log=lambda text: None)
    for settings in ({}, {"vllm_memory_fraction": 0.9, "vllm_kv_cache_mb": 0, "vllm_max_model_len": 64},
                     {"vllm_server": "http://127.0.0.1:1"}):
        cfg = Config()
        _speed(engine="vllm", **settings)(cfg)
        factory.make_engine(cfg, policy, log=lambda text: None)
    (plain_kind, plain), (sized_kind, sized), (server_kind, server) = built
    assert (plain_kind, sized_kind, server_kind) == ("local", "local", "server")
    assert plain[:3] == sized[:3] and plain[-1] == sized[-1]  # model, pad, eos, dtype: the same
    assert plain[3:6] == (0.3, 1024, 0) and sized[3:6] == (0.9, 0, 64)  # only the memory arguments move
    assert server[0] == "http://127.0.0.1:1" and server[1:] == plain[:3]
