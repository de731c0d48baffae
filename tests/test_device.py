"""model.device: resolution, the CPU box's one error for a GPU request, profiles deciding from the
model's device, device-resident decode buffers. GPU-only tests are skipped without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from hasten.cli import main
from hasten.config import ConfigError, load_config
from hasten.device import peak_memory_mib, resolve_device
from hasten.profiles import resolve

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def fake_gpus(monkeypatch, count: int = 2, bf16: bool = True) -> None:
    """Make torch report `count` GPUs (nothing runs on them: resolution and profiles only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)


def test_settings_resolve(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    fake_gpus(monkeypatch)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")  # pinned to the CPU on a GPU machine
    with pytest.raises(ConfigError, match="GPU 2"):
        resolve_device("cuda:2")


def test_under_torchrun_each_rank_takes_its_local_gpu(monkeypatch):
    fake_gpus(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="pins one GPU"):
        resolve_device("cuda:0")


def test_a_gpu_request_without_a_gpu_is_one_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.device=cuda but torch sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match="model.device must be"):
        load_config(overrides=[("model.device", "gpu")])


@without_cuda
def test_cli_with_cuda_on_a_cpu_box_exits_2_with_one_line(tmp_path, capsys):
    code = main(["train", "--model", "tiny", "--task", "arithmetic", "--steps", "1", "--model.device=cuda",
                 f"--output.dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [err[-1]] and "model.device=cuda" in err[-1]
    assert not any(tmp_path.iterdir())  # nothing written
    # A profile reads the device while the config is built: the same one line.
    code = main(["train", "--model", "tiny", "--profile", "balanced", "--model.device=cuda:0",
                 f"--output.dir={tmp_path}"])
    assert code == 2 and "torch sees no CUDA GPU" in capsys.readouterr().err


def test_profiles_decide_from_the_models_device(monkeypatch):
    fake_gpus(monkeypatch)
    on_gpu = load_config(overrides=[("model.device", "cuda")])
    on_cpu = load_config(overrides=[("model.device", "cpu")])  # a GPU machine, the model pinned to its CPU
    # the learning precision is auto in every profile but baseline: the plan resolves it against the device
    # and the model (tests/test_learning_precision.py: bf16_fp32head only where bf16 is native)
    assert resolve("balanced", on_gpu)["train.precision"] == "auto"
    assert resolve("baseline", on_gpu)["train.precision"] == "fp32"
    assert resolve("balanced", on_gpu)["speed.compile"] is True
    assert resolve("balanced", on_cpu)["speed.compile"] is False


@pytest.mark.parametrize("native_bf16", [True, False])
def test_profiles_sample_in_auto_or_int8_where_the_cpu_has_no_bf16(monkeypatch, native_bf16):
    import hasten.device

    monkeypatch.setattr(hasten.device, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(hasten.device, "cpu_int8_unavailable_reason", lambda: None)
    on_cpu = load_config(overrides=[("model.device", "cpu")])
    assert resolve("balanced", on_cpu)["generation.precision"] == "auto"  # the engine factory resolves it
    assert resolve("aggressive", on_cpu)["generation.precision"] == ("auto" if native_bf16 else "int8")
    monkeypatch.setattr(hasten.device, "cpu_int8_unavailable_reason", lambda: "no fbgemm")
    assert resolve("aggressive", on_cpu)["generation.precision"] == "auto"  # never a refused setting
    assert resolve("baseline", on_cpu)["generation.precision"] == "fp32"
    assert resolve("conservative", on_cpu)["generation.precision"] == "fp32"
    hf_engine = load_config(overrides=[("model.device", "cpu"), ("speed.engine", "hf")])
    assert resolve("aggressive", hf_engine)["generation.precision"] == "auto"  # int8 is the lean engine's option
    explicit = load_config(overrides=[("model.device", "cpu"), ("generation.precision", "fp32")],
                           profile="balanced")
    assert explicit.generation.precision == "fp32"  # an explicit value wins over the profile


def test_peak_memory_on_the_cpu_is_the_resident_set():
    assert peak_memory_mib(torch.device("cpu")) > 10


def test_decode_buffers_live_on_the_models_device(model, tokenizer):
    from conftest import encode, make_engine

    from hasten.rollout import SamplingParams

    rollout = make_engine(model, tokenizer).generate(encode(tokenizer), 2, SamplingParams(6), seed=1)
    device = next(model.parameters()).device
    for tensor in (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids, rollout.completion_mask,
                   rollout.sampling_logprobs, rollout.ended_with_eos):
        assert tensor.device == device


@requires_cuda
@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_a_grpo_run_on_the_gpu_keeps_everything_there(tmp_path, engine):
    from hasten.train.trainer import train

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}:", "answer": "a"}) + "\n" for i in range(8)))
    reward = tmp_path / "reward.py"
    reward.write_text("def letters(prompts, completions, **kw):\n"
                      "    return [sum(c.islower() for c in t) / max(len(t), 1) for t in completions]\n")
    cfg = load_config(overrides=[
        ("model.name", "tiny"), ("model.device", "cuda"), ("task.name", "jsonl"), ("task.path", str(data)),
        ("rewards.extra", [f"{reward}:letters"]), ("train.steps", 2), ("train.prompts_per_step", 2),
        ("generation.num_generations", 4), ("generation.max_new_tokens", 8), ("eval.num_examples", 2),
        ("eval.max_new_tokens", 4), ("output.dir", str(tmp_path / "runs")), ("output.progress", "off"),
        ("speed.engine", engine), ("algo.beta", 0.1)], profile="balanced")
    summary = train(cfg, log=lambda text: None)
    assert summary["status"] == "finished"
    assert peak_memory_mib(torch.device("cuda")) > 0
