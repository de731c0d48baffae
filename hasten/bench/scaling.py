"""B8, the scaling grid: how a GRPO step's cost grows with completion length and model size.

Grid: completion length {64, 256, 1024} x model {smollm2-135m, and the shapes
of Qwen2.5-0.5B and Qwen2.5-1.5B with random weights built here from their
published configs: for speed only, never for quality}. Both sides generate a
fixed number of new tokens (EOS cannot end a row: hasten's engine is built
with no EOS ids, TRL's generate gets min_new_tokens), on B1's prompts,
rewards and hyperparameters.

Why each side runs in its own process, one after the other (not alternated
as B1 is): the peak resident memory of a side is a result here, and two
1.5B-parameter trainers side by side would measure each other. Each process
reports its own peak RSS (getrusage of itself) after every step.

Activation checkpointing is chosen per cell and side: on only where the
estimate without it exceeds the budget and with it does not (mode "full+gc").
Full fine-tune or LoRA is decided once per model, from cost.training_memory_bytes
at the shortest length asked for, against the memory budget (--b8-memory-gib,
default: what the machine has available at the start): both sides train the
same way, and the cell says which. A cell a side cannot run says why instead
of a number: its memory estimate over the budget, a step over the cap
(--b8-step-cap, default 600 s: the process is killed), or its error.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import cost
from .machine import model_config  # also the name tests and callers import from here
from .report import ModelSize, Result, Row

LENGTHS = (64, 256, 1024)
MODELS = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b")
# Published configs (config.json on the hub), the fields that decide the cost; weights are random.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen-tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=300, tie_word_embeddings=True),  # tests: the same path, tiny
}
QWEN_COMMON = dict(max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_sliding_window=False,
                   hidden_act="silu")
GIB = 1024**3


@dataclass
class B8Options:
    lengths: tuple[int, ...] = LENGTHS
    models: tuple[str, ...] = MODELS
    steps: int = 3  # per cell and side; the median is over steps 2..N (step 1 pays one-off allocation)
    step_cap: float = 600.0  # seconds: a step past it is killed and the cell says so
    memory_gib: float | None = None  # budget; None: MemAvailable at the start
    plot_dir: Path | None = None  # where b8-scaling.png goes (None: a temporary directory, named in the notes)


@dataclass
class Cell:
    model: str
    length: int
    side: str  # "hasten" | "trl"
    mode: str  # "full" | "lora"
    steps: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None  # why there is no number
    estimate_gib: float = 0.0

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "length": self.length, "side": self.side, "mode": self.mode,
                               "estimate_gib": round(self.estimate_gib, 2)}
        if self.skipped:
            return {**out, "skipped": self.skipped}
        measured = self.steps[1:] or self.steps
        seconds = statistics.median(step["seconds"] for step in measured)
        tokens = statistics.median(step["completion_tokens"] for step in measured)
        return {**out, "s_per_step": seconds, "generate_s": statistics.median(s["generate"] for s in measured),
                "learn_s": statistics.median(s["learn"] for s in measured), "tokens_per_s": tokens / seconds,
                "peak_rss_mib": max(step["peak_rss_mib"] for step in self.steps), "steps": len(self.steps),
                # hasten's adaptive threads per measured step: fewer than the cores means it saw a busy neighbour
                **({"threads": [step["threads"] for step in measured]} if "threads" in measured[0] else {})}


def available_gib() -> float:
    """MemAvailable from /proc/meminfo (Linux), else the total physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def model_dir(name: str, workdir: Path) -> str:
    """A directory (or registry name) both sides load: random-weight shapes are built once into the cache."""
    if name not in SHAPES:
        from .workloads import peer_model_dir

        return peer_model_dir(name, workdir)
    from ..models.smollm2 import cache_root

    target = cache_root() / "b8" / name
    if not (target / "config.json").is_file():
        # In a child process: this one runs every cell's side beside it, and a 1.5B model built here
        # would stay in its heap (~6 GiB) for the rest of the grid, pushing the sides out of memory.
        code = f"from hasten.bench.scaling import build_random; build_random({name!r})"
        built = subprocess.run([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
        if built.returncode != 0:
            tail = [line for line in built.stderr.splitlines() if line.strip()][-1:]
            raise RuntimeError(f"building the random {name} model failed: {' '.join(tail)}")
    return str(target)


def build_random(name: str) -> None:
    """The published shape `name` with random weights (speed only) into $HASTEN_CACHE/b8/name."""
    from ..models.smollm2 import cache_root

    target = cache_root() / "b8" / name
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = b8_tokenizer(name)
    config = Qwen2Config(**SHAPES[name], **QWEN_COMMON, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    building = target.with_name(name + ".part")
    Qwen2ForCausalLM(config).save_pretrained(building)  # random weights: speed only
    tokenizer.save_pretrained(building)
    building.rename(target)


def b8_tokenizer(name: str):
    """SmolLM2's tokenizer for the published shapes (prompts of realistic token counts), the tiny one in tests."""
    if name == "qwen-tiny":
        from ..models.tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    from ..models.smollm2 import converted_dir

    return AutoTokenizer.from_pretrained(str(converted_dir()))


def cell_config(opts, directory: str, length: int, lora: bool, steps: int):
    """configs/b1.yaml (quick: toy sizes) with the cell's model, completion length and training mode."""
    from ..config import load_config
    from .workloads import QUICK_OVERRIDES

    overrides = [(key, value) for key, value in QUICK_OVERRIDES if key != "model.name"] if opts.quick else []
    overrides += [("model.name", directory), ("generation.max_new_tokens", length), ("model.lora", lora),
                  ("train.steps", steps)]
    return load_config(opts.config, overrides)


def memory_estimate(shape: cost.Shape, cfg, side: str, prompt_tokens: int | None = None,
                    model_config=None) -> dict[str, float]:
    """cost.training_memory_bytes for one side's step of `cfg` (prompt_tokens: B1's ~48 unless given; B7's are
    longer). With the model's config, hasten's side counts its learning pass's micro-batches
    (speed.token_budget, resolved as the learner resolves it)."""
    from ..train.learner import token_budget
    from ..train.microbatch import COPY_BYTES, MOMENT_BYTES, effective_logit_chunk
    from .workloads import run_precisions

    samples = cfg.train.prompts_per_step * cfg.generation.num_generations
    prompt_tokens = PROMPT_TOKENS if prompt_tokens is None else prompt_tokens
    budget = token_budget(cfg, False, model_config) if side == "hasten" and model_config is not None else 0
    sampling = run_precisions(cfg, shape.hidden, parameters=shape.parameters(tied=True))[0] if side == "hasten" else "fp32"
    return cost.training_memory_bytes(
        shape, samples, cfg.generation.num_generations, prompt_tokens, cfg.generation.max_new_tokens, cfg.model.lora,
        prompt_per_sample=side == "trl",
        logits_chunk=effective_logit_chunk(cfg.speed.logit_chunk_tokens, shape.vocab) if side == "hasten" else 0,
        checkpointing=cfg.speed.gradient_checkpointing,
        copy_bytes=COPY_BYTES[sampling] if side == "hasten" and engine_copy(shape, cfg, sampling) else 0,
        moment_bytes=MOMENT_BYTES[cfg.train.optimizer_moments] if side == "hasten" else MOMENT_BYTES["fp32"],
        token_budget=budget)


def engine_copy(shape: cost.Shape, cfg, sampling: str) -> bool:
    """Whether hasten's lean engine keeps its own copy of the weights: speed.engine_weights resolved by the
    engine's rule (rollout/shared_weights.py) on this machine for the resolved `sampling` precision; shared
    reads the training weights."""
    from ..device import machine_bytes
    from ..rollout.shared_weights import resolve

    choice, _ = resolve(cfg.speed.engine_weights, shape.parameters(tied=True), sampling, machine_bytes())
    return choice == "copy"


def with_checkpointing(cfg):
    """The cell's config with activation checkpointing on (speed.gradient_checkpointing; TRL's own switch)."""
    import dataclasses

    return dataclasses.replace(cfg, speed=dataclasses.replace(cfg.speed, gradient_checkpointing=True))


PROMPT_TOKENS = 48  # B1's chat prompts are ~40-50 tokens (SmolLM2's tokenizer): the estimate's prompt length


HASTEN_MARGIN = 0.9  # hasten's estimate must fit in this share of the budget: at 0.5B x 256 it fell short by
# over 1.7 GiB (allocator slack, the embedding's dense gradient, gathers' copies) and the OOM killer ended the cell


def fits(estimate_gib: float, budget_gib: float, side: str) -> bool:
    return estimate_gib <= budget_gib * (HASTEN_MARGIN if side == "hasten" else 1.0)


def choose_mode(shape: cost.Shape, cfg, budget_gib: float, model_config=None) -> tuple[bool, str]:
    """LoRA where the full fine-tune's estimate at this length exceeds the budget on hasten's side."""
    full = memory_estimate(shape, cfg, "hasten", model_config=model_config)["total"] / GIB
    if fits(full, budget_gib, "hasten"):
        return False, f"full fine-tune (estimate {full:.1f} GiB <= budget {budget_gib:.1f})"
    return True, f"LoRA r={cfg.model.lora_r} (full fine-tune estimate {full:.1f} GiB > budget {budget_gib:.1f})"


def _integers(text: str, option: str, error: type[Exception]) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise error(f"bench error: {option} must be a comma list of integers (got '{text}')") from None
    if not values or any(value < 1 for value in values):
        raise error(f"bench error: {option} needs integers >= 1 (got '{text}')")
    return values


def parse_options(args, error: type[Exception]) -> B8Options:
    """The --b8-* arguments of `hasten bench`; a bad one raises `error` (BenchError) with a one-line message."""
    lengths = _integers(args.b8_lengths or ("4,8" if args.quick else "64,256,1024"), "--b8-lengths", error)
    known = (*MODELS, *SHAPES, "tiny")
    models = tuple(dict.fromkeys(name.strip().lower() for name in
                                 (args.b8_models or ("tiny,qwen-tiny" if args.quick else ",".join(MODELS))).split(",")
                                 if name.strip()))
    unknown = [name for name in models if name not in known]
    if unknown or not models:
        raise error(f"bench error: --b8-models: unknown model {', '.join(unknown) or '(none)'} "
                         f"(available: {', '.join(dict.fromkeys(known))})")
    if args.b8_steps < 1 or args.b8_step_cap <= 0 or (args.b8_memory_gib is not None and args.b8_memory_gib <= 0):
        raise error(f"bench error: --b8-steps must be >= 1, --b8-step-cap and --b8-memory-gib > 0 "
                         f"(got {args.b8_steps}, {args.b8_step_cap:g}, {args.b8_memory_gib})")
    return B8Options(lengths=tuple(sorted(set(lengths))), models=models, steps=args.b8_steps,
                     step_cap=args.b8_step_cap, memory_gib=args.b8_memory_gib)


# ------------------------------------------------------------------ the grid


def rates_in_child(directory: str, quick: bool) -> dict[str, Any]:
    """machine.matmul_at_shapes for the model in `directory`, in a fresh process on this bench's allocator: here
    mimalloc would keep what the probe freed (2.3 GB at 0.5B), and each cell's budget, the memory available
    when it starts, would read that much short (TRL's side of 0.5B x 64 fell to checkpointing that way)."""
    from ..kernels.allocator import loaded
    from .peers import peer_env

    done = subprocess.run([sys.executable, "-m", "hasten.bench.machine", "rates"], input=json.dumps(
        {"directory": directory, "quick": quick}) + "\n", capture_output=True, text=True, env=peer_env(loaded()))
    if done.returncode != 0:
        tail = [line for line in done.stderr.splitlines() if line.strip()][-2:]
        raise RuntimeError(f"B8's matmul probe exited with code {done.returncode}: {' | '.join(tail)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_b8(opts) -> Result:
    """Every (model, length) cell, hasten's process then TRL's; a row per side and cell that ran."""
    b8: B8Options = opts.b8 or B8Options()
    budget = b8.memory_gib if b8.memory_gib is not None else available_gib()
    result = Result("B8", f"scaling grid: completion length {list(b8.lengths)} x model {list(b8.models)}, "
                          "fixed new tokens (EOS ignored on both sides), each side in its own process")
    cells: list[Cell] = []
    rates: dict[str, Any] = {}
    capped: dict[str, list[tuple[int, int, str]]] = {"hasten": [], "trl": []}  # (parameters, length, model)
    with tempfile.TemporaryDirectory(prefix="hasten-bench-b8-") as workdir:
        for model in b8.models:
            opts.log(f"B8: {model}: model directory")
            directory = model_dir(model, Path(workdir))
            config = model_config(directory)
            shape = cost.Shape.from_config(config)
            lora, why = choose_mode(shape, cell_config(opts, directory, min(b8.lengths), False, b8.steps), budget,
                                    config)
            result.settings[model] = {"directory": directory, "mode": why, "parameters": shape.parameters(),
                                      "random_weights": model in SHAPES, "shape": vars(shape)}
            rates[model] = rates_in_child(directory, opts.quick)
            for length in b8.lengths:
                cfg = cell_config(opts, directory, length, lora, b8.steps)
                for side in ["hasten"] + (["trl"] if "trl" in opts.peers else []):
                    opts.log(f"B8: {model} length {length} {side} ({'LoRA' if lora else 'full'})")
                    cell = (past_the_cap(capped[side], model, shape.parameters(), length, side, lora)
                            or extrapolated_past_the_cap(cells, model, length, side, lora, b8.step_cap))
                    # the budget as of now when none is given: what this process and the page cache hold
                    # since the start is not the cell's to use
                    now = b8.memory_gib if b8.memory_gib is not None else min(budget, available_gib())
                    cell = cell or run_cell(opts, b8, cfg, shape, model, length, side, now, config)
                    if cell.skipped and cell.skipped.endswith("cap (killed)"):
                        capped[side].append((shape.parameters(), length, model))
                    cells.append(cell)
                    result.rows.extend(cell_rows(cell, cfg, shape, opts))
    result.settings["grid"] = [cell.summary() for cell in cells]
    result.settings["matmul_gflops_at_model_shapes"] = rates  # folded into the header's best rates
    result.settings["memory_budget_gib"] = round(budget, 1)
    result.settings["step_cap_s"] = b8.step_cap
    for cell in cells:
        if cell.skipped:
            result.notes.append(f"{cell.model} length {cell.length} {cell.side}: no number: {cell.skipped}")
    if "trl" not in opts.peers:
        result.notes.append("trl not measured: not among --peers, or the `trl` package does not import here "
                            "(pip install 'hasten[bench]')")
    steps = f"steps 2..{b8.steps}" if b8.steps > 1 else "step 1 (it pays one-off allocation: ask for --b8-steps 3)"
    result.notes.append(f"median over {steps} of each process (step 1 pays one-off allocation); "
                        "sides run one after the other, not alternated: each one's peak RSS is its own; "
                        "TRL's generate = its model.generate() calls, its learn = the rest of the step")
    plot_dir = b8.plot_dir or Path(tempfile.mkdtemp(prefix="hasten-bench-b8-plot-"))
    result.settings["plot"] = str(plot_grid(result.settings["grid"], plot_dir / "b8-scaling.png"))
    return result


def past_the_cap(capped: list[tuple[int, int, str]], model: str, parameters: int, length: int, side: str,
                 lora: bool) -> Cell | None:
    """A cell not started because a cell with no more parameters and no longer completions already ran
    past the step cap on this side: a step's work grows with both, so it would only burn the cap again."""
    for done_parameters, done_length, done_model in capped:
        if done_parameters <= parameters and done_length <= length:
            return Cell(model, length, side, "lora" if lora else "full",
                        skipped=f"not started: {done_model} length {done_length} already ran past the step cap")
    return None


EXTRAPOLATION_MARGIN = 1.25  # the bound must clear the cap by this much: two timed steps carry noise


def extrapolated_past_the_cap(cells: list[Cell], model: str, length: int, side: str, lora: bool,
                              cap: float) -> Cell | None:
    """A cell not started because its step is bound to run past the cap, from this side's two longest
    measured lengths of the same model. A step's time is convex in the completion length (a fixed part,
    a part per token, attention's part per token pair), and a convex function lies above the line
    through two of its points beyond them: that line at `length` is a lower bound on the step."""
    measured = sorted((cell.length, cell.summary()["s_per_step"]) for cell in cells
                      if cell.model == model and cell.side == side and not cell.skipped and cell.length < length)
    if len(measured) < 2:
        return None
    (short, short_s), (longer, longer_s) = measured[-2], measured[-1]
    bound = longer_s + (longer_s - short_s) * (length - longer) / (longer - short)
    if bound <= EXTRAPOLATION_MARGIN * cap:
        return None
    return Cell(model, length, side, "lora" if lora else "full",
                skipped=f"not started: at least {bound:.0f} s a step, past the {cap:g} s cap (the line through "
                        f"lengths {short} and {longer}, {short_s:.0f} and {longer_s:.0f} s, extended: step "
                        f"time is convex in length)")


def run_cell(opts, b8: B8Options, cfg, shape: cost.Shape, model: str, length: int, side: str,
             budget: float, config=None) -> Cell:
    """One side of one cell: its memory estimate first, then its process. Activation checkpointing is
    chosen per cell and side, where it pays: only when the estimate without it exceeds the budget and
    the estimate with it does not (it costs ~a third more compute). Over the budget either way: no run."""
    estimate = memory_estimate(shape, cfg, side, model_config=config)["total"] / GIB
    lean = memory_estimate(shape, with_checkpointing(cfg), side, model_config=config)["total"] / GIB
    if not fits(estimate, budget, side) and not cfg.speed.gradient_checkpointing:
        cfg, estimate = (with_checkpointing(cfg), lean) if fits(lean, budget, side) else (cfg, estimate)
    mode = ("lora" if cfg.model.lora else "full") + ("+gc" if cfg.speed.gradient_checkpointing else "")
    cell = Cell(model, length, side, mode, estimate_gib=estimate)
    if not fits(estimate, budget, side):
        usable = budget * (HASTEN_MARGIN if side == "hasten" else 1.0)
        cell.skipped = (f"out of memory by estimate: {estimate:.1f} GiB > {usable:.1f} GiB of the budget "
                        f"{budget:.1f} GiB ({lean:.1f} GiB with activation checkpointing)")
        return cell
    try:
        if side == "hasten":
            overrides = [list(pair) for pair in cell_overrides(cfg)]
            cell.steps = run_hasten_cell({"config": str(opts.config), "overrides": overrides}, b8.step_cap)
        else:
            cell.steps = run_trl_cell(trl_cell_spec(cfg, length), b8.steps, b8.step_cap)
    except RuntimeError as error:
        cell.skipped = str(error)
    if not cell.skipped and not cell.steps:
        cell.skipped = "no step finished"
    return cell


def cell_overrides(cfg) -> list[tuple[str, Any]]:
    return [("model.name", cfg.model.name), ("generation.max_new_tokens", cfg.generation.max_new_tokens),
            ("model.lora", cfg.model.lora), ("train.steps", cfg.train.steps),
            ("speed.gradient_checkpointing", cfg.speed.gradient_checkpointing),
            ("train.prompts_per_step", cfg.train.prompts_per_step),
            ("generation.num_generations", cfg.generation.num_generations)]


def trl_cell_spec(cfg, length: int) -> dict[str, Any]:
    """B1's TRL spec on the cell's model (gc off, its CPU best, unless the cell needs it), min_new_tokens =
    length, LoRA as hasten's."""
    from ..tasks import make_task
    from ..tasks.sampler import PromptSampler
    from ..train.trainer import build_rewards
    from .workloads import trl_spec

    task = make_task(cfg.task)
    rows = PromptSampler(task.train_rows, cfg.train.seed).next(cfg.train.prompts_per_step * cfg.train.steps)
    directory = cfg.model.name
    if directory.lower() == "tiny":
        directory = model_dir("tiny", Path(tempfile.mkdtemp(prefix="hasten-bench-b8-tiny-")))
    spec = trl_spec(cfg, rows, build_rewards(cfg, task), directory, cfg.speed.gradient_checkpointing, cfg.train.steps)
    spec["config"]["generation_kwargs"] = {"min_new_tokens": length}  # EOS cannot end a row
    if cfg.model.lora:
        spec["lora"] = {"r": cfg.model.lora_r, "lora_alpha": cfg.model.lora_alpha,
                        "lora_dropout": cfg.model.lora_dropout, "target_modules": list(cfg.model.lora_target_modules)}
    return spec


def cell_rows(cell: Cell, cfg, shape: cost.Shape, opts) -> list[Row]:
    """The cell as a report row (s/step, its phases' work for the limit column); none when skipped."""
    from .workloads import step_work

    if cell.skipped:
        return []
    measured = cell.steps[1:] or cell.steps
    summary = cell.summary()
    size = ModelSize(shape.body, shape.head)
    name = f"{cell.side} {cell.model} L={cell.length}" + (" lora" if cell.mode.startswith("lora") else "")
    hasten = cell.side == "hasten"
    from .workloads import run_precisions

    precisions = run_precisions(cfg, shape.hidden, parameters=shape.parameters(tied=True)) if hasten else ("fp32", "fp32")
    # The floor counts the completions' work alone (no prompt tokens, no KV read of the prompt): a lower bound
    phases = [step_work(size, shape, 0.0, step["completion_tokens"], cell.length, 0.0, precisions, cfg.model.lora)
              for step in measured]
    return [Row(name, "hasten" if cell.side == "hasten" else "peer", "s/step", [s["seconds"] for s in measured],
                phases=phases, baseline=None if cell.side == "hasten" else name.replace("trl ", "hasten ", 1),
                extra={"generate": summary["generate_s"], "learn": summary["learn_s"],  # medians: the phase limits
                       "tokens_per_s": summary["tokens_per_s"], "peak_rss_mib": summary["peak_rss_mib"],
                       "mode": cell.mode})]


def plot_grid(grid: list[dict[str, Any]], target: Path) -> Path:
    """s/step against completion length, one panel per model, a line per side (skipped cells left out)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    models = list(dict.fromkeys(cell["model"] for cell in grid))
    figure = Figure(figsize=(4.5 * max(len(models), 1), 4), layout="constrained")
    FigureCanvasAgg(figure)
    for index, model in enumerate(models):
        axes = figure.add_subplot(1, max(len(models), 1), index + 1)
        for side, color in (("hasten", "tab:blue"), ("trl", "tab:orange")):
            points = [(c["length"], c["s_per_step"]) for c in grid if c["model"] == model and c["side"] == side
                      and "s_per_step" in c]
            if points:
                axes.plot(*zip(*points), marker="o", color=color, label=side)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
        mode = next((c["mode"] for c in grid if c["model"] == model), "")
        axes.set_xscale("log", base=2)
        lengths = sorted({c["length"] for c in grid if c["model"] == model})
        axes.set_xticks(lengths, [str(length) for length in lengths])
        axes.set_title(f"{model} ({mode})")
        axes.set_xlabel("completion length (new tokens)")
        axes.set_ylabel("s/step")
        axes.grid(alpha=0.3)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, format="png", dpi=100)
    return target


# ------------------------------------------------------------------ running a side


class Watchdog:
    """Kills `process` when a step takes longer than `cap` seconds; `fired` says it did."""

    def __init__(self, process: subprocess.Popen, cap: float):
        self.process, self.cap, self.fired, self.timer = process, cap, False, None

    def arm(self) -> None:
        self.disarm()
        self.timer = threading.Timer(self.cap, self._kill)
        self.timer.daemon = True
        self.timer.start()

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def _kill(self) -> None:
        self.fired = True
        self.process.kill()


def run_hasten_cell(spec: dict[str, Any], cap: float) -> list[dict[str, Any]]:
    """hasten's side in a fresh process (this module's worker); its step records, or RuntimeError(why)."""
    from ..kernels.allocator import loaded
    from .peers import PREFIX, peer_env

    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen([sys.executable, "-m", "hasten.bench.scaling", "hasten"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=errors, text=True, env=peer_env(loaded()))  # the allocator this bench runs on
        watchdog, steps = Watchdog(process, cap), []
        process.stdin.write(json.dumps(spec) + "\n")
        process.stdin.close()
        watchdog.arm()  # building counts against the cap too: a cell that cannot start in it says so
        try:
            for line in process.stdout:
                if line.startswith(PREFIX):
                    steps.append(json.loads(line[len(PREFIX):]))
                    watchdog.arm()
        finally:
            watchdog.disarm()
            process.wait()
        if watchdog.fired:
            raise RuntimeError(f"a step ran past the {cap:g} s cap (killed)")
        if process.returncode != 0:
            errors.seek(0)
            tail = [line for line in errors.read().splitlines() if line.strip()][-2:]
            raise RuntimeError(f"exited with code {process.returncode}: {' | '.join(tail)}")
    return steps


def run_trl_cell(spec: dict[str, Any], steps: int, cap: float) -> list[dict[str, Any]]:
    """TRL's side in a fresh gated process (peers.TrlProcess), one step per `go`, under the same cap."""
    from .peers import PeerError, TrlProcess

    worker = TrlProcess("trl", spec)
    watchdog, records = Watchdog(worker.process, cap), []
    try:
        for _ in range(steps):
            watchdog.arm()
            try:
                message = worker.step()
            except PeerError as error:
                raise RuntimeError(f"a step ran past the {cap:g} s cap (killed)" if watchdog.fired
                                   else str(error)) from None
            finally:
                watchdog.disarm()
            records.append({"seconds": message["seconds"], "generate": message.get("generate", float("nan")),
                            "learn": message.get("learn", float("nan")),
                            "completion_tokens": message["completion_tokens"],
                            "num_samples": message["num_samples"], "peak_rss_mib": message["peak_rss_mib"]})
    finally:
        worker.close()
    return records


class WithoutEos:
    """The policy as the engine factory sees it, with no EOS ids: nothing ends a row early (the pad id kept)."""

    def __init__(self, policy):
        self.policy, self.pad_token_id = policy, policy.pad_token_id

    @property
    def eos_token_ids(self) -> list[int]:
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.policy, name)


def hasten_worker(spec: dict[str, Any]) -> None:
    """The child: B1's step on the cell's config, EOS unable to end a row; a JSON line per step."""
    from ..config import load_config
    from ..rollout.factory import make_engine
    from ..train.feeder import make_feeder
    from ..train.learner import Learner
    from ..train.trainer import grpo_step, prepare
    from .machine import peak_rss_mib
    from .peers import emit

    cfg = load_config(spec["config"], [tuple(pair) for pair in spec["overrides"]])
    session = prepare(cfg, log=lambda text: None)
    # prepare's engine goes before this one is built: the lean engine holds a copy of the weights, and two
    # of them would add a model's size to this side's peak RSS (the freed one's memory is reused)
    session.engine = None
    gc.collect()
    session.engine = make_engine(cfg, WithoutEos(session.policy), log=lambda text: None)  # fixed new tokens
    learner = Learner.from_config(session.policy, cfg, None)
    feeder = make_feeder(cfg, session.task.train_rows, session.policy.tokenizer)
    try:
        for step in range(1, cfg.train.steps + 1):
            record = grpo_step(session, learner, feeder, step)
            samples = cfg.train.prompts_per_step * cfg.generation.num_generations
            emit({"seconds": record["time/step"], "generate": record["time/generate"], "learn": record["time/learn"],
                   "completion_tokens": record["completion_length"] * samples, "num_samples": samples,
                   "peak_rss_mib": peak_rss_mib(),  # the intra-op threads each phase ran with (adaptive threads)
                   "threads": {key: record[key] for key in ("threads/generate", "threads/learn") if key in record}})
    finally:
        feeder.close()


if __name__ == "__main__":
    if sys.argv[1:] != ["hasten"]:
        sys.exit("usage: python -m hasten.bench.scaling hasten   (started by `hasten bench --workloads B8`)")
    hasten_worker(json.loads(sys.stdin.readline()))
