"""Config sections of the jobs beside GRPO on a language model: the game, the code task, RFT and SFT.

hasten/config.py assembles them into `Config` and validates them with its own
machinery; the choices and ranges of their string and number keys live here,
next to the fields they check.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GameConfig:
    """fruit-catcher (hasten/games/): the game's rules, the policy MLP and one epoch's rollout.

    The optimizer, schedule, clipping, seed and epochs (train.steps) come from
    `train:`, the loss and advantage scaling from `algo:`, like any GRPO run.
    """

    width: int = 20  # grid columns
    height: int = 15  # grid rows; the sprite lives on the bottom row
    sprite_width: int = 3  # catches a fruit landing within sprite_width // 2 cells of its centre
    max_fruits: int = 3  # observation: 1 + 3 * max_fruits floats
    spawn_gap: int = 5  # a random spawn waits until the top-most active fruit is at y >= spawn_gap
    spawn_probability: float = 0.5  # chance per step that a fruit spawns (once the gap allows)
    episode_steps: int = 100  # steps per game
    num_starts: int = 17  # start states per epoch: the GRPO groups
    games_per_start: int = 32  # G games per start: 17 x 32 = 544 games x 100 steps per epoch
    shared_draws: bool = True  # a group's G games also share the spawn draws (same fruits; only actions differ)
    gamma: float = 0.9  # discount of the per-step score changes: ~10-step horizon, a fruit falls 14 rows
    entropy_coef: float = 0.01  # bonus on the mean policy entropy (keeps exploring)
    hidden_size: int = 128  # MLP width: obs -> hidden -> residual(LayerNorm, hidden) -> 3 actions
    compile: bool = False  # torch.compile the policy (falls back, with a logged reason, where unavailable)
    eval_games: int = 512  # held-out games per evaluation (fixed seed: comparable across epochs)


@dataclass
class CodeConfig:
    """The code task and its sandbox (docs/sandbox.md); read only when task.name is code."""

    source: str = "builtin"  # training rows: builtin | mbpp (task.path) | jsonl (task.path)
    eval_source: str = "heldout"  # heldout (the source's held-out rows) | humaneval (164 problems)
    workers: int = 0  # sandbox worker processes; 0 = one per core, at least 2
    cache_size: int = 4096  # executions remembered per (code, tests); 0 = no cache
    wall_seconds: float = 10.0  # one execution, all tests
    test_seconds: float = 3.0  # one test
    memory_mb: int = 512  # address space per process
    max_processes: int = 8  # processes + threads per execution
    sandbox_fallback: bool = False  # run code even where Linux refuses namespaces (weaker; docs/sandbox.md)
    typecheck: bool = False  # add a mypy reward (needs mypy installed)
    pass_k: list[int] = field(default_factory=lambda: [1, 5])  # eval: pass@k for each k <= pass_n
    pass_n: int = 0  # eval: samples per problem for pass@k; 0 = greedy pass@1 only
    pass_temperature: float = 0.8  # eval: sampling temperature for pass@k


@dataclass
class RFTConfig:
    """Rejection-sampling data generation (`hasten rft datagen`); docs/rft.md."""

    data: str = "data/rft.json"  # the records datagen writes and sft reads: [question, answer, reasoning]
    oversample: int = 10  # samples per question; a question counts if any one is correct
    temperature: float = 0.6  # sampling temperature of datagen
    max_new_tokens: int = 64  # completion length cap of datagen
    prompts_per_batch: int = 8  # 8 prompts x 10 samples = 80 rows per generate call
    keep: str = "one"  # one: the first correct sample per question | all: every distinct correct one
    seed: int = 0  # datagen sampling seed


@dataclass
class SFTConfig:
    """Supervised fine-tuning on RFT records (`hasten sft`); profiles in hasten/rft/profiles.py."""

    source: str = "records"  # records (rft.data) | task: the task's correct tool conversations (calculator; docs/agentic.md)
    epochs: int = 3  # passes over the records
    max_steps: int = 0  # > 0: exactly this many optimizer steps, epochs repeating as needed (TRL's max_steps); 0 = epochs
    lr: float = 2e-4  # a LoRA rate; a full fine-tune wants ~1e-5
    batch_size: int = 16  # examples per optimizer step
    gradient_accumulation_steps: int = 4  # micro-batches per step (16 / 4 = 4 examples each; at most 1 each)
    warmup_steps: int = 2  # optimizer steps of linear warmup
    warmup_from_zero: bool = False  # as train.warmup_from_zero
    lr_schedule: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.0  # cosine/linear floor as a fraction of lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    max_grad_norm: float = 1.0  # 0 = no clipping
    packing: bool = True  # examples packed into rows with a block mask; logits only where the loss is
    loss: str = "nll"  # nll | dft: each target token's -log p weighted by p, detached (DFT, arXiv:2508.05629; TRL's loss_type)
    router_aux_loss_coef: float = 0.001  # mixture-of-experts models: + this x the router load-balancing loss per micro-batch (TRL's key; 0 = off; runs the padded pass)
    pack_length: int = 1024  # tokens per packed row (an example longer than this gets a row alone)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more time
    gradient_checkpointing_reentrant: bool = False  # torch's reentrant checkpoint (TRL's gradient_checkpointing_kwargs use_reentrant)
    compile: str = "off"  # off | on | gpu (on only with CUDA); torch.compile the decoder, eager (logged) on failure
    precision: str = "auto"  # auto (bf16/fp16 autocast on CUDA, fp32 on CPU) | fp32 | bf16 | fp16 (CUDA only)
    adamw: str = "fused"  # fused | foreach | plain (for-loop); fused falls back to foreach where unsupported
    num_workers: int = 0  # DataLoader processes that tokenize and pack ahead of the model
    max_examples: int = 0  # train on the first N records only; 0 = all
    seed: int = 0  # seeds the example order and LoRA init
    logit_chunk_tokens: int = 1024  # packed pass: logits in checkpointed chunks of this many tokens; 0 = at once


CHOICES: dict[str, tuple[str, ...]] = {
    "code.source": ("builtin", "mbpp", "jsonl"),
    "code.eval_source": ("heldout", "humaneval"),
    "rft.keep": ("one", "all"),
    "sft.source": ("records", "task"),
    "sft.lr_schedule": ("cosine", "linear", "constant"),
    "sft.loss": ("nll", "dft"),
    "sft.precision": ("auto", "fp32", "bf16", "fp16"),
    "sft.adamw": ("fused", "foreach", "plain"),
    "sft.compile": ("off", "on", "gpu"),
}

# (key, predicate, requirement), as config.py's _RANGES.
RANGES: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ("game.width", lambda v: v >= 3, ">= 3"),
    ("game.height", lambda v: v >= 2, ">= 2"),
    ("game.sprite_width", lambda v: v >= 1, ">= 1"),
    ("game.max_fruits", lambda v: v >= 1, ">= 1"),
    ("game.spawn_gap", lambda v: v >= 0, ">= 0"),
    ("game.spawn_probability", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("game.episode_steps", lambda v: v >= 1, ">= 1"),
    ("game.num_starts", lambda v: v >= 1, ">= 1"),
    ("game.games_per_start", lambda v: v >= 2, ">= 2 (GRPO compares games within a group)"),
    ("game.gamma", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("game.entropy_coef", lambda v: v >= 0, ">= 0"),
    ("game.hidden_size", lambda v: v >= 1, ">= 1"),
    ("game.eval_games", lambda v: v >= 0, ">= 0"),
    ("code.workers", lambda v: v >= 0, ">= 0"),
    ("code.cache_size", lambda v: v >= 0, ">= 0"),
    ("code.wall_seconds", lambda v: v > 0, "> 0"),
    ("code.test_seconds", lambda v: v > 0, "> 0"),
    ("code.memory_mb", lambda v: v >= 64, ">= 64"),
    ("code.max_processes", lambda v: v >= 4, ">= 4 (the sandbox itself uses three)"),
    ("code.pass_k", lambda v: all(k >= 1 for k in v), "a list of k >= 1"),
    ("code.pass_n", lambda v: v >= 0, ">= 0"),
    ("code.pass_temperature", lambda v: v > 0, "> 0"),
    ("rft.oversample", lambda v: v >= 1, ">= 1"),
    ("rft.temperature", lambda v: v > 0, "> 0 (rejection sampling needs varied samples)"),
    ("rft.max_new_tokens", lambda v: v > 0, "> 0"),
    ("rft.prompts_per_batch", lambda v: v >= 1, ">= 1"),
    ("sft.epochs", lambda v: v >= 1, ">= 1"),
    ("sft.max_steps", lambda v: v >= 0, ">= 0"),
    ("sft.lr", lambda v: v > 0, "> 0"),
    ("sft.batch_size", lambda v: v >= 1, ">= 1"),
    ("sft.gradient_accumulation_steps", lambda v: v >= 1, ">= 1"),
    ("sft.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("sft.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("sft.weight_decay", lambda v: v >= 0, ">= 0"),
    ("sft.max_grad_norm", lambda v: v >= 0, ">= 0"),
    ("sft.pack_length", lambda v: v >= 16, ">= 16"),
    ("sft.num_workers", lambda v: v >= 0, ">= 0"),
    ("sft.max_examples", lambda v: v >= 0, ">= 0"),
]
