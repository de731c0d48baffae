"""`hasten sft`: supervised fine-tuning on RFT records, LoRA or full, with switchable speed features.

Each record becomes one example: the task's prompt for its question (the
same prompt `hasten rft test` will use) as context, and its reasoning plus
EOS as the only loss targets. An optimizer step takes `sft.batch_size`
examples, split into `sft.gradient_accumulation_steps` micro-batches; each
micro-batch's summed token loss is divided by the step's total target
tokens, so the gradient is the token-mean over the whole step however it
is split. AdamW with linear warmup then cosine decay (train/learner.py's
`lr_factor`), gradient clipping.

Speed switches (`sft:` section; bundles in profiles.py; docs/rft.md has the
measurements):
- packing: packed rows + completion-only logits (batches.py) instead of a
  padded batch with full logits;
- gradient_checkpointing: recompute decoder activations in backward;
- adamw: fused | foreach | plain; fused falls back to foreach, logged, on a
  device or torch without it;
- compile: torch.compile(dynamic=True) of the decoder (`on`, or `gpu` = only
  on CUDA); if compiling or the first compiled call fails, the run logs why
  and goes on eager. On this CPU inductor needed ~250 s to compile even the
  2-layer test model, so only long GPU runs gain from it;
- precision: bf16/fp16 autocast on CUDA (fp16 with a GradScaler); `auto`
  is bf16 (or fp16 on GPUs without bf16) there and fp32 on CPU. On CPU,
  bf16 autocast is opt-in (`sft.precision=bf16`): this EPYC has
  avx512_bf16 and a 1024x576x1536 matmul ran 3-4x faster in bf16 than in
  fp32 (one thread), but a whole SFT step in bf16 was not measured, and it
  changes the numerics, so it is not the default. fp16 on CPU is a config
  error (CPU autocast is a bf16 feature);
- num_workers: DataLoader processes that pack micro-batches ahead of the model.

The checkpoint is a `save_pretrained` directory (adapters only with LoRA),
so `hasten eval --model DIR` and `hasten rft test --model DIR` load it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import Config, ConfigError, SFTConfig
from ..models import load_policy
from ..tasks import make_task
from ..train.episodes import encode_prompt
from ..train.learner import lr_factor
from ..train.outputs import RunDir
from ..train.preflight import check_output_dir
from ..train.runtime import configure_threads, keep_freed_memory
from .batches import Example, pack_examples, packed_nll_sum, pad_examples, padded_nll_sum
from .data import RFTRecord, load_records
from .prompts import PromptFormat


@dataclass
class SFTReport:
    run_dir: str
    checkpoint: str
    examples: int
    optimizer_steps: int
    train_seconds: float  # the optimizer steps only: no model load, no eval
    trained_tokens: int  # input tokens through the model, all epochs
    target_tokens: int
    first_loss: float
    final_loss: float
    adapter_mb: float  # size of the saved weights (adapters only with LoRA), 10^6 bytes
    settings: dict[str, Any] = field(default_factory=dict)  # what the speed switches resolved to
    eval: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["tokens_per_second"] = self.trained_tokens / max(self.train_seconds, 1e-9)
        return out


def to_examples(records: list[RFTRecord], prompt_format: PromptFormat, tokenizer, eos_id: int) -> list[Example]:
    return [
        Example(encode_prompt(tokenizer, prompt_format(record.question)),
                tokenizer(record.reasoning, add_special_tokens=False)["input_ids"] + [eos_id])
        for record in records
    ]


def resolve_precision(setting: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for fp32 (see the module docstring for the CPU choices)."""
    if device.type != "cuda":
        if setting == "fp16":
            raise ConfigError("config error: sft.precision=fp16 needs a CUDA GPU (on CPU use bf16 or fp32)")
        return torch.bfloat16 if setting == "bf16" else None
    if setting == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[setting]


def make_optimizer(parameters: list[torch.Tensor], sft: SFTConfig, log: Callable[[str], None]):
    """(AdamW, the implementation that ran): fused where torch supports it on this device, else foreach."""
    common = dict(lr=sft.lr, weight_decay=sft.weight_decay)
    if sft.adamw == "fused":
        try:
            optimizer = torch.optim.AdamW(parameters, fused=True, **common)
            return optimizer, "fused"
        except (RuntimeError, TypeError) as reason:
            log(f"sft.adamw=fused is not available here ({str(reason).splitlines()[0]}); using foreach")
    return torch.optim.AdamW(parameters, foreach=sft.adamw != "plain", **common), (
        "plain" if sft.adamw == "plain" else "foreach")


class CompiledOrEager:
    """torch.compile(fn) with a logged fallback to fn if compiling or the first compiled call fails."""

    def __init__(self, fn, log: Callable[[str], None]):
        self.fn, self.log = fn, log
        self.compiled, self.proven = None, False
        try:
            self.compiled = torch.compile(fn, dynamic=True)
        except Exception as reason:  # noqa: BLE001 - any failure means "run eager"
            log(f"sft.compile: torch.compile unavailable ({type(reason).__name__}: {reason}); running eager")

    @property
    def active(self) -> bool:
        return self.compiled is not None

    def __call__(self, *args, **kwargs):
        if self.compiled is None:
            return self.fn(*args, **kwargs)
        if self.proven:
            return self.compiled(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as reason:  # noqa: BLE001
            first_line = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
            self.log(f"sft.compile: compiled call failed ({type(reason).__name__}: {first_line[:200]}); "
                     "running eager")
            self.compiled = None
            return self.fn(*args, **kwargs)
        self.proven = True
        return out


def plan_steps(num_examples: int, sft: SFTConfig) -> list[list[list[int]]]:
    """Per optimizer step, its micro-batches of example indices; a fresh seeded shuffle per epoch."""
    rng = random.Random(sft.seed)
    steps = []
    for _ in range(sft.epochs):
        order = list(range(num_examples))
        rng.shuffle(order)
        for start in range(0, num_examples, sft.batch_size):
            chunk = torch.tensor(order[start:start + sft.batch_size])
            micro = [part.tolist() for part in chunk.tensor_split(sft.gradient_accumulation_steps) if part.numel()]
            steps.append(micro)
    return steps


class MicroBatches(torch.utils.data.Dataset):
    """Micro-batch i of the flattened plan, built (packed or padded) where it is loaded."""

    def __init__(self, examples: list[Example], plan: list[list[list[int]]], sft: SFTConfig, pad_token_id: int):
        self.examples, self.sft, self.pad_token_id = examples, sft, pad_token_id
        self.flat = [micro for step in plan for micro in step]

    def __len__(self) -> int:
        return len(self.flat)

    def __getitem__(self, index: int):
        examples = [self.examples[i] for i in self.flat[index]]
        if self.sft.packing:
            return pack_examples(examples, self.sft.pack_length)
        return pad_examples(examples, self.pad_token_id)


def _identity(item):
    return item


def enable_gradient_checkpointing(model) -> None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.use_cache = False
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def train_examples(model, examples: list[Example], cfg: Config, pad_token_id: int, log: Callable[[str], None],
                   on_step: Callable[[dict], None] = lambda record: None) -> tuple[dict[str, Any], list[float]]:
    """Run every optimizer step of the plan; returns (resolved settings, per-step losses)."""
    sft = cfg.sft
    device = next(model.parameters()).device
    autocast_dtype = resolve_precision(sft.precision, device)
    if sft.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer, adamw = make_optimizer(parameters, sft, log)
    plan = plan_steps(len(examples), sft)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, sft.warmup_steps, len(plan), sft.lr_schedule, sft.min_lr_ratio))
    scaler = torch.amp.GradScaler("cuda") if autocast_dtype == torch.float16 else None
    forward = None
    if sft.compile == "on" or (sft.compile == "gpu" and device.type == "cuda"):
        from ..train.packing import backbone_and_head

        forward = CompiledOrEager(backbone_and_head(model)[0] if sft.packing else model, log)
    loader = torch.utils.data.DataLoader(
        MicroBatches(examples, plan, sft, pad_token_id), batch_size=None, collate_fn=_identity,
        num_workers=sft.num_workers, pin_memory=device.type == "cuda", persistent_workers=False)
    batches = iter(loader)
    losses = []
    for step, micro_batches in enumerate(plan):
        started = time.perf_counter()
        step_targets = sum(len(examples[i].completion_ids) for micro in micro_batches for i in micro)
        loss_total = 0.0
        for _ in micro_batches:
            batch = next(batches)
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                nll = (packed_nll_sum(model, batch, backbone=forward) if sft.packing
                       else padded_nll_sum(model, batch, backbone=forward))
            loss = nll / step_targets  # this micro-batch's share of the step's token-mean loss
            (scaler.scale(loss) if scaler else loss).backward()
            loss_total += float(loss.detach())
        if scaler:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(parameters, sft.max_grad_norm if sft.max_grad_norm > 0 else math.inf)
        lr = optimizer.param_groups[0]["lr"]
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_total)
        tokens = sum(examples[i].input_length for micro in micro_batches for i in micro)
        on_step({"step": step + 1, "loss": loss_total, "lr": lr, "grad_norm": float(norm), "tokens": tokens,
                 "target_tokens": step_targets, "time/step": time.perf_counter() - started})
    settings = {"packing": sft.packing, "gradient_checkpointing": sft.gradient_checkpointing,
                "gradient_accumulation_steps": sft.gradient_accumulation_steps, "adamw": adamw,
                "precision": "fp32" if autocast_dtype is None else str(autocast_dtype).removeprefix("torch."),
                "compile": bool(forward is not None and forward.active), "num_workers": sft.num_workers,
                "device": device.type}
    return settings, losses


def weights_megabytes(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.iterdir() if f.suffix in (".safetensors", ".bin")) / 1e6


def run_sft(cfg: Config, log: Callable[[str], None] = print, profile: str | None = None) -> SFTReport:
    """Train on cfg.rft.data, save the checkpoint, evaluate it (eval.num_examples > 0); returns the report."""
    configure_threads(cfg.train.num_threads)
    if cfg.speed.keep_freed_memory:
        keep_freed_memory()
    records = load_records(cfg.rft.data)  # raises before anything loads or is written
    check_output_dir(cfg)
    if cfg.sft.max_examples:
        records = records[:cfg.sft.max_examples]
    task = make_task(cfg.task)
    torch.manual_seed(cfg.sft.seed)  # the LoRA initialization
    policy = load_policy(cfg.model, log)
    if torch.cuda.is_available():
        policy.model.to("cuda")
    examples = to_examples(records, PromptFormat(task), policy.tokenizer, policy.eos_token_ids[0])
    if cfg.output.name is None:
        cfg.output.name = f"{time.strftime('%Y%m%d-%H%M%S')}-sft-{task.name}" + (f"-{profile}" if profile else "")
    run = RunDir.create(cfg)
    log(f"sft: {len(examples)} examples x {cfg.sft.epochs} epochs, run directory {run.path}")
    every = max(1, math.ceil(cfg.sft.epochs * math.ceil(len(examples) / cfg.sft.batch_size) / 20))

    def on_step(record: dict) -> None:
        run.log_step(record)
        if record["step"] % every == 0 or record["step"] == 1:
            log(f"sft step {record['step']}: loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"{record['tokens'] / record['time/step']:.0f} tok/s")

    started = time.perf_counter()
    settings, losses = train_examples(policy.model, examples, cfg, policy.pad_token_id, log, on_step)
    train_seconds = time.perf_counter() - started
    checkpoint = run.save_checkpoint(policy.model, policy.tokenizer, None)
    report = SFTReport(
        run_dir=str(run.path), checkpoint=str(checkpoint), examples=len(examples), optimizer_steps=len(losses),
        train_seconds=train_seconds, trained_tokens=cfg.sft.epochs * sum(e.input_length for e in examples),
        target_tokens=cfg.sft.epochs * sum(len(e.completion_ids) for e in examples),
        first_loss=losses[0], final_loss=losses[-1], adapter_mb=weights_megabytes(checkpoint),
        settings={"profile": profile, **settings},
    )
    if cfg.eval.num_examples:
        from .evaluation import evaluate_policy

        report.eval = evaluate_policy(cfg, policy, task, log)
        run.log_eval(len(losses), report.eval)
    run.write_summary(report.to_dict())
    return report
