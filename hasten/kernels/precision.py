"""Mixed precision (train.precision, train.tf32): autocast, the fp16 GradScaler.

precision:
    fp32  no autocast (the default: exact, and the only safe choice on CPUs
          without native bf16; fp16 has no fast CPU kernels at all)
    bf16  autocast to bfloat16 on the model's device; weights, optimizer
          state and the loss stay fp32
    bf16_fp32head  bf16's autocast for the body, the LM head and its
          log-softmax in fp32 (fp32_head below): half bf16's log-prob error
          against float64 (docs/precision.md has where the bits go)
    auto  bf16_fp32head where bf16 is native and the model wide enough,
          fp32 elsewhere (resolve_precision; --profile balanced sets it)
    fp16  autocast to float16 plus a GradScaler: the loss is scaled up before
          backward so small gradients do not flush to zero, gradients are
          unscaled before clipping, and a step whose gradients overflowed is
          skipped by the scaler, which then lowers the scale
On CPUs with AVX512-BF16 or AMX, bf16 autocast is a real speed-up of the
learning pass (docs/results/speedups-notes.md has the measurement); elsewhere
bf16 is emulated and slower.
tf32: on CUDA, lets fp32 matmuls and convolutions use TF32 tensor cores
(Ampere and newer); it changes numerics slightly and does nothing on a CPU.

attention_fp32 (train.attention_fp32: auto | true | false): under autocast,
`attention()` runs scaled_dot_product_attention on fp32 copies of q, k, v
instead of autocast's bf16. auto = on the CPU only. torch 2.13's CPU flash
attention backward in bf16 is slower than in fp32 at B1's completion blocks
(docs/results/speedups-notes.md), and attention is a small share of the pass's
FLOPs, so fp32 costs little forward, and it is the more exact choice. On CUDA bf16 flash attention is the fast one.

The AdamW kernel (speed.optimizer) is kernels/adamw.py; train/optimization.py
combines both with the schedule, clipping and the NaN guard.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from .gqa import repeat_kv_where_math

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "bf16_fp32head": torch.bfloat16, "fp16": torch.float16}
FP32_HEAD_MODES = ("bf16_fp32head",)  # the LM head and its log-softmax stay fp32 under autocast

# Set by Precision.autocast() for its block: attention() then runs fp32 under autocast.
_FP32_ATTENTION = contextvars.ContextVar("hasten_fp32_attention", default=False)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention; in fp32 inside a Precision.autocast() block with attention_fp32 on.

    Out of such a block (sampling, evaluation, a plain fp32 run) it is exactly the torch call, but for
    grouped-query attention on CUDA where only the math kernel would run (kernels/gqa.py).
    """
    if _FP32_ATTENTION.get() and torch.is_autocast_enabled(query.device.type):
        with torch.autocast(query.device.type, enabled=False):
            query, key, value = query.float(), key.float(), value.float()
            key, value, kwargs = repeat_kv_where_math(query, key, value, kwargs)  # CUDA GQA: kernels/gqa.py
            return F.scaled_dot_product_attention(query, key, value, **kwargs)
    key, value, kwargs = repeat_kv_where_math(query, key, value, kwargs)
    return F.scaled_dot_product_attention(query, key, value, **kwargs)


@contextlib.contextmanager
def fp32_head(head: torch.nn.Module, enabled: bool, onednn: bool = False):
    """While the block runs, `head` (the LM head) computes its logits in fp32 under autocast.

    precision=bf16_fp32head: the body's matmuls run bf16, the logits, their log-softmax and the head's weight
    gradient fp32 (the log-softmax already runs fp32 on fp32 logits: packing.TargetLogSoftmax). The head's
    input is the final norm's fp32 output, so nothing is rounded on the way in either. onednn: the fp32 product
    through oneDNN (speed.fast_linear resolved true), as the fp32 learning pass runs it. An instance
    `forward` set for the block, as fast_linear's routing is, so a checkpointed chunk recomputed in backward
    runs the same kernel (packing._HeadAsItRan). A head that is not a plain Linear (peft's wrapper: LoRA on
    lm_head, modules_to_save) runs its own forward whole with autocast off: its base linear and adapters fp32.
    """
    patched = enabled and "forward" not in vars(head)
    if patched:
        from .fast_linear import OneDNNLinear, eligible

        plain = type(head) is torch.nn.Linear
        route = plain and onednn and eligible(head)
        wrapped = type(head).forward

        def forward(hidden: torch.Tensor) -> torch.Tensor:
            with torch.autocast(hidden.device.type, enabled=False):
                hidden = hidden.float()
                if route:
                    return OneDNNLinear.apply(hidden, head.weight, head.bias)
                if plain:
                    return F.linear(hidden, head.weight, head.bias)
                return wrapped(head, hidden)

        forward.fp32_logits = True  # packing.head_grad_in_place reads these two: logits fp32 under autocast,
        forward.onednn = route  # through oneDNN's product
        head.forward = forward
    try:
        yield patched
    finally:
        if patched:
            del head.forward


# auto leaves models narrower than this in fp32: their matmuls are too small for bf16 to pay for its casts
# (the tiny test model is 64 wide; SmolLM2-135M, the smallest model measured in bf16, 576).
AUTO_BF16_MIN_HIDDEN = 256


def native_bf16(device: torch.device) -> bool:
    """bf16 matmuls without emulation: a CPU with AVX512-BF16 or AMX, a GPU that has bf16 units."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    from ..device import cpu_has_native_bf16

    return device.type == "cpu" and cpu_has_native_bf16()


def auto_bf16_reason(device: torch.device, hidden_size: int | None) -> str | None:
    """None where `auto` picks bf16 on `device` for a model `hidden_size` wide; else why not, in a few words."""
    if not native_bf16(device):
        return "no native bf16 on this device (emulated bf16 is slower than fp32)"
    if hidden_size is not None and hidden_size < AUTO_BF16_MIN_HIDDEN:
        return f"a model {hidden_size} wide is too small for bf16 to pay"
    return None


def resolve_precision(setting: str, device: torch.device, hidden_size: int | None = None,
                      weight_dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """The learning precision `setting` (auto | fp32 | bf16 | bf16_fp32head | fp16) as (mode, why), for the plan line.

    auto is bf16_fp32head where the hardware has native bf16 matmuls (a CPU with AVX512-BF16 or AMX, a GPU
    that runs bf16 without emulation) and the model is wide enough for them to pay, fp32 elsewhere.
    bf16_fp32head is the mode measured to learn as fp32 does (docs/precision.md); plain bf16 is not.
    weight_dtype: the model's (model.dtype, or the API's model_init_kwargs). An fp32 head needs fp32 weights:
    with bf16 weights auto is bf16 (autocast over weights already bf16), with others fp32's mode (no autocast:
    they run in their own dtype; fp16's scaler refuses fp16 gradients), and an explicit bf16_fp32head is a
    config error.
    """
    if weight_dtype != torch.float32:
        name = str(weight_dtype).removeprefix("torch.")
        if setting in FP32_HEAD_MODES:
            from ..config import ConfigError

            raise ConfigError(f"config error: train.precision={setting} keeps the LM head in fp32, but the model's "
                              f"weights are {name}: load them in float32 (model.dtype=float32) or set "
                              f"train.precision=bf16")
        if setting == "auto":
            if weight_dtype == torch.bfloat16:
                return "bf16", "auto: the model's weights are bfloat16"
            return "fp32", f"auto: the model's weights are {name}, and run in it: no autocast"
    if setting != "auto":
        return setting, "as set"
    why_not = auto_bf16_reason(device, hidden_size)
    if why_not is not None:
        return "fp32", f"auto: {why_not}"
    return "bf16_fp32head", f"auto: {'the GPU' if device.type == 'cuda' else 'the CPU'} has native bf16"


def resolve_attention_fp32(setting: bool | str, device: torch.device) -> bool:
    """train.attention_fp32: true | false | auto (on for CPU autocast, off on CUDA)."""
    if setting == "auto":
        return device.type == "cpu"
    return bool(setting)


class Precision:
    """Autocast context, loss scaling and the unscale/step pair, for one device."""

    def __init__(self, mode: str, device: torch.device, tf32: bool = False, attention_fp32: bool | str = "auto"):
        self.mode = mode
        self.resolved = mode  # as the run resolved it: mode turns fp32 if the NaN guard switches autocast off
        self.device_type = device.type
        self.attention_fp32 = resolve_attention_fp32(attention_fp32, device)
        self.scaler = torch.amp.GradScaler(self.device_type) if mode == "fp16" else None
        if tf32 and device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    @property
    def mixed(self) -> bool:
        return self.mode in AUTOCAST_DTYPES

    def autocast(self):
        if not self.mixed:
            return contextlib.nullcontext()
        return self._autocast()

    @contextlib.contextmanager
    def _autocast(self):
        token = _FP32_ATTENTION.set(self.attention_fp32)
        try:
            with torch.autocast(self.device_type, dtype=AUTOCAST_DTYPES[self.mode]):
                yield
        finally:
            _FP32_ATTENTION.reset(token)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true size before clipping or inspecting them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)  # skips the step itself if the gradients hold inf/NaN
            self.scaler.update()
        else:
            optimizer.step()

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """An update the NaN guard refused: let the scaler see the overflow and lower its scale."""
        if self.scaler is not None:
            self.scaler.update()

    def state_dict(self) -> dict:
        return {"mode": self.mode, "resolved": self.resolved,
                "scaler": None if self.scaler is None else self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's: the precision its run resolved must be this one's (a resume never learns on in another);
        its mode differing is the NaN guard's fallback to fp32, taken again."""
        saved = state.get("resolved")  # None: a checkpoint from before it was recorded
        if saved is not None and saved != self.resolved:
            from ..config import ConfigError

            raise ConfigError(f"resume error: this run learned in train.precision={saved}, which resolves to "
                              f"{self.resolved} here (another machine?); set train.precision: {saved} in the run's "
                              "config.yaml to continue it as it was trained")
        if state["mode"] != self.mode:  # the NaN guard switched mixed precision off before the save
            self.disable()
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])

    def disable(self) -> None:
        """Fall back to fp32 for the rest of the run (the NaN guard's disable_mixed_precision)."""
        self.mode = "fp32"
        self.scaler = None
