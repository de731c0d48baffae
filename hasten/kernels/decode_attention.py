"""speed.decode_attention: the lean engine's decode step in fused CPU kernels: its attention, and the work
between its matmuls.

A decode step attends each row's query heads to its prompt's K/V (one copy per group,
rollout/group_cache.py) and to its own tokens' K/V. In torch that is two batched matmuls per part, a
cat, a softmax and the grid's index ops: at SmolLM2's shapes (32 rows, 3 query heads per KV head,
head_dim 64) the batched matmuls read K/V at 12-17 GB/s where the machine streams 45-55, so at long
completions attention bounds the decode step. decode_attention.c does it in one pass per (row, KV
head): the scores of the KV head's query heads against every key row (each row read once for all of
them), one softmax over prompt and own keys, and the weighted sum of the value rows, in AVX-512
registers, the (row, KV head) pairs split over torch's OpenMP threads.

What is the same: the math (scaled dot products, the prompt's 0/-inf mask, one softmax, fp32
throughout); the results differ from torch's by summation order only (tests/test_decode_attention.py
holds the two within 1e-5 of a float64 reference and each other). What it needs: a C compiler (`cc`, or
$CC) with OpenMP, an AVX-512 CPU, fp32 K/V on the CPU, head_dim 64 or 128 and up to 8 query heads per KV
head. speed.decode_attention=auto uses it where all of that holds and torch otherwise (logged once);
true makes a missing compiler or CPU feature a config error; false is torch.

The same library carries the rest of a decode layer's work between its matmuls (add_norm, silu_mul, rope,
below; LeanEngine._fused_step calls them): at 32 rows torch spends five to ten small ops on each, 4-12 us apiece,
which together cost more than the attention. The residual add and RoPE are torch's bits; the norm's sum and
SiLU's exp differ from torch's by order and ulps, and a bf16 cast of them rounds as torch's does
(tests/test_decode_step.py).

The library is built once per source, compiler and CPU into $HASTEN_CACHE/kernels (cc -O3 -march=native,
about a second) and loaded with ctypes after torch, so its OpenMP runtime is torch's (one libgomp: no
second thread pool spinning against torch's on a 2-core box). A library, or a kernels folder, that is not the
user's own or is writable by others is not loaded; a library that does not load (truncated by a crash) is built
again, once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..device import cache_root

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off"]
HEAD_DIMS, MAX_GROUP = (64, 128), 8
_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib" (the loaded library) or "reason" (why it is not), once per process


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> list[str] | None:
    """The C compiler's command: $CC as a shell would split it ("ccache cc", "gcc -m64"), else cc or gcc."""
    if os.environ.get("CC", "").strip():
        try:
            return shlex.split(os.environ["CC"])
        except ValueError:  # unbalanced quotes: as given, so that running it says what is wrong
            return [os.environ["CC"]]
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _compile(compiler: list[str], folder: Path, path: Path) -> str | None:
    """Build the library into `path` (a scratch file made whole, synced, then renamed over it); None or why not."""
    handle, scratch = tempfile.mkstemp(dir=folder, prefix=".decode_attention-", suffix=".so")
    os.close(handle)
    try:
        done = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", scratch, "-lm"], capture_output=True,
                              text=True, timeout=300, check=False)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            return f"{' '.join(compiler)} failed to build {SOURCE.name}: {last}"
        os.chmod(scratch, 0o700)
        with open(scratch, "rb") as built:
            os.fsync(built.fileno())  # on disk before the rename: a crash leaves the old file or the whole new one
        os.replace(scratch, path)  # atomic: a concurrent process (another rank) sees all or nothing
        return None
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _build() -> tuple[ctypes.CDLL | None, str | None]:
    """(library, None) or (None, why not): build into the cache unless a library for this source,
    compiler and CPU is already there; one that does not load (truncated, damaged) is built again."""
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler (cc, gcc or $CC) on PATH"
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"the C compiler {' '.join(compiler)} does not run ({error})"
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_flags().encode()])).hexdigest()[:16]
    folder = cache_root() / "kernels"
    path = folder / f"decode_attention-{key}.so"
    lib = None
    for attempt in range(2):
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            # The folder too: whoever may write in it could rename their own library over ours after the check
            status = folder.stat()
            if status.st_uid != os.getuid() or status.st_mode & 0o022:
                return None, f"{folder} is not this user's own or is writable by others; not loaded"
            if attempt or not path.exists():
                why = _compile(compiler, folder, path)
                if why is not None:
                    return None, why
        except (OSError, subprocess.SubprocessError) as error:
            return None, f"cannot build into {folder} ({error})"
        status = path.stat()
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            return None, f"{path} is not this user's own or is writable by others; not loaded"
        try:
            lib = ctypes.CDLL(str(path))
            break
        except OSError as error:  # a truncated or damaged file from an earlier crash: build it once more
            if attempt:
                return None, f"cannot load {path} ({error})"
    if lib.decode_attention_isa() != 512:
        return None, "the CPU has no AVX-512"
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, ptr, i64, i64, i64, ptr, ptr,
                                     ptr, ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    flag, f32 = ctypes.c_int, ctypes.c_float
    lib.decode_add_norm.argtypes = [ptr, ptr, flag, i64, i64, ptr, f32, ptr, flag]
    lib.decode_silu_mul.argtypes = [ptr, flag, i64, i64, ptr, flag]
    lib.decode_rope.argtypes = [ptr, flag, ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, i64]
    for name in ("decode_add_norm", "decode_silu_mul", "decode_rope"):
        getattr(lib, name).restype = ctypes.c_int
    return lib, None


def _library() -> ctypes.CDLL | None:
    with _lock:
        if not _state:
            lib, reason = _build()
            _state.update(lib=lib, reason=reason)
    return _state["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """None when the kernel is built and loaded here; else why not (one line). Builds on first call."""
    _library()
    return _state["reason"]  # type: ignore[return-value]


def resolve(setting: bool | str, device: torch.device | str = "cpu", log=print) -> bool:
    """speed.decode_attention -> whether the lean engine uses the kernel. auto: on a CPU model where it builds
    and loads (else one log line, torch's path; a GPU model quietly keeps torch's); true: it must (a
    ConfigError naming the key otherwise); false: never."""
    if setting is False:
        return False
    from ..errors import ConfigError

    on_cpu = torch.device(device).type == "cpu"
    reason = unavailable_reason() if on_cpu else f"the model is on {torch.device(device).type}, the kernel is the CPU's"
    if reason is None:
        return True
    if setting is True:
        raise ConfigError(f"config error: speed.decode_attention=true, but the fused kernel is unavailable: {reason} "
                          f"(use auto or false)")
    if on_cpu:
        log(f"speed.decode_attention=auto: torch's decode attention ({reason})")
    return False


def supports(head_dim: int, group: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel takes a cache of this shape, dtype and device (else the caller runs torch)."""
    return head_dim in HEAD_DIMS and 1 <= group <= MAX_GROUP and dtype == torch.float32 and device.type == "cpu"


def attend(query: torch.Tensor, scale: float, prompt_keys: torch.Tensor, prompt_values: torch.Tensor,
           prompt_bias: torch.Tensor, prompt_of_row: torch.Tensor, own_keys: torch.Tensor, own_values: torch.Tensor,
           length: int, own_rows: torch.Tensor | None = None,
           own_lengths: torch.Tensor | None = None) -> torch.Tensor | None:
    """One decode step: query (N, heads, 1, D); prompt K/V (B, kv, P, D); prompt_bias (B, P), 0 or -inf;
    prompt_of_row (N,) int64; own K/V (S, kv, >= length, D): row n's at own_rows[n] (None: n), its first
    own_lengths[n] <= length positions attended (None: `length` each; the conversation cache's rows differ).
    -> (N, 1, heads * D), or None where the kernel does not take these tensors (the caller runs torch)."""
    lib = _library()
    rows, heads, _, dim = query.shape
    kv_heads = own_keys.shape[1]
    if lib is None or not supports(dim, heads // kv_heads, query.dtype, query.device):
        return None
    if query.stride(3) != 1 or query.stride(1) != dim:
        query = query.contiguous()
    for tensor in (prompt_keys, prompt_values, own_keys, own_values):
        if tensor.dtype != torch.float32 or tensor.stride(3) != 1 or tensor.stride(2) != dim:
            return None
    if prompt_keys.stride() != prompt_values.stride() or own_keys.stride() != own_values.stride():
        return None
    indices = [prompt_of_row, own_rows, own_lengths]
    if prompt_bias.dtype != torch.float32 or any(index is not None and (index.dtype != torch.int64 or len(index) != rows) for index in indices):
        return None
    prompt_bias = prompt_bias.contiguous()
    prompt_of_row, own_rows, own_lengths = (None if index is None else index.contiguous() for index in indices)
    out = query.new_empty(rows, 1, heads * dim)
    code = lib.decode_attention(
        query.data_ptr(), query.stride(0), rows, kv_heads, heads // kv_heads, dim, scale,
        prompt_keys.data_ptr(), prompt_values.data_ptr(), prompt_keys.stride(0), prompt_keys.stride(1),
        prompt_keys.shape[2], prompt_bias.data_ptr(), prompt_of_row.data_ptr(), own_keys.data_ptr(),
        own_values.data_ptr(), own_keys.stride(0), own_keys.stride(1),
        None if own_rows is None else own_rows.data_ptr(), None if own_lengths is None else own_lengths.data_ptr(),
        length, out.data_ptr(), torch.get_num_threads())
    if code == 2:
        raise MemoryError("speed.decode_attention: the kernel could not allocate its scores")
    return out if code == 0 else None


# ------------------------------------------------------------------ the rest of a decode layer (decode_attention.c)
# The lean engine's fused decode step (rollout/lean.py, LeanEngine._fused_step) calls these between its matmuls.
# Each takes contiguous CPU tensors, fp32 or bf16 where named, widths a multiple of 16, and raises where the
# kernel declines: the engine checks what they take (layers_supported) before it uses them.


def layers_supported(hidden_size: int, intermediate_size: int, head_dim: int) -> bool:
    """Whether add_norm, silu_mul and rope take a model of these widths (and the library is here)."""
    return (_library() is not None and hidden_size % 16 == 0 and intermediate_size % 16 == 0
            and head_dim in HEAD_DIMS)


def _check(code: int, name: str) -> None:
    if code != 0:
        raise RuntimeError(f"speed.decode_attention: {name} declined its tensors (a caller's bug)")


_EITHER, _FP32 = (torch.float32, torch.bfloat16), (torch.float32,)


def _dense(name: str, shape: tuple[int, ...], *tensors: torch.Tensor | None, dtypes: tuple = _EITHER) -> None:
    """Each tensor given is contiguous, on the CPU, of `shape` and one of `dtypes`: what the kernels read through
    a bare pointer. A caller's bug otherwise, raised before any memory is touched."""
    for tensor in tensors:
        if tensor is not None and (tensor.shape != shape or tensor.dtype not in dtypes or not tensor.is_contiguous()
                                   or tensor.is_cuda):
            raise RuntimeError(f"speed.decode_attention: {name} takes contiguous CPU {dtypes} tensors of {shape}, "
                               f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} (a caller's bug)")


def add_norm(hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
             out: torch.Tensor) -> torch.Tensor:
    """hidden (N, H) fp32 += delta (N, H, fp32 or bf16; None: nothing), in place; out (N, H, fp32 or bf16) =
    rms_norm(hidden) * weight, F.rms_norm's composite up to the order of its sum. Returns out."""
    rows, width = hidden.shape
    _dense("add_norm", (rows, width), hidden, dtypes=_FP32)
    _dense("add_norm", (rows, width), delta, out)
    _dense("add_norm", (width,), weight, dtypes=_FP32)
    _check(_library().decode_add_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(),
                                      delta is not None and delta.dtype == torch.bfloat16, rows, width,
                                      weight.data_ptr(), eps, out.data_ptr(), out.dtype == torch.bfloat16),
           "add_norm")
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (N, I) = silu(gate) * up, gate_up (N, 2 I) as chunk(2) splits it; fp32 or bf16 each. Returns out."""
    rows, inner = out.shape
    _dense("silu_mul", (rows, inner), out)
    _dense("silu_mul", (rows, 2 * inner), gate_up)
    _check(_library().decode_silu_mul(gate_up.data_ptr(), gate_up.dtype == torch.bfloat16, rows, inner,
                                      out.data_ptr(), out.dtype == torch.bfloat16), "silu_mul")
    return out


def rope(qkv: torch.Tensor, bias: torch.Tensor | None, heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
         query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot: int) -> torch.Tensor:
    """qkv (N, (heads + 2 kv) D) fp32 or bf16, + bias: the queries rotated into query (N, heads, 1, D) fp32,
    the keys rotated and the values written at position `slot` of the cache keys/values (N, kv, T, D) fp32.
    cos, signed_sin: (N, D) fp32, models/llama.py's table at each row's position. Returns query."""
    rows, kv_heads, length, dim = keys.shape
    if (keys.stride() != values.stride() or keys.stride(3) != 1 or keys.stride(2) != dim or values.shape != keys.shape
            or not 0 <= slot < length or keys.dtype != torch.float32 or values.dtype != torch.float32):
        raise RuntimeError("speed.decode_attention: rope needs a dense fp32 cache and a slot in it (a caller's bug)")
    width = (heads + 2 * kv_heads) * dim
    _dense("rope", (rows, width), qkv)
    _dense("rope", (width,), bias, dtypes=_FP32)
    _dense("rope", (rows, dim), cos, signed_sin, dtypes=_FP32)
    _dense("rope", (rows, heads, 1, dim), query, dtypes=_FP32)
    _check(_library().decode_rope(qkv.data_ptr(), qkv.dtype == torch.bfloat16,
                                  None if bias is None else bias.data_ptr(), rows, heads, kv_heads, dim,
                                  cos.data_ptr(), signed_sin.data_ptr(), query.data_ptr(),
                                  keys[:, :, slot].data_ptr(), values[:, :, slot].data_ptr(), keys.stride(0),
                                  keys.stride(1)), "rope")
    return query
