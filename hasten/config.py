"""Typed run configuration: the one source of truth for every knob.

Sections are dataclasses with their defaults in code. A run's config is built
as defaults <- YAML file (`--config run.yaml`) <- dotted overrides
(`--train.lr=1e-6`), each value checked against the field's type and range.
Any problem raises `ConfigError` with a one-line message naming the key and
what is allowed; the CLI turns that into exit code 2 before anything is
written. The resolved config is saved in the run directory as config.yaml.

Choices for string fields live in `CHOICES` next to the dataclasses so the
error message and the validation read the same list.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from .errors import UserError


class ConfigError(UserError):
    """A user-facing configuration problem; str() is the one-line message."""


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # registry name, local HF dir, or hub id
    dtype: str = "float32"  # fp32 on CPU: bf16 matmul is ~4x slower there (no AMX)
    lora: bool = False  # train LoRA adapters instead of all weights
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class TaskConfig:
    name: str = "unit-conversion"  # arithmetic | unit-conversion | jsonl
    path: str | None = None  # jsonl: training file
    eval_path: str | None = None  # jsonl: held-out file (default: last 10% of `path`)
    num_train: int = 2000  # generated tasks: training questions
    num_eval: int = 64  # held-out questions
    seed: int = 1234  # data generation seed (separate from the training seed)
    system_prompt: str | None = None  # None: the task's own
    worked_example: bool = True  # show one solved question first (generated tasks)


@dataclass
class RewardsConfig:
    task_rewards: bool = True  # use the task's built-in reward functions
    extra: list[str] = field(default_factory=list)  # "path/to/file.py:function", repeatable
    weights: list[float] | None = None  # one per function (task's first, then extra); None = defaults


@dataclass
class GenerationConfig:
    num_generations: int = 8  # G completions per prompt (the GRPO group)
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off


@dataclass
class AlgoConfig:
    loss: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | gspo (TRL's default is dapo)
    scale_rewards: str = "group"  # group | batch | none
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip: ratio <= 1 + epsilon_high (None = epsilon)
    beta: float = 0.0  # KL weight; 0 = no reference model at all
    num_iterations: int = 1  # mu: optimizer passes over each generation batch


@dataclass
class TrainConfig:
    steps: int = 100  # GRPO steps (one generation batch each)
    prompts_per_step: int = 4  # 4 prompts x 8 generations = 32 samples/step
    lr: float = 1e-6
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    max_grad_norm: float = 1.0  # 0 = no clipping
    gradient_accumulation_steps: int = 1  # the batch is split in this many chunks per optimizer step
    seed: int = 0
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default


@dataclass
class EvalConfig:
    at_start: bool = True
    every: int = 0  # held-out eval every N steps; 0 = only at start and end
    num_examples: int = 64  # capped by task.num_eval
    max_new_tokens: int = 64
    batch_size: int = 64


@dataclass
class OutputConfig:
    dir: str = "runs"
    name: str | None = None  # None = <time>-<task>
    save_every: int = 0  # checkpoint every N steps; 0 = only at the end
    plot: bool = True
    progress: str = "auto"  # auto | live | plain | off


@dataclass
class SpeedConfig:
    """Switches for speed features; each changes how fast, never what is learned."""

    engine: str = "auto"  # auto (lean where supported, else hf) | lean (rollout/lean.py) | hf (rollout/engine.py)
    keep_freed_memory: bool = True  # glibc: reuse freed activations instead of re-faulting pages (runtime.py)
    packed_learning: bool = True  # one row per group: prompt once, completions packed (train/packing.py)
    logit_chunk_tokens: int = 1024  # packed pass: logits in checkpointed chunks of this many tokens; 0 = at once
    # The keys below are hasten/speed/ (docs/speedups.md has one section per feature). The defaults
    # equal the `conservative` profile (hasten/profiles.py): nothing here changes what is learned
    # unless its comment says so.
    min_pack_ratio: float = 0.0  # packed pass only when its rows are at least this full (real / slots); 0 = always
    reward_workers: int = 2  # threads (or processes) for slow reward functions; 0 = score them inline
    reward_pool: str = "thread"  # thread | process: where slow reward functions run
    slow_rewards: list[str] = field(default_factory=list)  # reward names to run in the pool (or fn.slow = True)
    reward_cache: bool = True  # cache deterministic reward functions' scores per (prompt, completion, columns)
    reward_cache_size: int = 50000  # LRU entries per run (one per function and sample)
    cache_rewards: list[str] = field(default_factory=list)  # reward names to cache (or fn.deterministic = True)
    gate_reward: str | None = None  # early termination: this reward runs first; a failing sample skips the rest
    gate_threshold: float = 0.5  # a sample passes the gate when its gate score >= this
    gate_failed_reward: float = 0.0  # the total reward a gated (failed) sample gets; changes learning
    curriculum: str = "off"  # off | length | complexity | success_rate: easy prompts first; changes learning
    curriculum_warmup_steps: int = 0  # steps over which the pool grows from the easiest quarter to all data
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill; changes learning
    dynamic_sampling_max_rounds: int = 2  # extra generation rounds per step at most (the cap on extra work)
    precision: str = "fp32"  # fp32 | bf16 | fp16 autocast in the learning pass (fp16 adds a GradScaler); changes numerics
    tf32: bool = False  # CUDA only: TF32 matmuls (changes numerics a little)
    compile: bool = False  # torch.compile the decoder layers (capability check, logged fallback)
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune
    optimizer: str = "auto"  # auto (fused on CUDA, foreach on CPU) | fused | foreach | for_loop (AdamW kernels)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more compute
    offload_reference: bool = False  # keep the KL reference on the CPU, on the device only for its pass
    nan_guard: bool = True  # skip an update with a non-finite loss or gradient, log it
    nan_guard_patience: int = 3  # after this many skipped updates in a row, take nan_guard_action
    nan_guard_action: str = "lower_lr"  # lower_lr | disable_mixed_precision | stop
    nan_guard_lr_factor: float = 0.5  # lower_lr multiplies the learning rate by this
    prefetch: bool = True  # draw and encode the next step's prompts in a background thread


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "algo.loss": ("grpo", "bnpo", "dr_grpo", "dapo", "gspo"),
    "algo.scale_rewards": ("group", "batch", "none"),
    "train.lr_schedule": ("cosine", "constant"),
    "output.progress": ("auto", "live", "plain", "off"),
    "speed.engine": ("auto", "lean", "hf"),
    "speed.reward_pool": ("thread", "process"),
    "speed.curriculum": ("off", "length", "complexity", "success_rate"),
    "speed.precision": ("fp32", "bf16", "fp16"),
    "speed.compile_mode": ("default", "reduce-overhead", "max-autotune"),
    "speed.optimizer": ("auto", "fused", "foreach", "for_loop"),
    "speed.nan_guard_action": ("lower_lr", "disable_mixed_precision", "stop"),
}

# (key, predicate, human-readable requirement) checked after types are right.
_RANGES: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ("model.lora_r", lambda v: v > 0, "> 0"),
    ("model.lora_alpha", lambda v: v > 0, "> 0"),
    ("model.lora_dropout", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("task.num_train", lambda v: v > 0, "> 0"),
    ("task.num_eval", lambda v: v >= 0, ">= 0"),
    ("generation.num_generations", lambda v: v >= 2, ">= 2 (GRPO compares samples within a group)"),
    ("generation.max_new_tokens", lambda v: v > 0, "> 0"),
    ("generation.temperature", lambda v: v > 0, "> 0 for training (greedy is used for eval only)"),
    ("generation.top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("generation.top_k", lambda v: v >= 0, ">= 0"),
    ("algo.epsilon", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("algo.epsilon_high", lambda v: v is None or v >= 0, ">= 0"),
    ("algo.beta", lambda v: v >= 0, ">= 0"),
    ("algo.num_iterations", lambda v: v >= 1, ">= 1"),
    ("train.steps", lambda v: v >= 0, ">= 0"),
    ("train.prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("train.lr", lambda v: v > 0, "> 0"),
    ("train.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("train.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("train.weight_decay", lambda v: v >= 0, ">= 0"),
    ("train.adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("train.adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("train.max_grad_norm", lambda v: v >= 0, ">= 0"),
    ("train.gradient_accumulation_steps", lambda v: v >= 1, ">= 1"),
    ("train.num_threads", lambda v: v >= 0, ">= 0"),
    ("eval.every", lambda v: v >= 0, ">= 0"),
    ("eval.num_examples", lambda v: v >= 0, ">= 0"),
    ("eval.max_new_tokens", lambda v: v > 0, "> 0"),
    ("eval.batch_size", lambda v: v > 0, "> 0"),
    ("output.save_every", lambda v: v >= 0, ">= 0"),
    ("speed.logit_chunk_tokens", lambda v: v >= 0, ">= 0"),
    ("speed.min_pack_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("speed.reward_workers", lambda v: v >= 0, ">= 0"),
    ("speed.reward_cache_size", lambda v: v >= 1, ">= 1"),
    ("speed.curriculum_warmup_steps", lambda v: v >= 0, ">= 0"),
    ("speed.dynamic_sampling_max_rounds", lambda v: v >= 0, ">= 0"),
    ("speed.nan_guard_patience", lambda v: v >= 1, ">= 1"),
    ("speed.nan_guard_lr_factor", lambda v: 0 < v < 1, "in (0, 1)"),
]


# ---------------------------------------------------------------- type checks


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return `value` as type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"config error: {key} must be {_type_name(tp)} (got {value!r})")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config error: {key} must be {_type_name(tp)} (got {value!r})")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"config error: {key} must be {_type_name(tp)} (got {value!r})")


def _fields(section: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = {f.name for f in dataclasses.fields(cfg)}
    if len(parts) != 2 or parts[0] not in sections:
        raise ConfigError(
            f"config error: unknown key '{dotted}' (sections: {', '.join(sorted(sections))}; "
            "keys look like train.lr)"
        )
    section = getattr(cfg, parts[0])
    fields = _fields(section)
    if parts[1] not in fields:
        raise ConfigError(
            f"config error: unknown key '{dotted}' (allowed in {parts[0]}: {', '.join(fields)})"
        )
    field_type = fields[parts[1]]
    if isinstance(value, Raw):
        value = value.parse(field_type)
    setattr(section, parts[1], _coerce(dotted, value, field_type))


def validate(cfg: Config) -> Config:
    """Check choices and ranges; raise ConfigError on the first problem."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ConfigError(f"config error: {key} must be one of {', '.join(allowed)} (got {value!r})")
    for key, ok, requirement in _RANGES:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not ok(value):
            raise ConfigError(f"config error: {key} must be {requirement} (got {value!r})")
    if cfg.task.name == "jsonl" and not cfg.task.path:
        raise ConfigError("config error: task.path is required when task.name is jsonl")
    if cfg.train.gradient_accumulation_steps > cfg.train.prompts_per_step * cfg.generation.num_generations:
        raise ConfigError(
            "config error: train.gradient_accumulation_steps must be <= samples per step "
            f"({cfg.train.prompts_per_step} x {cfg.generation.num_generations})"
        )
    return cfg


# ------------------------------------------------------------- build a config


class Raw(str):
    """Override text from the command line, read according to the field it sets.

    A str field takes the text as it is (so `--output.progress=off` stays "off"
    rather than YAML's boolean), except `null` for an optional field; any other
    field reads it as a YAML scalar or list.
    """

    def parse(self, tp: Any) -> Any:
        import yaml

        text = str(self)
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        if text in ("null", "~", "None") and type(None) in args:
            return None
        if str in args:
            return text
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            return text
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string; plain float syntax is fine here
            try:
                return float(value)
            except ValueError:
                return value
        return value


def parse_override(text: str) -> tuple[str, Raw]:
    """'train.lr=1e-6' -> ('train.lr', Raw('1e-6')); the value is typed when it is set."""
    if "=" not in text:
        raise ConfigError(f"config error: override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip().removeprefix("--"), Raw(raw)


def load_config(
    path: str | Path | None = None, overrides: list[tuple[str, Any]] | None = None, profile: str | None = None
) -> Config:
    """Defaults <- YAML file <- speed profile (hasten/profiles.py) <- overrides, validated."""
    import yaml

    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config error: config file '{path}' does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config error: {path}{where} is not valid YAML") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config error: {path} must hold a mapping of sections")
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config error: '{section}' in {path} must be a mapping of keys")
            for key, value in values.items():
                _set(cfg, f"{section}.{key}", value)
    if profile is not None:
        from .profiles import apply_profile

        for key, value in overrides or []:  # first, so that a profile's rules read the run's real numbers
            _set(cfg, key, value)
        apply_profile(cfg, profile)
    for key, value in overrides or []:
        _set(cfg, key, value)
    return validate(cfg)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
