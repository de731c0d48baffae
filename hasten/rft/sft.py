"""`hasten sft`: supervised fine-tuning on RFT records, LoRA or full, with switchable speed features.

Each record becomes one example: the task's prompt for its question (the
same prompt `hasten rft test` will use) as context, and its reasoning plus
EOS as the only loss targets. With sft.source=task the examples are the
task's own correct tool conversations instead (rft/demonstrations.py): the
assistant turns are the targets, the tool results context. An optimizer
step takes `sft.batch_size` examples, split into `sft.gradient_accumulation_steps` micro-batches; each
micro-batch's summed token loss is divided by the step's total target
tokens, so the gradient is the token-mean over the whole step however it
is split. AdamW, warmup then cosine decay, clipping, precision and the NaN
guard are the shared optimization layer (train/optimization.py, from the
`sft:` section), and the run is the shared outer loop (train/loop.py):
full-state checkpoints, `hasten sft --resume RUN_DIR`, signals, summary.

Speed switches (`sft:` section; bundles in profiles.py; docs/rft.md has the
measurements):
- packing: packed rows + completion-only logits (batches.py) instead of a
  padded batch with full logits;
- gradient_checkpointing: recompute decoder activations in backward;
- adamw: fused | foreach | plain (kernels/adamw.py's kernels: FusedAdamW,
  torch.optim's foreach and for-loop);
- compile: torch.compile(dynamic=True) of the decoder (`on`, or `gpu` = only
  on CUDA); if compiling or the first compiled call fails, the run logs why
  and goes on eager. On this CPU inductor needed ~250 s to compile even the
  2-layer test model, so only long GPU runs gain from it;
- precision: bf16/fp16 autocast on CUDA (fp16 with a GradScaler); `auto`
  is bf16 (or fp16 on GPUs without bf16) there and fp32 on CPU. On CPU,
  bf16 autocast is opt-in (`sft.precision=bf16`): it is faster on CPUs
  with native bf16 (docs/rft.md), but it changes the numerics, so it is not
  the default. fp16 on CPU is a config
  error (CPU autocast is a bf16 feature);
- num_workers: DataLoader processes that pack micro-batches ahead of the model.

Under torchrun (train/distributed.py) each rank runs every world_size-th
micro-batch of a step and the gradients are summed over ranks: the same
update as one process; rank 0 writes the run directory and evaluates.

The checkpoint is a `save_pretrained` directory (adapters only with LoRA),
so `hasten eval --model DIR` and `hasten rft test --model DIR` load it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import Config, ConfigError, SFTConfig
from ..device import configure_device, resolve_device
from ..errors import Interrupted
from ..models import load_policy, load_trained_weights
from ..kernels.allocator import check_in_process as check_allocator, loaded as loaded_allocator
from ..kernels.precision import AUTOCAST_DTYPES
from ..tasks import make_task
from ..train import distributed, fsdp, loop
from ..train.learner import is_mixture_of_experts
from ..train.optimization import Optimization, OptimizerSettings, sft_precision
from ..train.outputs import RunDir, save_model_files
from ..train.preflight import check_output_dir
from ..kernels.runtime import configure_threads, keep_freed_memory
from ..train.tracking import check_trackers, make_trackers
from .batches import Example, TokenTally, pack_examples, packed_nll_sum, pad_examples, padded_nll_sum
from .data import load_records
from .examples import record_examples
from .demonstrations import DEMONSTRATIONS_FILE, check_demonstrations, demonstration_examples, save_demonstrations
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
    weights_mb: float  # size of the saved weights, 10^6 bytes
    lora: bool  # the weights are LoRA adapters (reported as adapter_mb) or the whole model (model_mb)
    settings: dict[str, Any] = field(default_factory=dict)  # what the speed switches resolved to
    eval: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        # Named for what was saved: a full model's 538 MB are not an adapter's.
        out["adapter_mb" if self.lora else "model_mb"] = out.pop("weights_mb")
        out["tokens_per_second"] = self.trained_tokens / max(self.train_seconds, 1e-9)
        return out


def resolve_precision(setting: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype, or None for fp32 (see the module docstring for the CPU choices)."""
    return AUTOCAST_DTYPES.get(sft_precision(setting, device))


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


def router_aux_coefficient(model_config, configured: float, log: Callable[[str], None] | None = None) -> float:
    """The weight of the router load-balancing loss SFT adds: 0 on a dense model, and 0 on a mixture-of-experts
    architecture whose config declares no router_aux_loss_coef (Glm4Moe balances its experts by a bias and its
    forward returns no aux loss: TRL takes the model's own coefficient, absent = 0); else `configured`.
    log: where a configured coefficient that has no loss to weigh is said (once, not silently dropped)."""
    if not is_mixture_of_experts(model_config):
        return 0.0
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if getattr(text, "router_aux_loss_coef", None) is None:
        if configured and log is not None:
            log(f"sft: {type(model_config).__name__} declares no router load-balancing loss; "
                f"router_aux_loss_coef={configured:g} adds nothing")
        return 0.0
    return float(configured)


def plan_steps(num_examples: int, sft: SFTConfig) -> list[list[list[int]]]:
    """Per optimizer step, its micro-batches of example indices; a fresh seeded shuffle per epoch.
    sft.max_steps > 0: that many steps, from as many epochs as they need (the last one cut short)."""
    rng = random.Random(sft.seed)
    steps: list[list[list[int]]] = []
    per_epoch = -(-num_examples // sft.batch_size)
    epochs = sft.epochs if sft.max_steps <= 0 else -(-sft.max_steps // per_epoch)
    for _ in range(epochs):
        order = list(range(num_examples))
        rng.shuffle(order)
        for start in range(0, num_examples, sft.batch_size):
            chunk = torch.tensor(order[start:start + sft.batch_size])
            micro = [part.tolist() for part in chunk.tensor_split(sft.gradient_accumulation_steps) if part.numel()]
            steps.append(micro)
    return steps if sft.max_steps <= 0 else steps[:sft.max_steps]


class MicroBatches(torch.utils.data.Dataset):
    """Micro-batch i of the flattened plan, built (packed or padded) where it is loaded."""

    def __init__(self, examples: list[Example], plan: list[list[list[int]]], sft: SFTConfig, pad_token_id: int,
                 skip: int = 0):
        self.examples, self.sft, self.pad_token_id = examples, sft, pad_token_id
        self.flat = [micro for step in plan for micro in step][skip:]  # skip: micro-batches a resume has done

    def __len__(self) -> int:
        return len(self.flat)

    def __getitem__(self, index: int):
        examples = [self.examples[i] for i in self.flat[index]]
        if self.sft.packing:
            return pack_examples(examples, self.sft.pack_length)
        return pad_examples(examples, self.pad_token_id)


def _identity(item):
    return item


def enable_gradient_checkpointing(model, reentrant: bool = False) -> None:
    """reentrant: torch's reentrant checkpoint, which gives parameters inside a checkpointed layer a gradient
    only when the layer's input requires one, so the embeddings' output is made to (LoRA freezes them)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config.use_cache = False
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        base.enable_input_require_grads()


class SFTJob:
    """SFT optimizer steps as the loop's Job; state = the optimization layer and the losses so far.

    The plan (which examples each step takes) is a pure function of sft.seed,
    so a resumed job only needs to know where it is: its loader starts at
    the first micro-batch of the step it resumes at.
    """

    def __init__(self, model, examples: list[Example], cfg: Config, pad_token_id: int, log: Callable[[str], None],
                 tokenizer=None, evaluate: Callable[[], dict[str, float]] | None = None):
        check_allocator(cfg.speed.allocator, log)  # asked for another than this process runs on: one line says so
        sft = self.sft = cfg.sft
        self.model, self.examples, self.pad_token_id, self.tokenizer = model, examples, pad_token_id, tokenizer
        self.evaluator = evaluate
        self.device = next(model.parameters()).device
        if sft.gradient_checkpointing:
            enable_gradient_checkpointing(model, sft.gradient_checkpointing_reentrant)
        model.train()
        self.plan = plan_steps(len(examples), sft)
        # torchrun: each rank takes every world_size-th micro-batch of a step; the loss is still divided
        # by the step's total targets (from the whole plan), so the ranks' gradients add up to the step's.
        ranks, rank = distributed.world_size(), distributed.rank()
        self.share = [micro_batches[rank::ranks] for micro_batches in self.plan]
        parameters = [p for p in model.parameters() if p.requires_grad]
        self.optimization = Optimization(parameters, OptimizerSettings.for_sft(cfg, len(self.plan), self.device),
                                         cfg.speed, log)
        self.forward = None
        if sft.compile == "on" or (sft.compile == "gpu" and self.device.type == "cuda"):
            from ..train.packing import backbone_and_head

            self.forward = CompiledOrEager(backbone_and_head(model)[0] if sft.packing else model, log)
        self.batches = None  # the loader's iterator, from the first step this process runs
        self.resume_command = "hasten sft --resume"
        self.losses: list[float] = []
        self.train_seconds = 0.0
        self.total_steps, self.eval_at_start, self.eval_every = len(self.plan), False, 0
        # TRL's MoE auxiliary loss: on a mixture-of-experts model, the padded pass returns the router's
        # load-balancing loss and coef x it joins each micro-batch's loss (logged as aux_loss)
        self.router_coef = router_aux_coefficient(getattr(model, "config", None), sft.router_aux_loss_coef, log)
        if self.router_coef and sft.packing:  # the packed pass has no router loss: said, not silently dropped
            log("sft: mixture-of-experts model with sft.packing on: no router aux loss (sft.packing=false adds it)")
            self.router_coef = 0.0

    def planned(self) -> list[int]:
        """Every example index the whole plan trains on, repeats included."""
        return [index for step in self.plan for micro in step for index in micro]

    def _loader(self, first_step: int):
        skip = sum(len(micro) for micro in self.share[:first_step])
        dataset = MicroBatches(self.examples, self.share, self.sft, self.pad_token_id, skip)
        return iter(torch.utils.data.DataLoader(
            dataset, batch_size=None, collate_fn=_identity, num_workers=self.sft.num_workers,
            pin_memory=self.device.type == "cuda", persistent_workers=False))

    def step(self, step: int) -> dict[str, Any]:
        started = time.perf_counter()
        if self.batches is None:
            self.batches = self._loader(step - 1)
        step_targets = sum(self.examples[i].num_targets for micro in self.plan[step - 1] for i in micro)
        micro_batches = self.share[step - 1]  # this rank's (all of them in one process)
        loss_total = aux_total = 0.0
        tally = TokenTally()
        for _ in micro_batches:
            batch = next(self.batches)
            with self.optimization.autocast():
                dft = self.sft.loss == "dft"
                if self.router_coef:
                    nll, aux = padded_nll_sum(self.model, batch, backbone=self.forward, router_aux=True, dft=dft,
                                              tally=tally)
                else:
                    pass_sum = packed_nll_sum if self.sft.packing else padded_nll_sum
                    nll = pass_sum(self.model, batch, backbone=self.forward, dft=dft, tally=tally)
            loss = nll / step_targets  # this micro-batch's share of the step's token-mean loss
            if self.router_coef:
                loss = loss + self.router_coef * aux / len(micro_batches)
                aux_total += float(aux.detach()) / len(micro_batches)
            self.optimization.backward(loss)
            loss_total += float(loss.detach())
        lr = self.optimization.lr
        loss_total = distributed.sum_over_ranks(loss_total)
        norm = self.optimization.step(loss_total)
        self.losses.append(loss_total)
        seconds = time.perf_counter() - started
        self.train_seconds += seconds
        tokens = sum(self.examples[i].input_length for micro in self.plan[step - 1] for i in micro)
        record = {"step": step, "loss": loss_total, "lr": lr, "grad_norm": norm, "tokens": tokens,
                  "target_tokens": step_targets, "time/step": seconds,
                  "mean_token_accuracy": distributed.sum_over_ranks(tally.correct) / step_targets}  # TRL's metric
        if self.router_coef:
            record["aux_loss"] = distributed.mean_over_ranks({"aux_loss": aux_total})["aux_loss"]
        return record

    def evaluate(self, step: int, run: RunDir) -> dict[str, Any] | None:
        return self.evaluator() if self.evaluator is not None else None

    def save_model(self, directory: Path) -> None:
        save_model_files(self.model, self.tokenizer, directory)

    def state_dict(self) -> dict[str, Any]:
        return {"optimization": self.optimization.state_dict(), "losses": list(self.losses),
                "train_seconds": self.train_seconds}

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        load_trained_weights(self.model, directory)
        self.optimization.load_state_dict(state["optimization"])
        self.losses, self.train_seconds = list(state["losses"]), float(state["train_seconds"])

    def settings(self) -> dict[str, Any]:
        """What the speed switches resolved to."""
        sft = self.sft
        return {"packing": sft.packing, "gradient_checkpointing": sft.gradient_checkpointing,
                "gradient_accumulation_steps": sft.gradient_accumulation_steps, "adamw": sft.adamw,
                "precision": self.optimization.precision.mode, "compile": bool(self.forward and self.forward.active),
                "num_workers": sft.num_workers, "device": self.device.type, "allocator": loaded_allocator()}

    def summary(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.batches = None  # lets DataLoader workers exit


def train_examples(model, examples: list[Example], cfg: Config, pad_token_id: int,
                   log: Callable[[str], None]) -> tuple[dict[str, Any], list[float]]:
    """Every optimizer step of the plan in memory, no run directory (tests and measurements):
    returns (resolved settings, per-step losses)."""
    job = SFTJob(model, examples, cfg, pad_token_id, log)
    for step in range(1, job.total_steps + 1):
        job.step(step)
    job.close()
    return job.settings(), job.losses


def weights_megabytes(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.iterdir() if f.suffix in (".safetensors", ".bin")) / 1e6


def run_sft(cfg: Config, log: Callable[[str], None] = print, profile: str | None = None,
            resume: Path | None = None) -> SFTReport:
    """Train on cfg.rft.data, save the checkpoint, evaluate it (eval.num_examples > 0); returns the report.

    resume: a run directory or checkpoint of an interrupted `hasten sft` (cfg is its config.yaml).
    """
    device = resolve_device(cfg.model.device)  # a GPU asked for and missing: a config error, before any work
    if fsdp.wanted(cfg):
        raise ConfigError("config error: train.distributed=fsdp shards GRPO runs only; hasten sft runs data "
                          "parallel (train.distributed=ddp)")
    configure_device(device)
    distributed.init(device)  # torchrun: join the process group (nothing without it)
    log = distributed.main_only(log)
    configure_threads(cfg.train.num_threads)
    if cfg.speed.keep_freed_memory:
        keep_freed_memory()
    check_trackers(cfg)
    from_records = cfg.sft.source == "records"
    records = load_records(cfg.rft.data) if from_records else []  # raises before anything loads or is written
    if resume is None:
        check_output_dir(cfg)
    if cfg.sft.max_examples:
        records = records[:cfg.sft.max_examples]
    task = make_task(cfg.task)
    if not from_records:
        check_demonstrations(task)
    random.seed(cfg.sft.seed)
    torch.manual_seed(cfg.sft.seed)  # the LoRA initialization
    policy = load_policy(cfg.model, log)
    policy.model.to(device)
    distributed.broadcast_parameters(policy.model)  # the LoRA init is equal by seed; rank 0's by construction
    examples = (record_examples(records, PromptFormat(task), policy.tokenizer, policy.eos_token_ids[0]) if from_records
                else demonstration_examples(cfg, task, policy.tokenizer))  # sft.source=task: tool conversations
    if cfg.output.name is None:
        cfg.output.name = f"{time.strftime('%Y%m%d-%H%M%S')}-sft-{task.name}" + (f"-{profile}" if profile else "")

    def evaluate() -> dict[str, float] | None:
        from .evaluation import evaluate_policy

        if not cfg.eval.num_examples or not distributed.is_main():  # torchrun: rank 0 evaluates
            return None
        return evaluate_policy(cfg, policy, task, log)

    job = SFTJob(policy.model, examples, cfg, policy.pad_token_id, log, policy.tokenizer, evaluate)
    run, checkpoint = loop.open_run(cfg, resume)
    length = (f"{cfg.sft.epochs} epoch{'' if cfg.sft.epochs == 1 else 's'}" if cfg.sft.max_steps <= 0
              else f"{cfg.sft.max_steps} step{'' if cfg.sft.max_steps == 1 else 's'}")
    log(f"sft: {len(examples)} example{'' if len(examples) == 1 else 's'} x {length}, run directory {run.path}")
    if not from_records and resume is None and distributed.is_main():  # what the tool conversations were
        save_demonstrations(run.path / DEMONSTRATIONS_FILE, task, cfg.sft.max_examples)
    summary = loop.run(job, cfg, run, log, checkpoint, created=resume is None,
                       callbacks=make_trackers(cfg, run, list))  # output.report_to
    if summary["status"] != "finished":  # checkpoint and summary written; the CLI exits 130 / 143
        raise Interrupted(signal_number(summary["signal"]), saved=True)
    distributed.barrier()  # torchrun: rank 0's final checkpoint is on disk before anyone reads it
    final = Path(summary["checkpoint"])
    report = SFTReport(
        run_dir=str(run.path), checkpoint=str(final), examples=len(examples), optimizer_steps=len(job.losses),
        train_seconds=job.train_seconds, trained_tokens=sum(examples[i].input_length for i in job.planned()),
        target_tokens=sum(examples[i].num_targets for i in job.planned()),
        first_loss=job.losses[0], final_loss=job.losses[-1], weights_mb=weights_megabytes(final), lora=cfg.model.lora,
        settings={"profile": profile, **job.settings()}, eval=summary.get("eval_after", {}),
    )
    run.write_summary({**summary, **report.to_dict()})
    return report


def signal_number(name: str) -> int:
    import signal

    return int(signal.Signals[name])
