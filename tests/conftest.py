"""Shared fixtures: the tiny model, a variant that ends completions early, rollouts; and the two test tiers.

The tiers: `make check` runs the fast unit tier (`pytest -m "not slow"`), `make
test` everything. A test is slow by one rule, pytest_collection_modifyitems
below: its file or its own name is in SLOW (each with the reason), or it is
a test of the TRL conformance mirror (tests/conformance), either library's side.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hasten.models.tiny import tiny_model, tiny_tokenizer

# the TRL conformance summary's hooks, here so that every pytest process (the xdist controller too) has them
from conformance.summary import pytest_runtest_logreport, pytest_sessionfinish, pytest_terminal_summary  # noqa: F401
from hasten.rollout import KVCacheEngine, SamplingParams


# file, or file::test (the test's name without its parameters) -> why it is in the slow tier
SUBPROCESS_TRAINING = "`hasten train` in fresh processes"
REEXECUTED = "training in a process re-executed on another allocator"
AGENT_PROCESS = "the agent in a fresh process that must outlive os._exit and a segfault"
QUICK_BENCH = "a --quick benchmark run that trains each side in its own processes (B5, B7, B8)"
SLOW = {
    "test_smollm2.py": "the real default model (SmolLM2-135M)",
    "test_distributed.py": "training under torchrun, ranks in subprocesses",
    "test_fsdp.py": "training under torchrun, ranks in subprocesses",
    "test_operator.py": SUBPROCESS_TRAINING + " (locks, signals, resume)",
    "test_operator_faults.py": SUBPROCESS_TRAINING + " (hang-ups, full disks, other users' files)",
    "test_operator_cache.py": "the model cache converted and shared across processes and users",
    "test_resume.py": SUBPROCESS_TRAINING + ", killed and resumed",
    "test_docs_commands.py": "every command the docs show, trained one step each",
    "test_allocator.py::test_cli_reexecutes_and_results_do_not_change": REEXECUTED,
    "test_allocator.py::test_cli_reexecutes_onto_mimalloc_and_results_do_not_change": REEXECUTED,
    "test_allocator.py::test_a_child_of_a_reexecuted_process_trains": REEXECUTED,
    "test_allocator.py::test_sft_reexecutes_per_profile_and_losses_do_not_change": REEXECUTED,
    "test_api.py::test_trl_quickstart_runs_with_only_the_import_changed": "TRL's quickstart trained in a subprocess",
    "test_speed_learning.py::test_compare_runs_every_profile_end_to_end": "`hasten compare`: each profile in a process",
    **{f"test_operator_round5.py::{name}": SUBPROCESS_TRAINING + " (closed, full or piped output; C locale; no home)"
       for name in ("test_a_closed_or_full_stdout_or_stderr_never_ends_a_run",
                    "test_a_language_model_run_with_stderr_full_or_closed_trains_and_keeps_its_log_lines",
                    "test_a_pipe_whose_reader_left_never_ends_a_run",
                    "test_a_run_name_that_is_not_utf8_saves_and_resumes_under_the_c_locale",
                    "test_a_read_only_or_missing_home_trains_lora_on_tiny")},
    "test_agent_api.py::test_cli_tools_from_a_file_run": SUBPROCESS_TRAINING,
    "test_agent_api.py::test_environment_run_resumes_bit_identically": SUBPROCESS_TRAINING + ", stopped and resumed",
    "test_agent_tools.py::test_exit_crash_and_endless_threads_cost_a_rollout_not_the_run": AGENT_PROCESS,
    "test_agent_tools.py::test_thread_isolation_turns_os_exit_into_an_error": AGENT_PROCESS,
    **{f"test_bench_b8.py::{name}": QUICK_BENCH for name in (
        "test_quick_grid_runs_every_cell_to_the_fixed_length_and_writes_the_report",
        "test_a_cell_over_the_memory_budget_or_the_step_cap_says_why",
        "test_quick_grid_against_trl_generates_the_same_tokens",
        "test_a_model_whose_full_fine_tune_does_not_fit_trains_lora",
        "test_trl_side_trains_lora_with_hastens_adapter_settings_to_the_fixed_length",
        "test_activation_checkpointing_is_chosen_for_a_cell_only_where_it_is_needed")},
    **{f"test_bench.py::{name}": QUICK_BENCH for name in (
        "test_quick_b5_variant_trains_with_its_own_keys", "test_quick_b5_hasten_side",
        "test_b5_only_profiles_skips_the_config_run")},
    **{f"test_bench_b7.py::{name}": QUICK_BENCH for name in (
        "test_quick_b7_hasten_side_runs_the_tool_task", "test_quick_b7_against_trl_uses_one_tool_setup")},
}


def slow_reason(item) -> str | None:
    """Why `item` is in the slow tier, or None: the one rule that marks it."""
    path = Path(str(item.path))
    callspec = getattr(item, "callspec", None)
    if "conformance" in path.parts and callspec is not None and "lib" in callspec.params:
        # TRL's side is the control (stored: tests/conformance/trl_control); hasten's side trains through the
        # TRL-style API, an integration mirror rather than a unit test
        return f"the TRL conformance mirror, {callspec.params['lib']}'s side"
    name = getattr(item, "originalname", item.name)
    return SLOW.get(f"{path.name}::{name}") or SLOW.get(path.name)


@pytest.hookimpl(tryfirst=True)  # before `-m` reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        reason = slow_reason(item)
        if reason is not None:
            item.add_marker(pytest.mark.slow(reason=reason))


@pytest.fixture(autouse=True)
def no_ticker_outlives_its_test():
    """A ticker left open mutes the step heartbeat (ticker.speaking) for the rest of the worker, so a later
    heartbeat test failed or passed by the order xdist gave it: one left open fails the test that left it."""
    from hasten import ticker

    yield
    leaked = list(ticker._open)
    for tick in leaked:
        tick.close()
    assert not leaked, f"a ticker was left open: {[tick.description for tick in leaked]}"


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


def eos_prone_model(tokenizer, boost: float = 3.5):
    """The tiny model with EOS made likely (+boost on its logit), so completions end at varied lengths.

    A forward hook on lm_head adds the boost, so the engine and both learning
    passes see the same distribution.
    """
    model = tiny_model(len(tokenizer))
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = boost
    model.lm_head.register_forward_hook(lambda module, inputs, output: output + bias)
    return model


@pytest.fixture
def model(tokenizer):
    return tiny_model(len(tokenizer))


@pytest.fixture
def short_model(tokenizer):
    return eos_prone_model(tokenizer)


def make_engine(model, tokenizer) -> KVCacheEngine:
    return KVCacheEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])


PROMPTS = ["hello there", "hi", "a much longer prompt, with punctuation!"]


def fp32_and_low_precision(model, tokenizer, precision: str):
    """Two lean engines on one model: fp32 sampling, and sampling in `precision` (bf16 | int8)."""
    from hasten.rollout.lean import LeanEngine

    eos = [tokenizer.eos_token_id]
    return (LeanEngine(model, tokenizer.pad_token_id, eos),
            LeanEngine(model, tokenizer.pad_token_id, eos, sample_precision=precision))


def encode(tokenizer, texts=PROMPTS) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in texts]


def rollout_of(model, tokenizer, num_generations=4, max_new_tokens=12, temperature=1.0, seed=0):
    engine = make_engine(model, tokenizer)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    return engine.generate(encode(tokenizer), num_generations, sampling, seed=seed)


def peft_head_model(model, wrap: str):
    """A copy of `model` with LoRA on q/v and its LM head wrapped by peft: LoRA on lm_head (wrap="lora") or lm_head
    trained whole (wrap="modules_to_save"). Either wrapper holds a plain nn.Linear inside it."""
    import copy
    import warnings

    from peft import LoraConfig, get_peft_model

    lora = (LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"]) if wrap == "lora"
            else LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note on tied embeddings in an adapter
        return get_peft_model(copy.deepcopy(model), lora)


def learner_step(model, tokenizer, rollout, advantages, configure, **step_kwargs) -> tuple[dict, list[torch.Tensor]]:
    """One Learner.step on a copy of `model` with a Config that `configure(cfg)` adjusts.

    Returns (metrics, gradients as the optimizer saw them). Equivalence tests
    compare the accumulated gradient, not the Adam update: Adam divides
    near-zero gradients by their own size, which amplifies rounding.
    """
    import copy

    from hasten.config import Config
    from hasten.models import Policy
    from hasten.train.learner import Learner

    cfg = Config()
    configure(cfg)
    from hasten.train.learner import Correction

    # off_policy / importance_cap: the run's Correction (async staleness, truncated importance sampling)
    correction = Correction(stale=step_kwargs.pop("off_policy", False), cap=step_kwargs.pop("importance_cap", None))
    learner = Learner.from_config(Policy(copy.deepcopy(model), tokenizer, "tiny"), cfg, correction=correction)
    grads: list[torch.Tensor] = []
    learner.optimization.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: grads.extend(p.grad.clone() for p in learner.parameters))
    return learner.step(rollout, advantages, **step_kwargs), grads


def tiny_config(**speed):
    """A default Config on the tiny model with these speed.* keys set, through the config's own setter: a
    name that left `speed` sets its new key (with the deprecation line), an unknown one is a ConfigError."""
    from hasten.config import Config, ModelConfig, set_key

    cfg = Config()
    cfg.model = ModelConfig(name="tiny")
    for key, value in speed.items():
        set_key(cfg, f"speed.{key}", value)
    return cfg


LETTERS = '''
def letters(prompts, completions, **kwargs):
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
'''


@pytest.fixture
def letters_task(tmp_path):
    """A 40-row JSONL task and a reward file (the share of lowercase letters) in tmp_path."""
    import json

    rows = [{"prompt": f"write letters {i}:"} for i in range(40)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "rewards.py").write_text(LETTERS)
    return tmp_path


def letters_config(data, name: str, **extra):
    """A short tiny-model GRPO run on letters_task's files: 4 steps, 2 prompts x 4, one thread."""
    from hasten.config import load_config

    pairs = {"model.name": "tiny", "task.name": "jsonl", "task.path": str(data / "data.jsonl"),
             "rewards.extra": [f"{data / 'rewards.py'}:letters"], "train.steps": 4, "train.prompts_per_step": 2,
             "train.lr": 3e-3, "train.num_threads": 1, "generation.num_generations": 4,
             "generation.max_new_tokens": 8, "eval.num_examples": 0, "output.dir": str(data / "runs"),
             "output.name": name, "output.progress": "off", "output.plot": False, **extra}
    return load_config(overrides=list(pairs.items()))


def run_metrics(summary: dict) -> list[dict]:
    """The records of a finished run's metrics.jsonl."""
    import json
    from pathlib import Path

    return [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]


def head_dim_64_model(vocab_size: int, family: str = "llama"):
    """A 2-layer Llama (or Qwen2, with its q/k/v biases) with head_dim 64 (3 query heads on one KV head): a
    shape speed.decode_attention's fused kernels take (the tiny model's head_dim 16 is not)."""
    import transformers

    name = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return getattr(transformers, f"{name}ForCausalLM")(config).eval()
    finally:
        torch.random.set_rng_state(state)


def pass_gradients(model, rollout, advantages, precision: str, recast: bool, chunk: int):
    """One packed learning pass of `model` in `precision`, its linears recast or on autocast's: (layers routed,
    log-probs, every gradient) after backward of an advantage-weighted loss."""
    from hasten.kernels.precision import Precision, fp32_head
    from hasten.kernels.recast_linear import recast_linears
    from hasten.train.packing import backbone_and_head, packed_logprobs

    model.zero_grad(set_to_none=True)
    rows = torch.arange(rollout.num_samples)
    head = backbone_and_head(model)[1]
    with Precision(precision, torch.device("cpu")).autocast(), \
            fp32_head(head, precision == "bf16_fp32head"), recast_linears(model, recast, leave=head) as routed:
        logps = packed_logprobs(model, rollout, rows, 1.0, True, chunk, grouped=True, shared_prefix=True).logps
    mask = rollout.completion_mask.to(logps.dtype)
    (-(advantages[:, None] * logps * mask).sum() / mask.sum()).backward()
    return routed, logps.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def native_lora_model(tokenizer, **lora):
    """The tiny model on the native implementation, LoRA on all seven projections (LoraConfig's other fields:
    `lora`), B nonzero (a trained adapter)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    from hasten.models.llama import NativeLlamaForCausalLM
    from hasten.models.tiny import tiny_model
    from hasten.rollout.lean import PROJECTIONS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note on tied embeddings in an adapter
        model = get_peft_model(NativeLlamaForCausalLM.from_hf(tiny_model(len(tokenizer))).train(),
                               LoraConfig(**{"r": 4, "target_modules": list(PROJECTIONS), **lora}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    return model
