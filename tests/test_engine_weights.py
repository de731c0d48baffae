"""speed.engine_weights (rollout/shared_weights.py): the lean engine sampling from the training weights
(`shared`) gives the tokens and log-probs of its own fused, packed copy (`copy`), on the full model and a
LoRA policy, also after an optimizer update that no resync announced; it keeps nothing weight-sized of
its own; `auto`'s rule; the config errors; the bench's memory estimate counts no copy under shared."""

from __future__ import annotations

import pytest
import torch
from conftest import encode
from test_lean_engine import PROMPTS, assert_same_rollout, lora_pair
from test_model_families import family_model

from hasten.rollout import SamplingParams
from hasten.rollout.lean import LeanEngine
from hasten.rollout.shared_weights import COPY_SHARE, resolve

GIB = 1024**3


def engines(model, tokenizer) -> tuple[LeanEngine, LeanEngine]:
    ids = (tokenizer.pad_token_id, [tokenizer.eos_token_id])
    return LeanEngine(model, *ids, weights="copy"), LeanEngine(model, *ids, weights="shared")


def assert_same_samples(copy_engine, shared_engine, tokenizer, num_generations=3):
    prompts = encode(tokenizer, PROMPTS)
    for sampling in (SamplingParams(max_new_tokens=12, temperature=0.0),
                     SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95)):
        for seed in (0, 1):
            assert_same_rollout(copy_engine.generate(prompts, num_generations, sampling, seed=seed),
                                shared_engine.generate(prompts, num_generations, sampling, seed=seed))


def update(policy, tokenizer, fused: bool = True) -> None:
    """One AdamW step on a next-token loss. fused: torch's fused CPU AdamW, which leaves `_version` alone."""
    trainable = [parameter for parameter in policy.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.05, fused=fused)
    ids = torch.tensor([encode(tokenizer, PROMPTS)[2] * 3])  # (1, L)
    logits = policy(input_ids=ids).logits  # (1, L, V)
    torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
    optimizer.step()


def test_shared_samples_as_the_copy(model, tokenizer):
    assert_same_samples(*engines(model, tokenizer), tokenizer)


@pytest.mark.parametrize("kind", ["qwen2-untied", "qwen3-bias", "llama-biases"])
def test_shared_samples_as_the_copy_with_biases_qk_norm_and_untied_heads(kind, tokenizer):
    assert_same_samples(*engines(family_model(kind, len(tokenizer)), tokenizer), tokenizer)


def test_shared_follows_a_full_update_without_a_resync(model, tokenizer):
    copy_engine, shared_engine = engines(model, tokenizer)
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12)
    before = shared_engine.generate(prompts, 2, sampling, seed=0)
    update(model, tokenizer)  # fused AdamW: no version bump, and no weights_changed() for the shared engine
    copy_engine.weights_changed()  # the copy needs it (test_lean_engine.py)
    after = shared_engine.generate(prompts, 2, sampling, seed=0)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert_same_rollout(copy_engine.generate(prompts, 2, sampling, seed=0), after)


@pytest.mark.parametrize("native", [True, False])
def test_lora_shared_samples_as_the_merged_copy_before_and_after_an_update(tokenizer, native):
    hf, native_policy = lora_pair(tokenizer)
    policy = native_policy if native else hf
    copy_engine, shared_engine = engines(policy, tokenizer)
    before = {name: parameter.clone() for name, parameter in policy.named_parameters()}
    assert_same_samples(copy_engine, shared_engine, tokenizer)
    assert all(torch.equal(before[name], parameter) for name, parameter in policy.named_parameters())
    update(policy, tokenizer)  # the adapters move; the frozen base does not
    assert any(not torch.equal(before[name], parameter) for name, parameter in policy.named_parameters())
    copy_engine.weights_changed()
    assert_same_samples(copy_engine, shared_engine, tokenizer)  # read live: no resync


def test_lora_shared_follows_disabled_adapters(tokenizer):
    _, policy = lora_pair(tokenizer)
    copy_engine, shared_engine = engines(policy, tokenizer)
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12, temperature=0.9)
    adapted = shared_engine.generate(prompts, 2, sampling, seed=0)
    with policy.disable_adapter():  # the KL reference's view: the base model alone
        copy_engine.weights_changed()
        base = shared_engine.generate(prompts, 2, sampling, seed=0)
        assert_same_rollout(copy_engine.generate(prompts, 2, sampling, seed=0), base)
    assert not torch.equal(adapted.completion_ids, base.completion_ids)


def engine_tensors(value, seen=None):
    """Every tensor an engine holds, through its attributes, containers and the objects they hold."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from engine_tensors(item, seen)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from engine_tensors(item, seen)
    elif hasattr(value, "__dict__"):
        yield from engine_tensors(vars(value), seen)


@pytest.mark.parametrize("lora", [False, True])
def test_shared_holds_nothing_weight_sized_of_its_own(model, tokenizer, lora):
    policy = lora_pair(tokenizer)[1] if lora else model
    copy_engine, shared_engine = engines(policy, tokenizer)
    for engine in (copy_engine, shared_engine):  # each builds its weights at its first generate
        engine.generate(encode(tokenizer, PROMPTS), 2, SamplingParams(max_new_tokens=4), seed=0)
    storages = {parameter.untyped_storage().data_ptr() for parameter in policy.parameters()}
    smallest = min(parameter.numel() for parameter in policy.parameters() if parameter.dim() == 2)

    def own(tensor) -> bool:
        if tensor.is_mkldnn:  # oneDNN's packed weights (opaque, no storage to compare): the copy's
            return True
        return tensor.untyped_storage().data_ptr() not in storages

    def own_large(engine):
        return [tensor.shape for tensor in engine_tensors(vars(engine)) if tensor.numel() >= smallest and own(tensor)]

    assert own_large(shared_engine) == []
    assert own_large(copy_engine)  # the check sees the copy's fused matrices


def test_auto_picks_shared_when_the_copy_is_large_against_memory():
    machine = 32 * GIB
    assert resolve("auto", 135_000_000, "fp32", machine)[0] == "copy"  # SmolLM2-135M: 0.5 GiB
    assert resolve("auto", 1_540_000_000, "fp32", machine)[0] == "shared"  # Qwen2.5-1.5B: 5.7 GiB > 4
    assert resolve("auto", 1_540_000_000, "fp32", 64 * GIB)[0] == "copy"
    edge = machine // (4 * COPY_SHARE)  # exactly 1/8: still copy
    assert resolve("auto", edge, "fp32", machine)[0] == "copy" and resolve("auto", edge + 1, "fp32", machine)[0] == (
        "shared")
    for precision in ("bf16", "int8"):  # the copy is already low precision
        assert resolve("auto", 1_540_000_000, precision, machine)[0] == "copy"
    assert resolve("shared", 10, "fp32", machine)[0] == "shared" and resolve("copy", 10**10, "fp32", 1)[0] == "copy"


def test_factory_resolves_auto_once_and_logs_it(model, tokenizer, monkeypatch):
    from hasten import device
    from hasten.config import load_config
    from hasten.models import Policy
    from hasten.rollout.factory import make_engine

    policy = Policy(model=model, tokenizer=tokenizer, source="tiny")
    parameters = sum(parameter.numel() for parameter in {id(p): p for p in model.parameters()}.values())
    for memory, expected in ((4 * parameters * COPY_SHARE, "copy"), (4 * parameters * COPY_SHARE - 1, "shared")):
        monkeypatch.setattr(device, "machine_bytes", lambda device="cpu", memory=memory: memory)
        logged: list[str] = []
        engine = make_engine(load_config(overrides=[("model.device", "cpu")]), policy, logged.append)
        assert engine.weights == expected
        weights = [line for line in logged if line.startswith("speed.engine_weights")]
        assert len(weights) == 1 and weights[0].startswith(f"speed.engine_weights=auto: {expected} (")
        assert logged[0].startswith("generation.precision=auto: fp32 (")  # decided first: it sizes the copy
    for setting in ("copy", "shared"):
        logged = []
        cfg = load_config(overrides=[("model.device", "cpu"), ("speed.engine_weights", setting)])
        assert make_engine(cfg, policy, logged.append).weights == setting
        assert not [line for line in logged if line.startswith("speed.engine_weights")]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_shared_with_low_precision_sampling_is_a_config_error(model, tokenizer, precision):
    from hasten.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="engine_weights=shared.*generation_precision") as error:
        load_config(overrides=[("speed.engine_weights", "shared"), ("generation.precision", precision)])
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="engine_weights=shared.*vLLM"):
        load_config(overrides=[("speed.engine_weights", "shared"), ("speed.engine", "vllm")])
    with pytest.raises(ValueError, match="shared with fp32"):
        LeanEngine(model, tokenizer.pad_token_id, [0], sample_precision=precision, weights="shared")


def test_memory_estimate_counts_no_copy_under_shared():
    from hasten.bench import scaling
    from hasten.bench.cost import Shape
    from hasten.config import load_config

    shape = Shape.from_config(family_model("qwen2-tied", 300).config)
    estimates = {setting: scaling.memory_estimate(shape, load_config(overrides=[("speed.engine_weights", setting)]),
                                                  "hasten") for setting in ("copy", "shared")}
    assert estimates["copy"]["runtime"] - estimates["shared"]["runtime"] == 4 * shape.parameters(tied=True)
    trl = scaling.memory_estimate(shape, load_config(overrides=[("speed.engine_weights", "copy")]), "trl")
    assert trl["runtime"] == estimates["shared"]["runtime"]  # TRL samples from its training weights


@pytest.mark.parametrize("lora", [False, True])
def test_training_with_shared_weights_learns_what_the_copy_learns(letters_task, lora):
    """Three GRPO steps through the trainer (weights_changed after each update, a fused AdamW): the same
    rewards and losses whether the engine samples from its copy or from the training weights."""
    from conftest import letters_config, run_metrics

    from hasten.train.trainer import train

    extra = {"train.steps": 3, "model.lora": lora, "model.lora_r": 4}
    records = {setting: run_metrics(train(letters_config(letters_task, f"{setting}-{lora}",
                                                         **{"speed.engine_weights": setting}, **extra),
                                          log=lambda _: None)) for setting in ("copy", "shared")}
    assert len(records["copy"]) == len(records["shared"]) == 3
    for copied, shared in zip(records["copy"], records["shared"]):
        for key in ("reward_mean", "loss", "grad_norm", "completion_length", "entropy"):
            assert shared[key] == pytest.approx(copied[key], abs=1e-5), key


@pytest.mark.parametrize("drafter", ["ngram", "layers"])
def test_speculative_decoding_over_shared_weights_equals_over_the_copy(model, tokenizer, drafter):
    from hasten.rollout.drafters import ModelDrafter, NgramDrafter
    from hasten.rollout.speculative import SpeculativeEngine

    def speculative(engine):  # layers: the policy's first layer drafts, through the same shared projections
        return SpeculativeEngine(engine, NgramDrafter(3) if drafter == "ngram" else ModelDrafter(layers=1), 3)

    copy_engine, shared_engine = engines(model, tokenizer)
    prompts = encode(tokenizer, PROMPTS)
    for sampling in (SamplingParams(max_new_tokens=12, temperature=0.0), SamplingParams(max_new_tokens=12)):
        assert_same_rollout(speculative(copy_engine).generate(prompts, 2, sampling, seed=0),
                            speculative(shared_engine).generate(prompts, 2, sampling, seed=0))


def test_token_budget_counts_no_engine_copy_under_shared(monkeypatch):
    """speed.token_budget=auto leaves the copy's bytes to the activations where the engine shares weights."""
    from hasten.config import load_config
    from hasten.train import learner, microbatch

    large = family_model("qwen2-tied", 300).config
    large.hidden_size, large.intermediate_size, large.num_hidden_layers = 1536, 8960, 28  # Qwen2.5-1.5B's body
    large.vocab_size, large.num_attention_heads, large.num_key_value_heads = 151936, 12, 2
    memory = 24 * GIB  # 4 x 1.5B bytes > 3 GiB: auto shares
    monkeypatch.setattr(learner, "machine_bytes", lambda device="cpu": memory)
    monkeypatch.setattr(microbatch, "machine_bytes", lambda device="cpu": memory)
    budgets = {setting: learner.token_budget(load_config(overrides=[("speed.engine_weights", setting),
                                                                    ("model.lora", True)]), False, large)
               for setting in ("copy", "shared", "auto")}
    assert budgets["shared"] > budgets["copy"] and budgets["auto"] == budgets["shared"]
    copy_bytes = 4 * microbatch.parameter_count(large)
    assert microbatch.static_bytes(large, True, 2048) - microbatch.static_bytes(large, True, 2048, False) == copy_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_copy_is_built_by_the_first_generate_in_its_precision(model, tokenizer, precision):
    """No copy at construction (an fp32 one there set the peak of a bf16 run): the first sampled generate
    builds it in generation.precision; a greedy one (evaluation) in fp32."""
    engine = LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], sample_precision=precision)
    assert engine.layers == [] and engine.head is None and engine.num_layers == len(model.model.layers)
    engine.generate(encode(tokenizer, PROMPTS), 2, SamplingParams(max_new_tokens=4, temperature=1.0), seed=0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    assert len(engine.layers) == engine.num_layers and engine.layers[0].gate_up.dtype == dtype
    engine.generate(encode(tokenizer, PROMPTS), 1, SamplingParams(max_new_tokens=4, temperature=0.0), seed=0)
    assert engine.layers[0].gate_up.dtype == torch.float32


def test_the_fp32_copy_of_an_evaluation_is_dropped_before_the_bf16_one_is_built(model, tokenizer, monkeypatch):
    """A greedy call (evaluation) builds the fp32 copy; the next sampled call's bf16 copy is built after the fp32
    matrices are dropped, so two sampling copies never coexist (they did: reused as `previous`, all held)."""
    import weakref

    from hasten.rollout import lean

    engine = LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id], sample_precision="bf16")
    prompts = encode(tokenizer, PROMPTS)
    engine.generate(prompts, 1, SamplingParams(max_new_tokens=2, temperature=0.0), seed=0)
    fp32 = [weakref.ref(layer.gate_up) for layer in engine.layers]
    assert engine.layers[0].gate_up.dtype == torch.float32
    alive = []
    prepare = lean.Matmul.prepare

    def spy(self, weight, previous=None, exact=False, name=""):
        alive.append(sum(ref() is not None for ref in fp32))
        return prepare(self, weight, previous, exact, name)

    monkeypatch.setattr(lean.Matmul, "prepare", spy)
    engine.generate(prompts, 2, SamplingParams(max_new_tokens=2, temperature=1.0), seed=0)
    assert engine.layers[0].gate_up.dtype == torch.bfloat16 and alive and set(alive) == {0}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_released_copy_is_freed_and_rebuilt_to_the_same_samples(model, tokenizer, precision):
    """release_weights (the trainer's call before each learning pass) drops the copy; the next generate
    rebuilds it and samples what a kept copy samples. Shared weights hold nothing to release."""
    ids = (tokenizer.pad_token_id, [tokenizer.eos_token_id])
    kept, released = (LeanEngine(model, *ids, sample_precision=precision) for _ in range(2))
    prompts, sampling = encode(tokenizer, PROMPTS), SamplingParams(max_new_tokens=12, temperature=0.9)
    assert_same_rollout(kept.generate(prompts, 3, sampling, seed=0), released.generate(prompts, 3, sampling, seed=0))
    released.release_weights()
    assert released.layers == [] and released.head is None
    assert_same_rollout(kept.generate(prompts, 3, sampling, seed=1), released.generate(prompts, 3, sampling, seed=1))
    assert len(released.layers) == len(kept.layers)
    shared = LeanEngine(model, *ids, weights="shared")
    shared.generate(prompts, 1, sampling, seed=0)
    shared.release_weights()
    assert len(shared.layers) == len(kept.layers)  # views of the live parameters, kept


def test_training_releases_the_copy_before_each_learning_pass_and_learns_the_same(letters_task, monkeypatch):
    """Three GRPO steps: the trainer releases the engine's copy before every learning pass, and the run's
    rewards, losses and gradient norms are those of a run whose copy is kept (release made a no-op)."""
    from conftest import letters_config, run_metrics

    from hasten.train.trainer import train

    calls = []
    release = LeanEngine.release_weights

    def counted(engine):
        calls.append(len(engine.layers))
        release(engine)

    records = {}
    for label, method in (("released", counted), ("kept", lambda engine: None)):
        monkeypatch.setattr(LeanEngine, "release_weights", method)
        cfg = letters_config(letters_task, label, **{"speed.engine_weights": "copy", "train.steps": 3})
        records[label] = run_metrics(train(cfg, log=lambda _: None))
    assert len(calls) == 3 and all(calls)  # a built copy each time
    for released, kept in zip(records["released"], records["kept"], strict=True):
        for key in ("reward_mean", "loss", "grad_norm", "completion_length", "entropy"):
            assert released[key] == kept[key], key
