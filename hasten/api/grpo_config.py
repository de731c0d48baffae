"""GRPOConfig: TRL 1.16's field names and defaults, mapped onto hasten's Config (one source of truth).

`GRPOConfig(output_dir=..., learning_rate=..., ...)` takes the fields a TRL
script sets; `to_config(rows)` turns them into the same config.py dataclasses
the CLI builds (validated by load_config, saved as the run's config.yaml).
Nothing is kept on the side: what the run does is what config.yaml says.

Rules:
- Every field below means what it means in TRL; docs/trl.md has the table.
- A TRL field hasten has no counterpart for (vLLM, hub, DeepSpeed, ...) is
  accepted only at its TRL default; any other value is one UserError naming
  it (trl_fields.py). A name that is no TRL field at all is an error too.
- Where hasten's CLI defaults differ from TRL's, this path uses TRL's:
  adam_beta2 0.999 (CLI 0.99), a linear schedule (CLI cosine), warmup
  starting from lr 0 (CLI from lr/warmup), save_minutes off (TRL saves by
  steps only). Where TRL's default is a GPU default, hasten keeps its own
  and documents it: gradient_checkpointing defaults to None = off on this
  path (TRL: on), and bf16 to None = hasten's train.precision=auto (bf16
  with an fp32 LM head where the hardware has native bf16 and the model is
  at least 256 wide, else fp32); set either explicitly to choose.
- Batch arithmetic is TRL's: generation_batch_size completions per
  generation = per_device_train_batch_size x steps_per_generation, split
  into gradient_accumulation_steps micro-batches for one optimizer step.
  hasten takes exactly one optimizer step per generation batch (per
  iteration), so steps_per_generation must equal gradient_accumulation_steps.
- max_steps counts optimizer steps as in TRL; hasten's train.steps counts
  generation batches, so train.steps = max_steps / num_iterations.

Hasten's own switches: `speed={"engine": "lean", ...}` (any speed.* key) and
`profile="balanced"` (profiles.py), applied as on the command line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError

# generation_kwargs keys that are hasten sampling settings (generation.<key>); length_penalty is read
# by beam search only, so without beams it changes nothing and is accepted
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_KWARGS = (*SAMPLING, "stop_strings", "length_penalty")


class APIError(UserError):
    """A GRPOConfig / GRPOTrainer argument hasten cannot honour; one line."""


@dataclass
class TrainingFields:
    """TrainingArguments fields hasten reads for both GRPO and SFT (TRL's defaults)."""

    # where and how long
    output_dir: str | None = None  # the run directory (None: "trainer_output", as transformers)
    max_steps: int = -1  # optimizer steps; -1: from num_train_epochs
    num_train_epochs: float = 3.0
    seed: int = 42
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    # optimizer and schedule
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"  # linear | cosine | constant | constant_with_warmup
    warmup_steps: float = 0  # an int, or a float < 1: a fraction of the optimizer steps (transformers 5)
    warmup_ratio: float | None = None  # older transformers' name for the fraction
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch_fused"  # adamw_torch | adamw_torch_fused
    # accepted, changing nothing hasten computes (docs/trl.md): rows are in memory, no DataLoader
    dataloader_num_workers: int = 0
    # logging, saving
    logging_steps: float = 10
    report_to: Any = "none"  # none | tensorboard | wandb | trackio | mlflow, or a list
    save_strategy: str = "steps"  # steps | no
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False  # True: checkpoints keep the model files, not trainer_state.pt (no resume)
    disable_tqdm: bool | None = None
    # precision and memory
    bf16: bool | None = None  # None: hasten's train.precision=auto (bf16_fp32head where bf16 is native, else fp32); True: bf16 autocast
    fp16: bool = False
    tf32: bool | None = None
    gradient_checkpointing: bool | None = None  # None: off (TRL: on); memory is rarely the limit on CPU
    torch_compile: bool = False
    model_init_kwargs: dict | None = None  # only {"dtype": ...}
    # hasten's own
    speed: dict[str, Any] | None = None  # speed.* keys, e.g. {"engine": "hf"}
    profile: str | None = None  # baseline | conservative | balanced | aggressive (profiles.py)


@dataclass
class _GRPOFields(TrainingFields):
    # batch (TRL's arithmetic: completions, not prompts)
    generation_batch_size: int | None = None  # completions per generation
    steps_per_generation: int | None = None
    num_generations: int = 8
    max_completion_length: int = 512
    # the algorithm
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"  # "sequence" with loss_type="grpo" is hasten's gspo
    scale_rewards: Any = "group"  # group | batch | none, or True / False
    reward_weights: list[float] | None = None
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0  # algo.top_entropy_quantile
    entropy_coef: float = 0.0  # algo.entropy_coef (the bonus: loss - coef x mean token entropy)
    use_adaptive_entropy: bool = False  # algo.adaptive_entropy, with the four keys below
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    use_bias_correction_kl: bool = True  # algo.kl_bias_correction (TRL's default on; hasten's CLI: off)
    sync_ref_model: bool = False  # every ref_model_sync_steps: algo.ref_model_sync_steps
    ref_model_sync_steps: int = 512
    ref_model_mixup_alpha: float = 0.6  # algo.ref_model_mixup_alpha
    delta: float | None = None  # algo.delta
    off_policy_mask_threshold: float | None = None  # algo.off_policy_mask_threshold
    router_aux_loss_coef: float | None = None  # algo.router_aux_loss_coef (None: the model config's own, as TRL)
    sapo_temperature_pos: float = 1.0  # algo.sapo_temperature_pos
    sapo_temperature_neg: float = 1.05  # algo.sapo_temperature_neg
    vespo_k_pos: float = 2.0  # algo.vespo_k_pos, and the three below
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    multi_objective_aggregation: str = "sum_then_normalize"  # | normalize_then_sum (rewards.aggregation)
    shuffle_dataset: bool = True  # False: prompts in dataset order (train.shuffle)
    # accepted, changing nothing hasten computes: sequences are packed, not padded (speed.packed_learning)
    pad_to_multiple_of: Any = "auto"
    cast_lm_head_to_fp32: bool = False  # hasten's weights and log-probs are fp32 already (bf16 is autocast)
    num_generations_eval: int | None = None  # completions sampled per eval prompt (api/eval_loss.py); None: num_generations
    # vLLM: speed.engine=vllm, in this process (colocate) or a server's (server: speed.vllm_server)
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_gpu_memory_utilization: float = 0.3  # speed.vllm_memory_fraction
    # generation
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None  # only {"stop_strings": [...]}
    chat_template_kwargs: dict | None = None
    max_tool_calling_iterations: int | None = None  # tool rounds per rollout; None: no cap but the length cap
    tool_isolation: str = "process"  # hasten only: generation.tool_isolation (process | thread: TRL's in-trainer tools)
    # logging and evaluation
    log_completions: bool = False
    eval_strategy: str = "no"  # no | steps
    eval_steps: float | None = None
    eval_on_start: bool = False
    per_device_eval_batch_size: int = 8
    # accepted at TRL's defaults only; GRPOTrainer checks them against the model and data (check_model_options)
    accelerator_config: Any = None  # transformers' AcceleratorConfig or a dict: only dispatch_batches may differ
    use_liger_kernel: bool = False  # True: TRL's lm_head error with a PEFT lm_head, else a one-line refusal


class TrainingConfig:
    """What GRPOConfig and SFTConfig share: TRL's keyword-only construction and the common mappings."""

    fields_class: type = TrainingFields

    def __init__(self, output_dir: str | None = None, **fields: Any):
        from .trl_fields import unsupported_value

        known = {item.name for item in dataclasses.fields(self.fields_class)}
        for name, value in fields.items():
            if name not in known:
                problem = unsupported_value(name, value, type(self).__name__)
                if problem is not None:
                    raise APIError(f"{type(self).__name__}: {problem}")
        self.fields_class.__init__(self, output_dir=output_dir, **{k: v for k, v in fields.items() if k in known})

    @property
    def iterations(self) -> int:
        """Optimizer steps per hasten step (GRPO: num_iterations; SFT: 1)."""
        return 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _error(self, text: str) -> APIError:
        return APIError(f"{type(self).__name__}: {text}")

    def _precision_mode(self) -> str | None:
        """bf16 | fp16 | None (hasten's default: train.precision=auto)."""
        if self.bf16 and self.fp16:
            raise self._error("bf16 and fp16 can not both be True")
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None

    def _model(self) -> list[tuple[str, Any]]:
        kwargs = dict(self.model_init_kwargs or {})
        dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
        if kwargs:
            raise self._error(f"model_init_kwargs {sorted(kwargs)} are not supported (only dtype)")
        return [("model.dtype", str(dtype).removeprefix("torch."))] if dtype not in (None, "auto") else []

    def _optimizer(self) -> str:
        kernels = {"adamw_torch_fused": "fused", "adamw_torch": "foreach"}  # the same AdamW update either way
        if self.optim not in kernels:
            raise self._error(f"optim={self.optim!r} is not supported (hasten's AdamW: {', '.join(kernels)})")
        return kernels[self.optim]

    def _schedule(self) -> str:
        kind = str(self.lr_scheduler_type)
        if kind == "constant" and (self.warmup_steps or self.warmup_ratio):
            raise self._error("lr_scheduler_type='constant' ignores warmup in transformers; "
                              "use 'constant_with_warmup' (or no warmup)")
        mapping = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
        if kind not in mapping:
            raise self._error(f"lr_scheduler_type={kind!r} is not supported (hasten has {', '.join(mapping)})")
        return mapping[kind]

    def _warmup(self, optimizer_steps: int) -> int:
        ratio = self.warmup_ratio if self.warmup_ratio is not None else (
            self.warmup_steps if 0 < self.warmup_steps < 1 else None)
        if ratio is not None:
            return math.ceil(optimizer_steps * ratio)  # transformers' get_warmup_steps
        if self.warmup_steps != int(self.warmup_steps) or self.warmup_steps < 0:
            raise self._error(f"warmup_steps must be a whole number >= 0 or a fraction < 1 (got {self.warmup_steps})")
        return int(self.warmup_steps)

    def _output(self, steps: int) -> list[tuple[str, Any]]:
        """output.*: the run directory is output_dir; saving and logging intervals in hasten steps."""
        directory = Path(self.output_dir or "trainer_output")
        if self.save_strategy not in ("steps", "no"):
            raise self._error(f"save_strategy={self.save_strategy!r} is not supported (steps | no)")
        save_every = 0 if self.save_strategy == "no" else _every(self.save_steps, steps, self.iterations)
        report = [] if self.report_to in (None, "none") else (
            [self.report_to] if isinstance(self.report_to, str) else list(self.report_to))
        if "all" in report:
            raise self._error("report_to='all' is not supported; name the trackers (tensorboard, wandb, trackio, "
                              "mlflow)")
        return [("output.dir", str(directory.parent)), ("output.name", directory.name),
                ("output.earlier_run", "set_aside"),
                ("output.save_every", save_every), ("output.save_minutes", 0.0),
                ("output.save_total_limit", self.save_total_limit or 0), ("output.report_to", report),
                ("output.log_every", max(1, _every(self.logging_steps, steps, self.iterations))),
                ("output.progress", "off" if self.disable_tqdm else "auto"), ("output.tracker_names", "trl"),
                *self._model()]

class GRPOConfig(TrainingConfig, _GRPOFields):
    """TRL's GRPOConfig surface; `overrides(...)` gives hasten's config keys."""

    fields_class = _GRPOFields

    def __init__(self, output_dir: str | None = None, **fields: Any):
        super().__init__(output_dir, **fields)
        self._accelerator_config()

    def _accelerator_config(self) -> None:
        """accelerator_config as transformers makes it (an AcceleratorConfig, read as args.accelerator_config.
        dispatch_batches). hasten has no accelerate: every rank draws the same prompts and takes its own groups,
        which is what dispatching would hand it, so dispatch_batches changes nothing; any other key does, and is
        refused."""
        from transformers.trainer_pt_utils import AcceleratorConfig

        given = self.accelerator_config
        if given is None or isinstance(given, dict):
            try:
                given = AcceleratorConfig(**(given or {}))
            except TypeError as error:
                raise self._error(f"accelerator_config: {error}") from None
        defaults = AcceleratorConfig()
        for item in dataclasses.fields(AcceleratorConfig):
            value = getattr(given, item.name)
            if item.name != "dispatch_batches" and value != getattr(defaults, item.name):
                raise self._error(f"accelerator_config {item.name}={value!r} is not supported by hasten (it runs "
                                  "no accelerate; only dispatch_batches is accepted)")
        self.accelerator_config = given

    @property
    def iterations(self) -> int:
        return self.num_iterations

    # ------------------------------------------------------------------ mapping

    def prompts_per_step(self) -> int:
        """Prompts per generation batch, by TRL's arithmetic (one process)."""
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise self._error("'generation_batch_size' and 'steps_per_generation' can not be both set")
        steps = self.steps_per_generation
        if self.generation_batch_size is not None:
            if self.generation_batch_size % self.per_device_train_batch_size:
                raise self._error(f"generation_batch_size ({self.generation_batch_size}) must be divisible "
                               f"by per_device_train_batch_size ({self.per_device_train_batch_size})")
            steps = self.generation_batch_size // self.per_device_train_batch_size
        steps = self.gradient_accumulation_steps if steps is None else steps
        if steps != self.gradient_accumulation_steps:
            raise self._error(f"steps_per_generation={steps} with gradient_accumulation_steps="
                           f"{self.gradient_accumulation_steps} is not supported (hasten takes one optimizer step "
                           "per generation batch: make them equal)")
        completions = self.per_device_train_batch_size * steps
        if completions % self.num_generations:
            raise self._error(f"generation_batch_size ({completions}) must be divisible by num_generations "
                           f"({self.num_generations})")
        return completions // self.num_generations

    def grpo_steps(self, num_rows: int) -> int:
        """hasten's train.steps (generation batches) from max_steps or num_train_epochs."""
        if self.max_steps > 0:
            if self.max_steps % self.num_iterations:
                raise self._error(f"max_steps ({self.max_steps}) must be a multiple of num_iterations "
                               f"({self.num_iterations}): hasten runs all of a batch's iterations in one step")
            return self.max_steps // self.num_iterations
        return max(1, math.ceil(self.num_train_epochs * num_rows / self.prompts_per_step()))

    def overrides(self, num_rows: int, num_eval_rows: int) -> list[tuple[str, Any]]:
        """(dotted key, value) pairs for config.load_config: every field's meaning in hasten's terms."""
        steps = self.grpo_steps(num_rows)
        optimizer_steps = steps * self.num_iterations
        pairs: list[tuple[str, Any]] = [
            ("train.steps", steps), ("train.prompts_per_step", self.prompts_per_step()),
            ("train.gradient_accumulation_steps", self.gradient_accumulation_steps), ("train.seed", self.seed),
            ("train.lr", self.learning_rate), ("train.weight_decay", self.weight_decay),
            ("train.adam_beta1", self.adam_beta1), ("train.adam_beta2", self.adam_beta2),
            ("train.max_grad_norm", self.max_grad_norm), ("train.warmup_from_zero", True),
            ("train.warmup_steps", self._warmup(optimizer_steps)), ("train.lr_schedule", self._schedule()),
            ("speed.optimizer", self._optimizer()),
            ("generation.num_generations", self.num_generations),
            ("generation.max_new_tokens", self.max_completion_length),
            ("eval.max_new_tokens", self.max_completion_length),
            *[(f"generation.{name}", self._sampling(name)) for name in SAMPLING],
            ("generation.stop_strings", self._stop_strings()),
            ("generation.chat_template_kwargs", dict(self.chat_template_kwargs or {})),
            # None is TRL's sys.maxsize: max_completion_length ends the loop first (one token per round at least)
            ("generation.max_tool_turns", self.max_completion_length if self.max_tool_calling_iterations is None
             else self.max_tool_calling_iterations),
            ("generation.tool_isolation", self.tool_isolation),
            ("algo.loss", self._loss()), ("algo.beta", self.beta), ("algo.epsilon", self.epsilon),
            ("algo.epsilon_high", self.epsilon_high), ("algo.num_iterations", self.num_iterations),
            ("algo.scale_rewards", {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)),
            ("algo.importance_sampling_level", self._importance_level()),
            ("algo.top_entropy_quantile", self.top_entropy_quantile), ("algo.delta", self.delta),
            ("algo.entropy_coef", self.entropy_coef), ("algo.adaptive_entropy", bool(self.use_adaptive_entropy)),
            ("algo.entropy_coef_min", self.entropy_coef_min), ("algo.entropy_coef_max", self.entropy_coef_max),
            ("algo.entropy_coef_delta", self.entropy_coef_delta), ("algo.entropy_target", self.entropy_target),
            ("algo.kl_bias_correction", bool(self.use_bias_correction_kl)),
            ("algo.ref_model_sync_steps", self._sync_steps()), ("algo.ref_model_mixup_alpha", self.ref_model_mixup_alpha),
            ("algo.off_policy_mask_threshold", self.off_policy_mask_threshold),
            ("algo.router_aux_loss_coef", self.router_aux_loss_coef),
            ("algo.sapo_temperature_pos", self.sapo_temperature_pos),
            ("algo.sapo_temperature_neg", self.sapo_temperature_neg),
            *[(f"algo.{name}", getattr(self, name)) for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                                                                 "vespo_lambda_neg")],
            ("rewards.aggregation", self.multi_objective_aggregation), ("train.shuffle", bool(self.shuffle_dataset)),
            ("algo.mask_truncated_completions", self.mask_truncated_completions),
            ("rewards.task_rewards", False), ("rewards.weights", self.reward_weights),
            ("output.log_completions", self.log_completions),
            *self._output(steps), *self._eval(num_eval_rows, steps),
        ]
        if self._precision_mode() is not None:
            pairs.append(("train.precision", self._precision_mode()))
        if self.tf32:
            pairs.append(("train.tf32", True))
        if self.gradient_checkpointing is not None:
            pairs.append(("speed.gradient_checkpointing", self.gradient_checkpointing))
        if self.torch_compile:
            pairs.append(("speed.compile", True))
        pairs += self._vllm() + self._accepted()
        pairs += [(f"speed.{key}", value) for key, value in (self.speed or {}).items()]
        return pairs

    def _accepted(self) -> list[tuple[str, Any]]:
        """Fields accepted because hasten already computes what they ask for; values it cannot are errors."""
        if self.num_generations_eval is not None and (not isinstance(self.num_generations_eval, int)
                                                      or self.num_generations_eval < 1):
            raise self._error(f"num_generations_eval must be None or a positive integer (got "
                              f"{self.num_generations_eval!r})")
        dtype = str((self.model_init_kwargs or {}).get("dtype", (self.model_init_kwargs or {}).get("torch_dtype")))
        if self.cast_lm_head_to_fp32 and dtype.removeprefix("torch.") in ("bfloat16", "float16"):
            raise self._error("cast_lm_head_to_fp32=True with a half-precision model_init_kwargs dtype is not "
                              "supported (load the model in fp32 and set bf16=True: hasten keeps fp32 weights)")
        return []

    def _vllm(self) -> list[tuple[str, Any]]:
        """use_vllm: hasten's vLLM engine (speed.engine=vllm), colocated or on a `trl vllm-serve` server."""
        if not self.use_vllm:
            return []
        pairs: list[tuple[str, Any]] = [("speed.engine", "vllm"),
                                        ("speed.vllm_memory_fraction", self.vllm_gpu_memory_utilization)]
        if self.vllm_mode == "server":
            url = self.vllm_server_base_url or f"http://{self.vllm_server_host}:{self.vllm_server_port}"
            return pairs + [("speed.vllm_server", url)]
        if self.vllm_mode != "colocate":
            raise self._error(f"vllm_mode={self.vllm_mode!r} is not supported (colocate | server)")
        return pairs

    def _sync_steps(self) -> int:
        if not self.sync_ref_model:
            return 0
        if self.beta == 0:
            raise self._error("sync_ref_model=True needs beta > 0 (with beta 0 there is no reference model)")
        if self.ref_model_sync_steps % self.num_iterations:
            raise self._error(f"ref_model_sync_steps ({self.ref_model_sync_steps}) must be a multiple of "
                              f"num_iterations ({self.num_iterations}): hasten syncs between generation batches")
        return self.ref_model_sync_steps

    def _importance_level(self) -> str:
        level = self.importance_sampling_level
        if level not in ("token", "sequence"):
            raise self._error(f"importance_sampling_level must be 'token' or 'sequence' (got {level!r})")
        return "token" if self.loss_type == "grpo" else level  # grpo at the sequence level is algo.loss=gspo

    def _loss(self) -> str:
        from ..config import CHOICES

        level, loss = self.importance_sampling_level, self.loss_type
        if level == "sequence" and loss == "grpo":
            return "gspo"  # the same loss (tests/test_losses.py); other losses: algo.importance_sampling_level
        if loss not in CHOICES["algo.loss"] or loss == "gspo":
            raise self._error(f"loss_type={loss!r} is not supported (hasten has grpo, bnpo, dr_grpo, dapo, cispo, sapo, "
                              "luspo, vespo; GSPO is importance_sampling_level='sequence')")
        return loss

    def _stop_strings(self) -> list[str]:
        stops = self._generation_kwargs().get("stop_strings") or []
        return [stops] if isinstance(stops, str) else list(stops)

    def _generation_kwargs(self) -> dict[str, Any]:
        """generation_kwargs onto hasten's sampling: the sampling keys override the fields (as TRL's
        generation config takes them); keys that ask for something else than sampling are errors."""
        given = dict(self.generation_kwargs or {})
        if given.pop("do_sample", True) is not True:
            raise self._error("generation_kwargs do_sample=False is not supported (GRPO samples its group)")
        if given.get("num_beams", 1) != 1:
            raise self._error(f"generation_kwargs num_beams={given['num_beams']} is not supported (hasten samples; "
                              "beam search is not one of its engines' modes)")
        given.pop("num_beams", None)
        if "max_new_tokens" in given:
            raise self._error("generation_kwargs max_new_tokens is not supported (use max_completion_length)")
        unknown = sorted(set(given) - set(GENERATION_KWARGS))
        if unknown:
            raise self._error(f"generation_kwargs {unknown} are not supported (hasten reads "
                              f"{', '.join(GENERATION_KWARGS)}, do_sample=True and num_beams=1)")
        return given

    def _sampling(self, name: str) -> Any:
        """A sampling field, generation_kwargs' value first."""
        value = self._generation_kwargs().get(name, getattr(self, name))
        return 0.0 if name == "min_p" and value is None else value

    def _eval(self, num_eval_rows: int, steps: int = 0) -> list[tuple[str, Any]]:
        if self.eval_strategy not in ("no", "steps"):
            raise self._error(f"eval_strategy={self.eval_strategy!r} is not supported (no | steps)")
        if self.eval_strategy == "no" or not num_eval_rows:
            return [("eval.at_start", False), ("eval.num_examples", 0)]
        every = self.eval_steps if self.eval_steps is not None else self.logging_steps
        return [("eval.at_start", self.eval_on_start), ("eval.every", _every(every, steps, self.iterations)),
                ("eval.num_examples", num_eval_rows), ("eval.batch_size", self.per_device_eval_batch_size)]


def _every(value: float, steps: int, iterations: int = 1) -> int:
    """A TRL interval in optimizer steps (a whole number, or a fraction < 1 of the run) as hasten steps:
    each hasten step is num_iterations optimizer steps. Rounded up, at least 1; 0 stays 0."""
    if 0 < value < 1:
        return max(1, math.ceil(value * steps))
    return 0 if value <= 0 else max(1, math.ceil(int(value) / iterations))
