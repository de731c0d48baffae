"""The conformance suite's switch (TRL or hasten), its tiny local models and datasets, and its summary.

Every test in this folder takes the `lib` fixture, run once with TRL's
trainers (the control; skipped when trl is not installed) and once with
hasten's. The terminal summary says how many of the tests that pass on TRL
pass on hasten, and lists the ones hasten declares unsupported (those pass on
hasten only by failing with its one-line "not supported" error).

TRL's side is a control that changes only with TRL: its outcome per test is
stored in trl_control/<trl version>.json and read from there, so a run trains
on TRL only for a test the stored file lacks, or when TRL's installed version
has no file yet, or when asked (HASTEN_TRL_CONTROL=1, `make trl-control`);
each TRL run it does adds its outcomes to that file. hasten's side always runs.

Models are built here, tiny and random (no hub downloads): causal LMs of the
architectures TRL's tests name (Qwen2, Llama, Qwen3-MoE, Glm4-MoE) and sequence-
classification reward models (Qwen2, Llama), each saved with hasten's
offline byte-level ChatML tokenizer so both libraries load the same files.
"""

from __future__ import annotations

import functools
import itertools
import types
from pathlib import Path

import pytest
import torch

from hasten.errors import UserError

from .summary import PROPERTY, stored_control, conformance_key, trl_version

ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8}),
    # a mixture of experts whose config declares no router_aux_loss_coef and whose forward returns no aux loss
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "head_dim": 8}),
    # a hybrid: one mamba layer (its cache holds conv and ssm states, not keys and values), one attention layer
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   {"hybrid_override_pattern": "M*", "layers_block_type": ["mamba", "attention"], "mamba_num_heads": 4,
                    "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 16}),
}
REWARD_ARCHITECTURES = {"qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification"),
                        "llama": ("LlamaConfig", "LlamaForSequenceClassification")}


def _save(kind: str, config_name: str, class_name: str, directory: Path, seed: int, **extra) -> str:
    import transformers

    from hasten.models.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(config)
    path = directory / kind
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, str]:
    """name -> directory: causal LMs by architecture, and reward models as "<arch>_reward"."""
    root = tmp_path_factory.mktemp("tiny-models")
    paths = {name: _save(name, config, klass, root, seed, **extra)
             for seed, (name, (config, klass, extra)) in enumerate(ARCHITECTURES.items())}
    for seed, (name, (config, klass)) in enumerate(REWARD_ARCHITECTURES.items()):
        paths[f"{name}_reward"] = _save(f"{name}_reward", config, klass, root, 100 + seed, num_labels=1)
    return paths


PROMPTS = ["Beautiful is better than", "Explicit is", "Simple is better", "Complex", "Flat is better than",
           "Sparse is better", "Readability", "Special cases aren't special", "Although practicality beats"]
TEST_PROMPTS = ["Errors should never", "Unless explicitly", "In the face of ambiguity, refuse"]


def prompt_dataset(kind: str = "standard", split: str = "train"):
    """TRL's zen prompt-only shapes: a "prompt" string, or a list with one user message."""
    from datasets import Dataset

    prompts = PROMPTS if split == "train" else TEST_PROMPTS
    if kind == "conversational":
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in prompts]})
    return Dataset.from_dict({"prompt": prompts})


def sft_dataset(kind: str):
    from datasets import Dataset

    if kind == "language_modeling":
        return Dataset.from_dict({"text": [f"{p} {q}." for p, q in itertools.pairwise(PROMPTS)]})
    if kind == "conversational_language_modeling":
        return Dataset.from_dict({"messages": [[{"role": "user", "content": p}, {"role": "assistant", "content": q}]
                                               for p, q in itertools.pairwise(PROMPTS)]})
    return Dataset.from_dict({"prompt": PROMPTS[:-1], "completion": [f" {q}." for q in PROMPTS[1:]]})


@pytest.fixture(params=["trl", "hasten"])
def lib(request) -> types.SimpleNamespace:
    """The trainer module under test: TRL's (control) or hasten's, with the same names."""
    if request.param == "trl":
        module = pytest.importorskip("trl")
    else:
        import hasten.api as module
    # transformers refuses its bf16 default without a GPU unless told use_cpu (TRL's side only: hasten
    # picks its device itself)
    machine = {"use_cpu": True} if request.param == "trl" and not torch.cuda.is_available() else {}
    return types.SimpleNamespace(name=request.param, GRPOConfig=module.GRPOConfig, GRPOTrainer=module.GRPOTrainer,
                                 SFTConfig=module.SFTConfig, SFTTrainer=module.SFTTrainer, machine=machine)


def unsupported_on_hasten(reason: str):
    """Mark a test hasten declines: on hasten it passes only if the test fails with one UserError line
    saying "not supported" (never a traceback, never a silent ignore); on TRL it runs as written."""
    def decorate(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            if kwargs["lib"].name != "hasten":
                return test(*args, **kwargs)
            with pytest.raises(UserError) as caught:
                test(*args, **kwargs)
            message = str(caught.value)
            assert "\n" not in message and "not supported" in message, message
        run.unsupported = reason
        return run
    return decorate


# ------------------------------------------------------------------ the summary (summary.py; registered by tests/conftest.py)


def pytest_collection_modifyitems(config, items):
    """TRL's side of a test whose outcome is stored does not run (deselected)."""
    version = trl_version()
    stored = stored_control(version) if version else {}
    kept, cached = [], []
    for item in items:
        key = conformance_key(item)
        (cached if key is not None and key[0] == "trl" and key[1] in stored else kept).append(item)
    if cached:
        config.hook.pytest_deselected(items=cached)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    key = conformance_key(item)
    if key is not None:
        outcome.get_result().user_properties.append(
            (PROPERTY, [*key, getattr(item.function, "unsupported", None)]))
