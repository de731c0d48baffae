"""The GPU dry run on the CPU: every profile x engine x world size with a CUDA device named (issue 55).

Two checks stand in for a GPU this project has never had:

1. Plan resolution, walked. For model.device = cuda and cuda:1, WORLD_SIZE 1 and 2 (under torchrun,
   with train.distributed ddp and fsdp), every profile (and none) and every speed.engine, the config is
   built as `hasten train` builds it (torch.cuda faked: two GPUs with native bf16 and 80 GiB), the device
   resolved as `prepare` resolves it, the engine made on a `meta` copy of the tiny model (every module
   built, no memory touched) and the run's plan line resolved for the named GPU. A cell ends in a plan, or
   in a config error that names a rule the user's own setting broke (EXPECTED_REFUSALS); a profile the
   user did not edit never ends in one.
2. Tensor creation in the per-step packages (rollout/, train/, kernels/, algo/), read from the source:
   a torch factory call (torch.zeros, ones, empty, arange, full, tensor, ...) without device= builds on
   the CPU. Each such call is listed in CPU_ON_PURPOSE with why (built on the CPU and moved once, a CPU
   kernel's own probe, a CPU-side index); a new one fails here until it names its device or its reason.
"""

from __future__ import annotations

import ast
import dataclasses
import types
from pathlib import Path

import pytest
import torch

from hasten.config import ConfigError, load_config
from hasten.device import resolve_device
from hasten.models import Policy
from hasten.models.tiny import tiny_model, tiny_tokenizer
from hasten.profiles import PROFILES

PACKAGE = Path(__file__).resolve().parent.parent / "hasten"
ENGINES = ("auto", "lean", "hf", "vllm")
PROFILE_CHOICES = (None, *PROFILES)

# (what the user set, the config error's words): launches a user's own settings rule out, on purpose.
EXPECTED_REFUSALS = [
    (lambda cell: cell.device == "cuda:1" and cell.ranks > 1, "pins one GPU"),
    (lambda cell: cell.engine == "vllm" and cell.device == "cuda:1" and cell.ranks == 1, "runs on GPU 0"),
    (lambda cell: cell.distributed == "fsdp" and cell.ranks > 1 and cell.engine in ("hf", "vllm"),
     "train.distributed=fsdp does not run with speed.engine"),
]


@dataclasses.dataclass(frozen=True)
class Cell:
    device: str
    ranks: int
    distributed: str
    profile: str | None
    engine: str

    def refusals(self) -> list[str]:
        """The words of each config error this cell's own settings call for (several rules may apply)."""
        return [words for applies, words in EXPECTED_REFUSALS if applies(self)]


LAUNCHES = [(device, ranks, distributed) for device in ("cuda", "cuda:1") for ranks in (1, 2)
            for distributed in (("ddp", "fsdp") if ranks > 1 else ("ddp",))]


def fake_machine(monkeypatch, ranks: int) -> None:
    """Two GPUs of 80 GiB with native bf16; torchrun's WORLD_SIZE / RANK / LOCAL_RANK for rank 1 of `ranks`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        total_memory=80 * 2**30, major=9, minor=0, name="faked"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for name, value in (("WORLD_SIZE", ranks), ("RANK", ranks - 1), ("LOCAL_RANK", ranks - 1)):
        if ranks > 1:
            monkeypatch.setenv(name, str(value))
        else:
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def meta_policy():
    tokenizer = tiny_tokenizer()
    return Policy(model=tiny_model(len(tokenizer)).to("meta"), tokenizer=tokenizer, source="tiny")


def resolve_cell(cell: Cell, policy: Policy) -> str:
    """The plan line the cell's run would print, or ConfigError."""
    from hasten.rollout import vllm_engine
    from hasten.rollout.factory import make_engine
    from hasten.train import fsdp
    from hasten.train.learner import LearningPlan
    from hasten.train.plan import Plan

    overrides = [("model.name", "tiny"), ("model.device", cell.device), ("speed.engine", cell.engine),
                 ("train.distributed", cell.distributed), ("train.prompts_per_step", 4)]
    cfg = load_config(overrides=overrides, profile=cell.profile)
    device = resolve_device(cfg.model.device)  # what prepare does first
    if cell.engine == "vllm":  # vLLM itself is not installed here: its placement is what a GPU would see
        vllm_engine.placement(device, cell.ranks)
        return "vllm"
    engine = make_engine(cfg, policy, lambda line: None)
    plan = Plan.resolve(cfg, policy, engine, False)
    learning = LearningPlan.resolve(cfg, fsdp.wanted(cfg), policy.model.config, str(device))
    return dataclasses.replace(plan, device=str(device), learning=learning).describe()


@pytest.mark.parametrize("device,ranks,distributed", LAUNCHES)
def test_every_profile_and_engine_resolves_on_a_named_gpu(monkeypatch, meta_policy, device, ranks, distributed):
    fake_machine(monkeypatch, ranks)
    outcomes = {}
    for profile in PROFILE_CHOICES:
        for engine in ENGINES:
            cell = Cell(device, ranks, distributed, profile, engine)
            expected = cell.refusals()
            try:
                line = resolve_cell(cell, meta_policy)
            except ConfigError as error:
                assert any(words in str(error) for words in expected), f"{cell}: {error}"
                outcomes[cell] = "refused"
                continue
            assert not expected, f"{cell} resolved, but its settings break: {expected}"
            outcomes[cell] = line
    plans = [line for line in outcomes.values() if line.startswith("plan: ")]
    assert all(line.startswith(f"plan: cuda:{device.split(':')[1] if ':' in device else ranks - 1}")
               for line in plans)
    if ranks > 1:  # balanced asked for dynamic sampling under torchrun: the plan line says it was left out
        balanced = outcomes[Cell(device, ranks, distributed, "balanced", "auto")]
        assert balanced == "refused" or "algo.dynamic_sampling" in balanced


def test_the_walk_covers_every_profile_engine_and_world_size():
    cells = {(profile, engine, ranks) for _, ranks, _ in LAUNCHES for profile in PROFILE_CHOICES for engine in ENGINES}
    assert len(cells) == len(PROFILE_CHOICES) * len(ENGINES) * 2
    assert {device for device, _, _ in LAUNCHES} == {"cuda", "cuda:1"}


# ------------------------------------------------------------------ tensors made without a device

FACTORIES = {"zeros", "ones", "empty", "arange", "full", "tensor", "rand", "randn", "randint", "linspace", "eye",
             "as_tensor"}
HOT_PACKAGES = ("rollout", "train", "kernels", "algo")

# (file under hasten/, function) -> why its CPU tensors are on purpose
CPU_ON_PURPOSE = {
    ("rollout/engine.py", "left_pad"): "prompt ids built on the CPU from Python lists; callers move them once",
    ("rollout/engine.py", "__init__"): "the EOS id list, moved to the model's device once per generate",
    ("rollout/lean.py", "__init__"): "the EOS ids, moved per generate",
    ("rollout/matmul.py", "__init__"): "a CPU probe of the matmul kernel at construction",
    ("rollout/lean.py", "_prefill_and_decode"): "the shared prefix's mask joins a CPU mask, moved once",
    ("rollout/decode.py", "__init__"): "uniforms from a CPU generator: the same draws on every device, moved once",
    ("rollout/speculative.py", "generate"): "uniforms from a CPU generator, as decode.py",
    ("rollout/speculative.py", "_sequences"): "the drafter's context: token ids it reads in Python",
    ("rollout/shared_weights.py", "__init__"): "a CPU probe of the matmul kernel at construction",
    ("rollout/continuation.py", "__init__"): "empty placeholders, replaced on the device at the first turn",
    ("rollout/continuation.py", "_right_pad"): "tool-turn ids from Python lists, moved once",
    ("rollout/vllm_engine.py", "build_rollout"): "vLLM returns Python lists: the rollout is assembled on the CPU",
    ("train/microbatch.py", "micro_batches"): "sample indices for the host's split (index tensors on any device)",
    ("train/packing.py", "block_mask"): "the packed batch's mask, built on the CPU and moved with the batch",
    ("train/packing.py", "pack"): "the packed batch, built on the CPU from the rollout's lists and moved once",
    ("train/packing.py", "without_padding"): "the layout's CPU index map, moved with the layout once",
    ("train/policy_loop.py", "learn"): "the game policy trains on the CPU (games/)",
    ("train/policy_loop.py", "prepare_game"): "the game policy trains on the CPU (games/)",
    ("train/policy_loop.py", "discounted_returns"): "the game policy trains on the CPU (games/)",
    ("train/trainer.py", "grpo_step"): "reward weights meet the rewards, which are scored on the CPU",
    ("kernels/adamw.py", "_offsets"): "random offsets drawn from a CPU generator into a Python list",
    ("kernels/fast_linear.py", "reads_transposed"): "a CPU probe: oneDNN is a CPU kernel",
    ("kernels/fast_linear.py", "available"): "a CPU probe: oneDNN is a CPU kernel",
    ("kernels/grouped_attention.py", "build_layout"): "the layout, built on the CPU and moved once (layout.to)",
    ("kernels/grouped_attention.py", "slots"): "the layout, built on the CPU and moved once (layout.to)",
    ("kernels/grouped_attention.py", "_pad"): "the layout, built on the CPU and moved once (layout.to)",
    ("kernels/int8.py", "__init__"): "int8 sampling runs on the CPU only (kernels/int8.py)",
    ("kernels/int8.py", "prepare"): "int8 sampling runs on the CPU only (kernels/int8.py)",
    ("algo/advantages.py", "normalized_sum_advantages"): "a 0-dim zero: a scalar any device's op accepts",
    ("algo/dynamic_sampling.py", "select_groups"): "an index of kept samples (indexes a tensor on any device)",
}


def deviceless_factory_calls(root: Path = PACKAGE, packages=HOT_PACKAGES) -> dict[tuple[str, str], list[int]]:
    """(file, innermost function) -> lines of torch factory calls without device=, in the hot packages."""
    found: dict[tuple[str, str], list[int]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            owner: dict[int, str] = {}
            for function in ast.walk(tree):
                if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(function):
                        owner[id(node)] = function.name  # walked outer first: inner functions win
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "torch" and not any(k.arg == "device" for k in node.keywords)):
                    key = (str(path.relative_to(root)), owner.get(id(node), "<module>"))
                    found.setdefault(key, []).append(node.lineno)
    return found


def test_per_step_tensors_name_their_device_or_why_not():
    found = deviceless_factory_calls()
    unexplained = {f"{path}:{lines[0]} in {function}" for (path, function), lines in found.items()
                   if (path, function) not in CPU_ON_PURPOSE}
    assert not unexplained, (f"tensors made on the CPU without device= (name the device, or add the "
                             f"function to CPU_ON_PURPOSE with why): {sorted(unexplained)}")
    stale = set(CPU_ON_PURPOSE) - set(found)
    assert not stale, f"CPU_ON_PURPOSE lists functions that no longer make such tensors: {sorted(stale)}"


def test_the_scan_sees_a_deviceless_tensor(tmp_path):
    """The scan is not vacuous: a factory call without device= is found, one with it is not."""
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "step.py").write_text(
        "import torch\ndef step(x):\n    a = torch.zeros(3)\n    b = torch.ones(3, device=x.device)\n")
    assert deviceless_factory_calls(tmp_path, ("rollout",)) == {("rollout/step.py", "step"): [3]}
