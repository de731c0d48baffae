"""The CUDA paths a reading found wrong (issue 55), each checked on the CPU.

No GPU runs here, so a second device is faked: `meta` tensors (a GPU's tensors
in that no value can be read back without a sync, which meta refuses), a
TorchFunctionMode that refuses mixed-device operands as CUDA does (the CPU and
meta silently accept them), monkeypatched torch.cuda queries, a fake `vllm`
module that records LLM()'s arguments, and WORLD_SIZE set as torchrun sets it.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hasten.config import ConfigError, load_config
from hasten.models import Policy, Reference
from hasten.models.tiny import tiny_model, tiny_tokenizer


class StrictDevices(TorchFunctionMode):
    """Refuse an op whose tensor operands lie on different devices (CUDA raises; the CPU and meta do not).
    0-dim tensors are exempt, as CUDA exempts CPU scalars."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {value.device for value in list(args) + list(kwargs.values())
                   if isinstance(value, torch.Tensor) and value.dim() > 0}
        if len(devices) > 1 and func not in (torch.Tensor.to, torch.Tensor.copy_):
            raise RuntimeError(f"{func.__name__}: tensors on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def fake_gpus(monkeypatch, count: int = 2, bf16: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


# ------------------------------------------------------------------ the KL reference


def policy_of(model) -> Policy:
    return Policy(model=model, tokenizer=tiny_tokenizer(), source="tiny")


def test_mix_in_brings_the_policy_to_the_reference_device():
    """An offloaded reference (here: meta) mixed with a policy elsewhere (the CPU): each operand of the
    update is moved first; the old add_ handed the policy's tensor over as it was."""
    model = tiny_model(len(tiny_tokenizer()))
    reference = Reference(policy_of(model))
    reference.frozen.to("meta")
    with StrictDevices():
        reference.mix_in(model, 0.5)
    assert all(parameter.device.type == "meta" for parameter in reference.frozen.parameters())


def test_mix_in_moves_the_reference_alpha_of_the_way():
    model = tiny_model(len(tiny_tokenizer()))
    reference = Reference(policy_of(model))
    before = [parameter.clone() for parameter in reference.frozen.parameters()]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    reference.mix_in(model, 0.25)
    for old, new, source in zip(before, reference.frozen.parameters(), model.parameters()):
        torch.testing.assert_close(new, 0.75 * old + 0.25 * source.detach())


@contextlib.contextmanager
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_mix_in_gathers_fsdp_shards(tmp_path):
    """Under FSDP the policy's parameters are DTensor shards: the reference adds whole tensors (the old
    code added the DTensor into the plain tensor, which torch refuses)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = tiny_model(len(tiny_tokenizer()))
    reference = Reference(policy_of(model))
    expected = [0.5 * frozen + 0.5 * source.detach()
                for frozen, source in zip(reference.frozen.parameters(), model.parameters())]
    with one_rank_group(tmp_path):
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.ParameterList(
            [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in model.parameters()])
        reference.mix_in(sharded, 0.5)
    for new, want in zip(reference.frozen.parameters(), expected):
        torch.testing.assert_close(new, want)


def test_offloaded_reference_is_copied_onto_the_cpu_directly():
    """speed.offload_reference: the frozen copy is made where it will live, never first beside the policy
    (the old deepcopy made it on the policy's device; offloading moved it at the first reference pass)."""
    from hasten.models import frozen_copy

    model = tiny_model(len(tiny_tokenizer()))
    reference = Reference(policy_of(model), offload=True)
    assert {parameter.device.type for parameter in reference.frozen.parameters()} == {"cpu"}
    assert not any(parameter.requires_grad for parameter in reference.frozen.parameters())
    for mine, theirs in zip(reference.frozen.parameters(), model.parameters()):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()
    frozen = frozen_copy(model, "meta")  # another device than the source's: every tensor made there
    assert {tensor.device.type for tensor in [*frozen.parameters(), *frozen.buffers()]} == {"meta"}
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert (frozen.lm_head.weight is frozen.model.embed_tokens.weight) is tied  # tied weights stay tied


# ------------------------------------------------------------------ vLLM under torchrun and on cuda:N


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` module whose LLM records its arguments; its worker's reload_weights takes tensors unless
    `old` is set (vLLM before weights_iterator)."""
    calls: dict = {"old": False}

    class Runner:
        def reload_weights(self, weights_iterator=None, process_weights_after_loading=True):
            calls.setdefault("reloads", []).append(list(weights_iterator))

    class OldRunner:
        def reload_weights(self):
            pass

    class LLM:
        def __init__(self, model, **options):
            calls["options"] = options
            self.worker = types.SimpleNamespace(model_runner=OldRunner() if calls["old"] else Runner())

        def collective_rpc(self, method, kwargs=None):
            if callable(method):
                return [method(self.worker)]
            return [getattr(self.worker.model_runner, method)(**(kwargs or {}))]

        def reset_prefix_cache(self):
            pass

    module = types.ModuleType("vllm")
    module.LLM = LLM
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.11.0")
    return calls


def test_vllm_under_torchrun_uses_the_external_launcher(fake_vllm, monkeypatch):
    from hasten.rollout.vllm_engine import VLLMEngine

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = tiny_model(len(tiny_tokenizer()))
    VLLMEngine(model, 0, [1])
    assert fake_vllm["options"]["distributed_executor_backend"] == "external_launcher"
    monkeypatch.setenv("WORLD_SIZE", "1")
    VLLMEngine(model, 0, [1])
    assert "distributed_executor_backend" not in fake_vllm["options"]


def test_vllm_refuses_a_gpu_it_cannot_take():
    from hasten.rollout.vllm_engine import placement

    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=1"):
        placement(torch.device("cuda", 1), 1)
    assert placement(torch.device("cuda", 0), 1) == {}
    assert placement(torch.device("cuda", 1), 2) == {"distributed_executor_backend": "external_launcher"}


def test_vllm_cuda_n_is_refused_before_the_model_loads(fake_vllm, monkeypatch):
    from hasten.rollout.factory import check_engine_installed

    fake_gpus(monkeypatch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(overrides=[("speed.engine", "vllm"), ("model.device", "cuda:1")])
    with pytest.raises(ConfigError, match="GPU 0"):
        check_engine_installed(cfg)


def test_vllm_without_tensor_reload_is_refused_in_one_line(fake_vllm, monkeypatch):
    from hasten.rollout.vllm_engine import VLLMEngine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = tiny_model(len(tiny_tokenizer()))
    fake_vllm["old"] = True
    with pytest.raises(ConfigError, match=r"vLLM 0\.11\.0 cannot take pushed weights") as error:
        VLLMEngine(model, 0, [1])
    assert "\n" not in str(error.value)
    fake_vllm["old"] = False
    engine = VLLMEngine(model, 0, [1])
    engine.weights_changed()
    assert len(fake_vllm["reloads"]) == 1


# ------------------------------------------------------------------ profiles under torchrun on CUDA


@pytest.mark.parametrize("distributed", ["ddp", "fsdp"])
@pytest.mark.parametrize("profile", ["balanced", "aggressive"])
def test_profile_under_torchrun_on_cuda_resolves(monkeypatch, profile, distributed):
    """--profile balanced under torchrun on CUDA asked for dynamic sampling (and under FSDP compile),
    both config errors there; the profile now leaves them out, and says so."""
    fake_gpus(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config(overrides=[("model.device", "cuda"), ("train.distributed", distributed)], profile=profile)
    assert cfg.algo.dynamic_sampling is False and cfg.algo.curriculum != "success_rate"
    assert cfg.speed.compile is (distributed == "ddp")
    from hasten.profiles import held_back_notes

    notes = held_back_notes(cfg)
    assert any(note.startswith("algo.dynamic_sampling") for note in notes)
    assert any(note.startswith("speed.compile") for note in notes) is (distributed == "fsdp")


def test_profile_in_one_process_keeps_its_choices(monkeypatch):
    fake_gpus(monkeypatch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(overrides=[("model.device", "cuda")], profile="balanced")
    assert cfg.algo.dynamic_sampling is True and cfg.speed.compile is True
    from hasten.profiles import held_back_notes

    assert held_back_notes(cfg) == []


def test_the_users_own_choice_is_still_an_error(monkeypatch):
    """Only the profile's choices are dropped: the same setting typed by the user stays a config error."""
    fake_gpus(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_config(overrides=[("model.device", "cuda"), ("algo.dynamic_sampling", True)], profile="balanced")


def test_plan_line_says_what_the_profile_left_out():
    from hasten.train.learner import LearningPlan
    from hasten.train.plan import Plan

    learning = LearningPlan.__new__(LearningPlan)
    object.__setattr__(learning, "describe", lambda: "packed learning pass")
    plan = Plan("cuda:0", "lean", "native", learning, False, False, 0,
                held_back=("algo.dynamic_sampling (not under torchrun yet)",))
    assert "profile left out for this launch: algo.dynamic_sampling (not under torchrun yet)" in plan.describe()


# ------------------------------------------------------------------ wrong choices


def test_bf16_counts_native_support_only(monkeypatch):
    """V100/T4 emulate bf16: torch.cuda.is_bf16_supported() says yes unless including_emulation=False."""
    from hasten.device import bf16_supported
    from hasten.train.optimization import sft_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert bf16_supported(torch.device("cuda", 0)) is False
    assert sft_precision("auto", torch.device("cuda", 0)) == "fp16"


def test_trackers_only_on_rank_0(monkeypatch, tmp_path):
    """torchrun: one W&B / TensorBoard run per training run (SFT built trackers on every rank)."""
    from hasten.train import distributed, tracking

    made = []
    monkeypatch.setitem(tracking.WRITERS, "tensorboard", lambda run: made.append(run) or object())
    monkeypatch.setitem(tracking.PACKAGES, "tensorboard", ("json",))
    cfg = load_config(overrides=[("output.report_to", ["tensorboard"])])
    monkeypatch.setattr(distributed, "rank", lambda: 1)
    assert tracking.make_trackers(cfg, object(), list) == [] and made == []
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    assert len(tracking.make_trackers(cfg, object(), list)) == 1 and len(made) == 1


# ------------------------------------------------------------------ memory


def test_lean_engine_drops_its_fused_copies_when_the_weights_are_sharded(monkeypatch):
    """Under FSDP the engine's fused qkv / gate_up copies were kept through the learning pass on every rank."""
    from hasten.rollout import SamplingParams, lean
    from hasten.rollout.lean import LeanEngine

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer))
    engine = LeanEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    prompts = [tokenizer("hello")["input_ids"]]
    first = engine.generate(prompts, 2, SamplingParams(max_new_tokens=4), seed=0)
    assert engine.layers
    engine.weights_changed()  # whole weights (one process, or inside full_weights): the copies may stay
    assert engine.layers
    monkeypatch.setattr(lean, "is_sharded_tensor", lambda tensor: True)  # resharded: parameters are DTensors
    engine.weights_changed()
    assert engine.layers == [] and engine.head is None
    monkeypatch.setattr(lean, "is_sharded_tensor", lambda tensor: False)  # gathered again for sampling
    again = engine.generate(prompts, 2, SamplingParams(max_new_tokens=4), seed=0)
    assert torch.equal(first.completion_ids, again.completion_ids)


def test_gradients_are_reduced_in_buckets(monkeypatch):
    """DDP's all-reduce: no flat buffer of every gradient (a second full copy), buckets of ~25 MiB."""
    import torch.distributed as dist

    from hasten.train import distributed

    monkeypatch.setattr(distributed, "_active", lambda: True)
    monkeypatch.setattr(distributed, "_comm_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(distributed, "GRADIENT_BUCKET_BYTES", 1000)
    sizes = []

    def all_reduce(tensor):
        sizes.append(tensor.numel() * tensor.element_size())
        tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    parameters = [torch.nn.Parameter(torch.randn(n)) for n in (100, 100, 100, 600, 10)]
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    expected = [2 * parameter.grad for parameter in parameters]
    distributed.all_reduce_gradients(parameters)
    for parameter, want in zip(parameters, expected):
        torch.testing.assert_close(parameter.grad, want)
    assert len(sizes) > 1 and max(sizes) < 1000 + 600 * 4  # a bucket closes once it reaches the cap
    assert sum(sizes) == sum(p.numel() for p in parameters) * 4


def test_gqa_repeats_kv_where_cuda_would_run_the_math_kernel():
    """CUDA runs enable_gqa only in flash (half precision, no mask) and math; fp32 or masked calls repeat
    K/V instead so the memory-efficient kernel can run. Same numbers as enable_gqa."""
    import torch.nn.functional as F

    from hasten.kernels.gqa import math_kernel_would_run

    assert math_kernel_would_run("cuda", torch.float32, masked=False, gqa=True)
    assert math_kernel_would_run("cuda", torch.bfloat16, masked=True, gqa=True)
    assert not math_kernel_would_run("cuda", torch.bfloat16, masked=False, gqa=True)
    assert not math_kernel_would_run("cuda", torch.float32, masked=True, gqa=False)
    assert not math_kernel_would_run("cpu", torch.float32, masked=True, gqa=True)
    query, key, value = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    grouped = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    repeated = F.scaled_dot_product_attention(query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1),
                                              attn_mask=mask)
    torch.testing.assert_close(grouped, repeated)


def test_attention_on_cuda_passes_no_enable_gqa_to_the_math_kernel(monkeypatch):
    """kernels/precision.attention on a (faked) CUDA query: K/V arrive repeated, enable_gqa off."""
    from hasten.kernels import gqa, precision

    seen = {}

    def sdpa(query, key, value, **kwargs):
        seen.update(heads=key.shape[1], kwargs=kwargs)
        return query

    monkeypatch.setattr(precision.F, "scaled_dot_product_attention", sdpa)
    original = gqa.math_kernel_would_run
    monkeypatch.setattr(gqa, "math_kernel_would_run", lambda device, *rest: original("cuda", *rest))
    query, key = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    precision.attention(query, key, key, is_causal=True, enable_gqa=True)
    assert seen["heads"] == 4 and seen["kwargs"]["enable_gqa"] is False


# ------------------------------------------------------------------ host syncs


def test_sampling_makes_no_second_host_sync_off_the_cpu():
    """On a GPU, bool(positive.all()) waited for the device every decode step; meta, like a GPU, cannot
    be read without one, and meta refuses it."""
    from hasten.rollout import SamplingParams
    from hasten.rollout.sampling import sample_tokens

    logits, uniforms = torch.randn(3, 50, device="meta"), torch.rand(3, device="meta")
    tokens, logprobs = sample_tokens(logits, SamplingParams(temperature=0.7, top_p=0.9, top_k=5), uniforms)
    assert tokens.shape == (3,) and logprobs.shape == (3,)


def test_sampling_still_steps_off_zero_probability_tokens():
    from hasten.rollout import SamplingParams
    from hasten.rollout.sampling import sample_tokens

    logits = torch.tensor([[0.0, -float("inf"), 0.0, -float("inf")]])
    for uniform in (0.0, 0.49, 0.5, 0.99, 1.0):
        tokens, _ = sample_tokens(logits, SamplingParams(), torch.tensor([uniform]))
        assert tokens.item() in (0, 2)


def test_min_pack_ratio_zero_does_not_measure_the_fill(monkeypatch):
    """pack_ratio reads lengths back to the host; with min_pack_ratio=0 its answer cannot matter."""
    from hasten.train import learner

    def refuse(*args):
        raise AssertionError("pack_ratio called with min_pack_ratio=0")

    monkeypatch.setattr(learner, "pack_ratio", refuse)
    monkeypatch.setattr(learner, "packed_logprobs", lambda *args: "packed")
    rollout = types.SimpleNamespace(sampling=types.SimpleNamespace(temperature=1.0), num_generations=2)
    logprob_pass = learner.LogprobPass(True, 0.0, 0, False, False, False)
    assert logprob_pass(torch.nn.Linear(1, 1), rollout, torch.arange(2), False) == "packed"


class CountReads(TorchFunctionMode):
    """Counts what reads a tensor's values back to Python (on a GPU: one host sync each)."""

    READS = {torch.Tensor.__int__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in self.READS
        return func(*args, **(kwargs or {}))


def test_pack_ratio_reads_back_a_fixed_number_of_times():
    from hasten.rollout import Rollout, SamplingParams
    from hasten.train.packing import pack_ratio

    samples, groups = 16, 4
    rollout = Rollout(torch.ones(groups, 3, dtype=torch.long), torch.ones(groups, 3, dtype=torch.long),
                      torch.ones(samples, 5, dtype=torch.long), torch.ones(samples, 5, dtype=torch.long),
                      torch.zeros(samples, 5), torch.ones(samples, dtype=torch.bool), samples // groups,
                      SamplingParams())
    with CountReads() as counter:
        ratio = pack_ratio(rollout, torch.arange(samples))
    assert ratio == 1.0
    assert counter.reads <= 3  # the rows, the completion lengths and the prompt lengths: not per sample


# ------------------------------------------------------------------ compiled layers and per-step layouts


def test_compiled_layers_do_not_recompile_for_each_steps_attention_layout():
    """speed.compile compiles each decoder layer; the grouped pass hands it a new layout (bucket tuples)
    every step. The layout-driven attention is kept out of the graph, so after the first step's graphs
    no step adds one (Dynamo would otherwise recompile per step, then run the layer eager at its limit).
    Dynamo's 'eager' backend: the graphs and guards are Dynamo's own, no compiler needed on the CPU."""
    import random

    import torch._dynamo
    from torch._dynamo.utils import counters

    from hasten.rollout import KVCacheEngine, SamplingParams
    from hasten.train.packing import packed_logprobs

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer))
    engine = KVCacheEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    texts = ["hello there", "hi", "a much longer prompt, with punctuation!", "x", "abc def ghi", "what is 4 + 5?"]
    rollouts = []
    for step in range(8):  # prompts and completion lengths differ step to step: so do the buckets
        chooser = random.Random(step)
        prompts = [tokenizer(chooser.choice(texts) * chooser.randint(1, 3))["input_ids"] for _ in range(2)]
        sampling = SamplingParams(max_new_tokens=chooser.randint(3, 12))
        rollouts.append(engine.generate(prompts, 3, sampling, seed=step))
    torch._dynamo.reset()
    counters.clear()
    from hasten.kernels.grouped_attention import keep_out_of_graphs

    keep_out_of_graphs()  # what kernels/compile.py does before it compiles the layers
    for layer in model.model.layers:
        layer.compile(backend="eager", dynamic=True)
    graphs = []
    try:
        for rollout in rollouts:
            packed_logprobs(model, rollout, torch.arange(rollout.num_samples), grouped=True, shared_prefix=True)
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
    assert graphs[0] > 0  # the layers were compiled
    assert graphs[-1] == graphs[0], f"graphs per step: {graphs}"
