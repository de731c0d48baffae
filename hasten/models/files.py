"""Checks on a local model directory's files, made before any of them is loaded.

A truncated `model.safetensors`, a `config.json` that is not JSON, or a
checkpoint copied without its tokenizer otherwise surface as tracebacks from
deep inside safetensors, json, tokenizers or transformers (the last after
suggesting sentencepiece). Each check here costs a file read of a few KiB
at most and raises one line naming the file:

- every config JSON (config.json, adapter_config.json, tokenizer_config.json,
  generation_config.json) present must parse, as an object;
- every `*.safetensors` file must hold its whole header and exactly the bytes
  its header says its tensors take (truncation is the common corruption: a
  copy or download cut short). Tensor values are not read;
- a model directory must hold weights (a directory with config.json alone
  otherwise fails deep inside transformers with an OSError);
- a model directory (not a LoRA adapter, whose tokenizer may come from its
  base) must have tokenizer files: tokenizer.json, or the slow tokenizers'
  tokenizer.model / vocab.json;
- a file or directory one may not read (another user's, saved 700/600) is
  one line naming it and its owner, not a PermissionError traceback.

Also here, for every writer of shared files (run directories, the model
cache): `share_like_umask`, the modes a plain mkdir/open would have given
(tempfile's directories are 700 and its files 600 whatever the umask, which
kept a team from sharing a cache or evaluating each other's checkpoints),
and `owner_note`, the "(owned by uid N)" of a permission message; `utf8_path`,
a directory named so that writers and readers written in Rust (tokenizers,
safetensors) take it when its path holds bytes that are not UTF-8.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Iterator

from ..errors import UserError

JSON_FILES = ("config.json", "adapter_config.json", "tokenizer_config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# what transformers' and peft's from_pretrained load weights from (sharded ones through their *.index.json)
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.h5", "*.msgpack")
HEADER_LIMIT = 100_000_000  # safetensors' own limit on the header's size


NATIVE_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # causal LMs models/llama.py runs (families.py)


class ModelFileError(UserError):
    """A file of a local model directory that cannot be loaded; str() is one line naming it."""


def check_model_dir(directory: str | Path) -> None:
    """Raise ModelFileError naming the first unloadable file of the model (or adapter) directory."""
    try:
        _check_model_dir(Path(directory))
    except PermissionError as error:
        where = Path(error.filename or directory)
        raise ModelFileError(f"model error: cannot read {where}: permission denied{owner_note(where)}; "
                             "its owner can share it with chmod -R a+rX") from None


def _check_model_dir(directory: Path) -> None:
    for name in JSON_FILES:
        if (directory / name).is_file():
            read_json(directory / name)
    for weights in sorted(directory.glob("*.safetensors")):
        check_safetensors(weights)
    adapter = (directory / "adapter_config.json").is_file()
    if not adapter and (directory / "config.json").is_file():
        check_model_type(directory, read_json(directory / "config.json"))
    if not any(path.is_file() for pattern in WEIGHT_PATTERNS for path in directory.glob(pattern)):
        kind = "adapter weights (adapter_model.safetensors)" if adapter else "weights (model.safetensors)"
        raise ModelFileError(f"model error: {directory} has no {kind}; copy them from where the model was saved")
    if not adapter and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ModelFileError(f"model error: {directory} has no tokenizer files (tokenizer.json); "
                             "copy them from the model it was saved from")


def check_model_type(directory: Path, config: dict) -> None:
    """Before any weights load: a model type hasten cannot train is one line naming it and what runs.

    hasten trains causal language models: Llama, Mistral, Qwen2 and Qwen3 on its native model and lean
    engine (models/families.py), every other transformers causal-LM type (Qwen3-MoE, Gemma, Phi, ...)
    through transformers. A sequence-classification model is a reward model (reward_funcs)."""
    kind = config.get("model_type")
    named = config.get("architectures") or []
    generative = not named or any(name.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"))
                                  for name in named)  # a saved head of another kind (a classifier, a masked LM)
    if kind in NATIVE_TYPES and generative:  # the default model's path: no transformers import to decide it
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and generative:
        return
    architectures = ", ".join(named) or "no architectures"
    hint = " (a reward model: pass it in reward_funcs)" if "ForSequenceClassification" in architectures else ""
    raise ModelFileError(f"model error: {directory} is a '{kind}' model ({architectures}){hint}; hasten trains "
                         "causal language models: llama, mistral, qwen2, qwen3 natively, and any other "
                         "transformers AutoModelForCausalLM type (qwen3_moe, gemma, phi, ...) through transformers")


def read_json(path: Path) -> dict:
    """The JSON object in `path`, or ModelFileError saying where it stops being one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ModelFileError(f"model error: {path} is not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as error:
        raise ModelFileError(
            f"model error: {path} is not valid JSON ({error.msg}: line {error.lineno} column {error.colno})"
        ) from None
    if not isinstance(value, dict):
        raise ModelFileError(f"model error: {path} is not a JSON object (got {type(value).__name__})")
    return value


def check_safetensors(path: Path) -> None:
    """The file's header parses and the file is exactly as long as the header says."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ModelFileError(f"model error: {path} is truncated ({size} bytes: not even a safetensors header)")
        (header_size,) = struct.unpack("<Q", prefix)  # little-endian u64, then that many bytes of JSON
        if header_size > HEADER_LIMIT:
            raise ModelFileError(f"model error: {path} is not a safetensors file (header size {header_size})")
        if 8 + header_size > size:
            raise ModelFileError(f"model error: {path} is truncated ({size} bytes, its header alone needs "
                                 f"{8 + header_size})")
        try:
            header = json.loads(handle.read(header_size))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            raise ModelFileError(f"model error: {path} is not a safetensors file (its header is not valid)") from None
    expected = 8 + header_size + end
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise ModelFileError(f"model error: {path} is {state} ({size} bytes, expected {expected})")


# ---------------------------------------------------------------- modes and owners


def umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc/self/status, 4.7+)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # the portable way: set and set back (not thread-safe, hence the fallback only)
    os.umask(mask)
    return mask


def share_like_umask(root: Path) -> None:
    """Give `root` and everything under it the modes mkdir/open give under the umask: directories
    0o777 & ~umask, files 0o666 & ~umask. For trees staged in tempfile.mkdtemp (700) or holding
    mkstemp files (600), before they are renamed into place."""
    mask = umask()
    os.chmod(root, 0o777 & ~mask)
    for directory, subdirectories, files in os.walk(root):
        for name in subdirectories:
            os.chmod(os.path.join(directory, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o666 & ~mask)


def owner_note(path: Path) -> str:
    """' (owned by uid N)' for `path`, or its nearest existing parent; '' when even that cannot be seen."""
    for candidate in (Path(path), *Path(path).parents):
        try:
            return f" (owned by uid {candidate.stat().st_uid})"
        except OSError:
            continue
    return ""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks (model cache manifests, checkpoint checksums)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def utf8_path(directory: Path) -> Iterator[Path]:
    """`directory` under a name every writer takes. A Linux name may hold any bytes; Python hands the ones
    that are not UTF-8 on as lone surrogates, which libraries written in Rust (the tokenizers' save) refuse
    with UnicodeEncodeError, whatever the locale. /proc/self/fd/N names the same directory in ASCII."""
    try:
        os.fsencode(directory).decode("utf-8")
        readable = True
    except UnicodeDecodeError:
        readable = False
    if readable or not Path("/proc/self/fd").is_dir():
        yield directory
        return
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield Path(f"/proc/self/fd/{descriptor}")
    finally:
        os.close(descriptor)
