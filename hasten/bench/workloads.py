"""hasten's side of `hasten bench` (docs/benchmarks.md B1-B4): options, the B1 setup B1-B3 share, and B3.

B1  one GRPO step with hasten's own prepare / Learner / grpo_step on
    configs/b1.yaml, alternated step by step with TRL processes (peers.py);
    median step seconds over steps 2..N (step 1 pays one-off allocation);
    in b1.py.
B2  decode: hasten's engines against transformers' generate (and vLLM
    when installed), with EOS unable to end a row; in b2.py, on the
    HastenSide built here.
B3  the learning pass on one fixed B1 rollout: log-probs + loss + backward,
    no optimizer step (on both sides), with speed.packed_learning on (hasten)
    and off (the plain padded transformers pass, the peer).
B4  startup, each in a fresh process: `hasten --help`; launch to the end of
    step 1 of `hasten train` (B1 config, eval off); hasten import + prepare +
    Learner against TRL import + GRPOTrainer construction; in b4.py.

Every row carries the model work of each run (FLOPs, and bytes per phase) for the
`limit` column; what counts is defined in report.py and cost.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import cost
from .report import ModelSize, Result, Row, Work, generation_flops, learning_flops, model_size

CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "b1.yaml"
# --quick: the tiny model at toy sizes, so tests run every path in seconds.
QUICK_OVERRIDES = [("model.name", "tiny"), ("train.prompts_per_step", 2),  # 2 prompts x 4 generations = 8 samples
                   ("generation.num_generations", 4), ("generation.max_new_tokens", 8)]


@dataclass
class BenchOptions:
    workloads: list[str]
    peers: list[str]  # among "trl", "hf", "vllm"
    model: str
    quick: bool = False
    repeats: int | None = None  # None: 5 B1 steps (4 quick: 2), 3 rounds elsewhere (quick: 2; B4 1)
    config: Path = CONFIG_PATH
    log: Callable[[str], None] = print
    decode_shape: tuple[int, int, int] = (8, 8, 64)  # B2: 8 prompts x 8 samples x 64 new tokens
    trl_checkpointing: tuple[bool, ...] = (False, True)  # B1: TRL's CPU best, then its default
    trl_bf16: bool = False  # TRL with bf16=True (B1, B5): its best on a CPU with AMX / AVX512-BF16
    contention: list[int] = field(default_factory=lambda: [0])  # busy neighbour processes, one level per entry
    b5: Any = None  # b5.B5Options when B5 is asked for
    b7: Any = None  # the same for B7 (b7.py), with its model
    speculative: tuple[str, ...] = ()  # B2: extra lean+speculative rows: "ngram", "layers:N" or a draft model
    speculative_tokens: int = 4  # their k
    batch_sizes: tuple[int, ...] = ()  # B2: also the sweep over decode batch sizes (sampled and greedy)
    b8: Any = None  # scaling.B8Options when B8 is asked for
    report: Path | None = None  # --report DIR: the table, the JSON line and the plots are written there too
    progress: Callable[[int, int], None] = field(default=lambda done, total: None)  # (runs done, runs in all) of
    # the workload now measured: its ticker (bench run(), ticker.py)

    def rounds(self, workload: str) -> int:
        if self.repeats is not None:
            return self.repeats
        if self.quick:
            return 1 if workload == "B4" else 2
        return 5 if workload == "B1" else 3


# ------------------------------------------------------------------ hasten's side


def no_progress(done: int, total: int) -> None:
    """BenchOptions.progress outside a workload."""


def bench_config(opts: BenchOptions, steps: int):
    """configs/b1.yaml, with --model and --quick applied; `steps` sets the run length (the schedule)."""
    from ..config import load_config

    overrides = [("model.name", opts.model)] + (QUICK_OVERRIDES if opts.quick else []) + [("train.steps", steps)]
    return load_config(opts.config, overrides)


class RecordingEngine:
    """Passes generate() through to an engine and keeps the last rollout (for token counts)."""

    def __init__(self, engine):
        self.engine = engine
        self.last = None

    def generate(self, *args, **kwargs):
        self.last = self.engine.generate(*args, **kwargs)
        return self.last

    def __getattr__(self, name):  # everything else (weights_changed, sync_weights, ...) is the engine's
        return getattr(self.engine, name)


@dataclass
class HastenSide:
    """hasten's B1 setup, built once and shared by B1-B3."""

    cfg: Any
    session: Any
    learner: Any
    size: ModelSize
    notes: list[str] = field(default_factory=list)
    _hf_policy: Any = None

    def hf_policy(self):
        """The same weights in transformers' classes, for the peers that are transformers code (B2, B3).

        hasten's own rows run on session.policy, which speed.model_impl=auto loads
        into the native Llama (models/llama.py); a peer must stay transformers'.
        """
        if getattr(self.session.policy.model, "hasten_native", False):
            if self._hf_policy is None:
                from ..models import load_policy

                self._hf_policy = load_policy(self.cfg.model, log=lambda text: None)
            return self._hf_policy
        return self.session.policy

    @classmethod
    def build(cls, opts: BenchOptions) -> HastenSide:
        from ..train.learner import Learner
        from ..train.trainer import prepare

        cfg = bench_config(opts, opts.rounds("B1"))
        session = prepare(cfg, log=opts.log)
        return cls(cfg, session, Learner.from_config(session.policy, cfg, None), model_size(session.policy.model))

    @property
    def shape(self) -> cost.Shape:
        return cost.Shape.from_config(self.session.policy.model.config)

    def prompts(self, count: int) -> tuple[list[dict], list[list[int]]]:
        """The first `count` rows of B1's prompt stream and their token ids (both sides get these)."""
        from ..rollout.prompts import encode_prompt
        from ..tasks.sampler import PromptSampler

        rows = PromptSampler(self.session.task.train_rows, self.cfg.train.seed).next(count)
        return rows, [encode_prompt(self.session.policy.tokenizer, row["prompt"]) for row in rows]

    def sampling(self, max_new_tokens: int | None = None):
        from ..rollout import SamplingParams

        generation = self.cfg.generation
        return SamplingParams(max_new_tokens or generation.max_new_tokens, generation.temperature,
                              generation.top_p, generation.top_k)


def peer_model_dir(name: str, workdir: Path) -> str:
    """A directory (or hub id) holding the same weights hasten loads for `name`."""
    from ..models import ALIASES

    key = ALIASES.get(name.lower())
    if key == "smollm2-135m":
        from ..models.smollm2 import converted_dir

        return str(converted_dir())
    if key == "tiny":  # seeded random weights: saving a fresh copy gives hasten's exact model
        from transformers.utils import logging as hf_logging

        from ..models.tiny import tiny_model, tiny_tokenizer

        hf_logging.disable_progress_bar()

        tokenizer = tiny_tokenizer()
        tiny_model(len(tokenizer)).save_pretrained(workdir / "tiny")
        tokenizer.save_pretrained(workdir / "tiny")
        return str(workdir / "tiny")
    return name


def trl_spec(cfg, rows: list[dict], rewards, model_dir: str, gradient_checkpointing: bool, steps: int,
             bf16: bool = False) -> dict:
    from .peers import reward_spec, trl_settings

    return {"model_dir": model_dir, "rows": rows, "rewards": reward_spec(rewards),
            "config": trl_settings(cfg, gradient_checkpointing, steps, bf16)}


def hasten_settings(cfg) -> dict[str, Any]:
    from ..config import to_dict

    settings = to_dict(cfg)
    return {section: settings[section] for section in ("model", "task", "generation", "algo", "train", "speed")}


def b1_flops(size: ModelSize, prompt_tokens: float, completion_tokens: float, lora: bool = False) -> float:
    return generation_flops(size, prompt_tokens, completion_tokens) + learning_flops(size, prompt_tokens,
                                                                                    completion_tokens, lora)


def run_precisions(cfg, hidden_size: int, device: str = "cpu", parameters: int | None = None) -> tuple[str, str]:
    """(sampling, learning) precisions a run of `cfg` on a model `hidden_size` wide (of `parameters`, tied ones
    once) resolves to on `device`: the engine factory's and the learner's `auto` rules, for a cell whose model
    lives in another process."""
    import torch

    from ..kernels.precision import resolve_precision
    from ..rollout.factory import sampling_precision

    where = torch.device(device)
    return (sampling_precision(cfg, where, hidden_size, parameters)[0],
            resolve_precision(cfg.train.precision, where, hidden_size)[0])


def step_work(size: ModelSize, shape: cost.Shape, prompt_tokens: float, completion_tokens: float, steps: float,
              shortest_prompt: float, precisions: tuple[str, str], lora: bool = False) -> dict[str, Work]:
    """One GRPO step's work by phase (report.py's floor): generation (prefill + decode: FLOPs, and the
    weights read once per decode step plus each token's KV read) and the learning pass (FLOPs, weights,
    optimizer). precisions: (generation, learning)."""
    generate, learn = precisions
    # bf16_fp32head: the body's matmuls at the bf16 peak, the head's (a logit per completion token) at fp32's
    fp32_head = learn == "bf16_fp32head"  # kernels.precision.FP32_HEAD_MODES (not imported: it imports torch)
    body_precision = "bf16" if fp32_head else learn
    head_flops = cost.learning_multiplier(lora) * 2.0 * shape.head * completion_tokens if fp32_head else 0.0
    return {"generate": Work(generation_flops(size, prompt_tokens, completion_tokens),
                             cost.decode_floor_bytes(shape, int(steps), completion_tokens, shortest_prompt, generate),
                             generate),
            "learn": Work(learning_flops(size, prompt_tokens, completion_tokens, lora),
                          cost.learning_bytes(shape, lora, body_precision), body_precision, head_flops)}


def contention_slowdowns(result: Result, levels: list[int]) -> dict[str, float]:
    """Each side's busy / idle step seconds, median over rounds: {"hasten +1 busy / hasten": 1.4, ...}."""
    from .contention import label
    from .report import pair_ratio

    rows = {row.name: row for row in result.rows}
    idle, slowdowns = levels[0], {}
    for level in levels[1:]:
        for name, row in rows.items():
            base_name = name.removesuffix(label(level))
            if name.endswith(label(level)) and (base_name + label(idle)) in rows:
                ratio = pair_ratio(row, rows[base_name + label(idle)])
                if ratio is not None:
                    slowdowns[f"{name} / {base_name}{label(idle)}"] = ratio
    return slowdowns


# ------------------------------------------------------------------ B3: learning pass


def learning_pass(side: HastenSide, rollout, advantages, packed: bool) -> None:
    """Learner.step without the optimizer: log-probs, loss and backward over the accumulation chunks."""
    from ..algo import LOSSES, LossInputs, LossSettings
    from ..train.logprobs import completion_logprobs
    from ..kernels.fast_linear import onednn_linears, resolve
    from ..train.microbatch import micro_batches, resolve_budget
    from ..train.packing import packed_logprobs

    cfg = side.cfg
    model = side.session.policy.model if packed else side.hf_policy().model  # the peer is transformers' pass
    temperature, mask = cfg.generation.temperature, rollout.completion_mask
    settings = LossSettings(cfg.algo.epsilon, cfg.algo.epsilon_high, cfg.algo.beta)
    budget = resolve_budget(cfg.speed.token_budget, model.config, cfg.speed.gradient_checkpointing,
                            device=str(next(model.parameters()).device), lora=cfg.model.lora,
                            logit_chunk=cfg.speed.logit_chunk_tokens) if packed else 0
    chunks = micro_batches(rollout, cfg.train.gradient_accumulation_steps, budget, packed)
    for rows in chunks:
        if packed:  # hasten's learning pass, with its speed flags as configured
            with onednn_linears(model, resolve(cfg.speed.fast_linear)):
                stats = packed_logprobs(model, rollout, rows, temperature, True, cfg.speed.logit_chunk_tokens,
                                        cfg.speed.grouped_attention, cfg.speed.shared_prefix)
        else:
            group = rows // rollout.num_generations  # prompt of each sample
            stats = completion_logprobs(model, rollout.prompt_ids[group], rollout.prompt_mask[group],
                                        rollout.completion_ids[rows], mask[rows], temperature, with_entropy=True)
        inputs = LossInputs(
            logps=stats.logps, old_logps=stats.logps.detach(), ref_logps=None, advantages=advantages[rows],
            completion_mask=mask[rows], total_tokens=float(mask.sum()), total_sequences=rollout.num_samples,
            max_completion_length=cfg.generation.max_new_tokens, num_chunks=len(chunks),
        )
        loss, _ = LOSSES[cfg.algo.loss](inputs, settings)
        loss.backward()


def run_b3(side: HastenSide, opts: BenchOptions) -> Result:
    from ..algo import group_advantages
    from ..rewards import score_rewards
    from ..rewards.batch import reward_inputs

    cfg, session, rounds = side.cfg, side.session, opts.rounds("B3")
    rows, prompts = side.prompts(cfg.train.prompts_per_step)
    rollout = session.engine.generate(prompts, cfg.generation.num_generations, side.sampling(), seed=cfg.train.seed)
    inputs = reward_inputs(session.policy.tokenizer, rows, rollout)
    scores = score_rewards(session.rewards, inputs.prompts, inputs.completions, inputs.columns, inputs.completion_ids)
    advantages = group_advantages(scores.total, cfg.generation.num_generations, cfg.algo.scale_rewards)  # (B*G,)
    completion_tokens = float(rollout.completion_mask.sum())
    prompt_tokens = float(rollout.prompt_mask.sum())
    result = Result("B3", f"learning pass (log-probs + loss + backward, no optimizer step) on one B1 rollout: "
                          f"{rollout.num_samples} samples, {completion_tokens:.0f} completion tokens")
    result.settings["workload"] = {"samples": rollout.num_samples, "completion_tokens": completion_tokens,
                                   "prompt_tokens_per_prompt": rollout.prompt_mask.sum(1).tolist(),
                                   "completion_width": rollout.completion_ids.shape[1], "loss": cfg.algo.loss,
                                   "gradient_accumulation_steps": cfg.train.gradient_accumulation_steps}
    variants = {"packed": ("hasten", True), "padded": ("peer", False)}  # speed.packed_learning true / false
    result.settings["packed"] = {"speed.packed_learning": True,
                                 "speed.logit_chunk_tokens": cfg.speed.logit_chunk_tokens,
                                 "speed.fast_linear": cfg.speed.fast_linear,
                                 "speed.grouped_attention": cfg.speed.grouped_attention,
                                 "path": "hasten/train/packing.py (one row per group, prompt once)"}
    result.settings["padded"] = {"speed.packed_learning": False,
                                 "speed.fast_linear": False, "model": "transformers' LlamaForCausalLM",
                                 "path": "hasten/train/logprobs.py (plain padded forward, prompt once per sample)"}

    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(-1, rounds):  # round -1 is the warm-up
        for index, (name, (_, packed)) in enumerate(variants.items()):
            opts.log(f"B3: {'warm-up' if round_index < 0 else f'round {round_index + 1}/{rounds}'} {name}")
            opts.progress((round_index + 1) * len(variants) + index, (rounds + 1) * len(variants))
            started = time.perf_counter()
            learning_pass(side, rollout, advantages, packed)
            elapsed = time.perf_counter() - started
            for model in {id(m): m for m in (session.policy.model, side.hf_policy().model)}.values():
                model.zero_grad(set_to_none=True)  # as the learner does after each optimizer step, untimed
            if round_index >= 0:
                seconds[name].append(elapsed)
    opts.progress((rounds + 1) * len(variants), (rounds + 1) * len(variants))
    flops = learning_flops(side.size, prompt_tokens, completion_tokens, cfg.model.lora)
    precision = "fp32"  # both passes run without autocast (learning_pass): B3 compares the passes, not precisions
    moved = cost.learning_bytes(side.shape, cfg.model.lora, precision, optimizer=False)  # no optimizer step
    work = {"learn": Work(flops, moved, precision)}
    for name, (role, _) in variants.items():
        result.rows.append(Row(name, role, "tok/s", seconds[name], work=[completion_tokens] * rounds,
                               flops=[flops] * rounds, phases=[work] * rounds, precision=precision))
    result.notes.append("trained tokens = completion tokens (the ones with a loss); one warm-up pass each, untimed")
    return result
