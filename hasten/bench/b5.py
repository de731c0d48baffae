"""B5 of docs/benchmarks.md: time to accuracy, hasten against TRL's GRPOTrainer.

    hasten bench --workloads B5 [--b5-config configs/demo.yaml] [--seeds 0,1,2] [--profiles balanced,...]
                 [--b5-minutes 15] [--b5-mark-minutes 1] [--b5-dir DIR] [--peers trl|none]

The demo task (configs/demo.yaml: two-digit addition with a worked example)
is trained by hasten and by TRL with the same rows in the same order, the
same reward functions and the same lr, warmup (hasten with
train.warmup_from_zero=true: from lr 0, as transformers), schedule, loss, group size,
completion length and temperature (peers.trl_settings; TRL in fp32 with
gradient checkpointing off, its CPU best). Each run is its own process
(`python -m hasten.bench.b5 hasten|trl`, spec on stdin): it pays its own
imports, keeps its own allocator and threads, and a profile's process-wide
settings do not leak. A run stops at --b5-minutes of training time or at
train.steps, whichever comes first.

Time is training time: a clock that starts when the first step starts and
stops while a checkpoint is being written (model loading and saving are not
counted, on either side). After the first step that ends past each mark
(every --b5-mark-minutes of training time; 0 = after every step) and after
the last step, the run saves the model and notes (step, training seconds).
When a run is done the parent scores its checkpoints with hasten's held-out
evaluator (train/evaluate.py's `evaluate`, what `hasten eval` and training's
evals run: greedy, the task's first eval.num_examples held-out questions) on
one session of the base model, each checkpoint's weights loaded into it in
place, so tokenizer, prompts and engine are the same for every score. The
base model (step 0) is scored once and shared by every curve. Scoring is not
timed. Weight files are deleted once scored (--b5-keep-checkpoints keeps them).
Before anything trains, check_disk refuses (exit 2) a --b5-dir whose free
space cannot hold the checkpoints held at once: a full disk mid-run kills a
worker and loses its run.

Reported per run (side, seed, profile): the curve (training minutes, step,
accuracy), minutes to +20 points over the base accuracy (the first
checkpoint at or above it; inf = not reached within the budget), final
accuracy and median seconds per step; the peer's ratio is the median over
seeds of TRL minutes / hasten minutes. A PNG of every curve and curves.json
go to --b5-dir (default: a new temporary directory, printed).

B7 (b7.py) runs this same procedure (run_time_to_accuracy, given a Workload)
on a tool task: the workers then also keep each step's tool-call rate and
write down the tool setup their run used (agentic.py).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .report import Result, Row

DEMO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
TARGET_GAIN = 0.20  # +20 points of held-out accuracy over the base model
TOOL_METRICS = ("tools/call_frequency", "tools/failure_frequency")  # B7: kept per step on both sides
# where the sampler is not the learner (int8/bf16 sampling, vLLM, async): the mismatch, kept per step (hasten)
SAMPLER_METRICS = ("logp_abs_diff", "kl", "ratio_mean", "ratio_max", "truncated_fraction")
# --quick: the tiny model, 2 steps of 2 prompts x 4 generations x 8 tokens, 8 held-out questions.
QUICK_OVERRIDES = [("model.name", "tiny"), ("train.prompts_per_step", 2), ("generation.num_generations", 4),
                   ("generation.max_new_tokens", 8), ("train.steps", 2), ("train.warmup_steps", 1),
                   ("eval.num_examples", 8), ("eval.max_new_tokens", 8)]


@dataclass
class B5Options:
    config: Path = DEMO_CONFIG
    seeds: list[int] = field(default_factory=lambda: [0])
    profiles: list[str] = field(default_factory=list)  # each one more hasten run per seed
    minutes: float = 15.0  # training-time budget per run
    mark_minutes: float = 1.0  # a checkpoint after the first step past each mark; 0 = every step
    directory: Path | None = None  # None: a new temporary directory
    keep_checkpoints: bool = False
    variants: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)  # --b5-variant: label, keys
    config_run: bool = True  # a hasten run of the config as it is (--b5-only-profiles: False)
    model: str | None = None  # B7: --b7-model (B5 trains --model)


@dataclass
class RunPlan:
    label: str  # "hasten", "hasten balanced", "trl gc=off"
    side: str  # "hasten" | "peer"
    seed: int
    profile: str | None
    directory: Path
    overrides: list[tuple[str, str]] = field(default_factory=list)  # --b5-variant's config keys


# ------------------------------------------------------------------ the clock both sides train under


class TrainingClock:
    """Training seconds since the first step began, checkpoint saving excluded; saves at the marks."""

    def __init__(self, minutes: float, mark_minutes: float, directory: Path):
        self.budget, self.mark = 60.0 * minutes, 60.0 * mark_minutes
        self.directory = directory
        self.started = time.perf_counter()
        self.paused = 0.0  # seconds spent saving
        self.next_mark = self.mark
        self.steps: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []

    def seconds(self) -> float:
        return time.perf_counter() - self.started - self.paused

    def after_step(self, step: int, record: dict[str, Any], save: Callable[[Path], None], last: bool) -> bool:
        """Log the step, save when a mark has passed (or at the end); True when the run must stop."""
        now = self.seconds()
        self.steps.append({"step": step, "train_seconds": now, **record})
        stop = last or now >= self.budget
        if now >= self.next_mark or stop:
            began = time.perf_counter()
            target = self.directory / f"step-{step}"
            save(target)
            spent = time.perf_counter() - began
            self.paused += spent
            self.checkpoints.append({"step": step, "train_seconds": now, "save_seconds": spent, "path": str(target)})
            self.next_mark = (math.floor(now / self.mark) + 1) * self.mark if self.mark > 0 else 0.0
        return stop

    def write(self, **extra: Any) -> None:
        (self.directory / "run.json").write_text(json.dumps(
            {"steps": self.steps, "checkpoints": self.checkpoints, **extra}, default=str))


# ------------------------------------------------------------------ the two workers (fresh processes)


def hasten_worker(spec: dict[str, Any]) -> None:
    """GRPOJob.step (the step `hasten train` runs) until the budget or train.steps, saving at the marks."""
    from ..compare import typed
    from ..config import load_config
    from ..train.trainer import GRPOJob, prepare
    from .agentic import HastenAgentWatch
    from .workloads import hasten_settings

    launched = time.perf_counter()
    cfg = load_config(spec["config"], typed(spec["overrides"]), profile=spec["profile"])

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    job = GRPOJob(prepare(cfg, log=log), log)
    watch = HastenAgentWatch(job.session) if job.session.agent is not None else None  # B7: tools
    clock = TrainingClock(spec["minutes"], spec["mark_minutes"], Path(spec["directory"]))
    startup = time.perf_counter() - launched
    extra = {}
    try:
        for step in range(1, cfg.train.steps + 1):
            began = time.perf_counter()
            record = job.step(step)
            seconds = time.perf_counter() - began
            tools = {key: value for key, value in record.items()
                     if key in TOOL_METRICS or key.rpartition("/")[2] in SAMPLER_METRICS}
            if clock.after_step(step, {"seconds": seconds, "reward_mean": record["reward_mean"], **tools},
                                job.save_model, last=step == cfg.train.steps):
                break
        if watch is not None:
            extra["agent"] = watch.record().to_dict()
    finally:
        job.close()
    clock.write(startup_seconds=startup, settings=hasten_settings(cfg), **extra)


def trl_worker(spec: dict[str, Any]) -> None:
    """TRL's GRPOTrainer.train() with a callback that keeps the same clock and saves at the same marks."""
    launched = time.perf_counter()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from .agentic import TrlAgentWatch, trl_tool_arguments
    from .peers import RewardLog

    rewards = RewardLog(spec["rewards"])
    directory = Path(spec["directory"])

    class Marks(TrainerCallback):
        clock: TrainingClock
        watch: TrlAgentWatch | None = None  # B7: tools

        def on_train_begin(self, args, state, control, **kwargs):
            self.clock = TrainingClock(spec["minutes"], spec["mark_minutes"], directory)

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            record = {"seconds": time.perf_counter() - self.began, **rewards.take(),
                      **(self.watch.step_metrics() if self.watch is not None else {})}
            if self.clock.after_step(state.global_step, record, lambda target: model.save_pretrained(target),
                                     last=state.global_step >= args.max_steps):
                control.should_training_stop = True

    marks = Marks()
    output_dir = tempfile.mkdtemp(prefix="hasten-b5-trl-")
    extra = {}
    try:
        tools = trl_tool_arguments(spec) if spec.get("agent") else {}  # B7: tools= and hasten's template
        trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=rewards.functions,
                              args=GRPOConfig(output_dir=output_dir, **spec["config"]),
                              train_dataset=Dataset.from_list(spec["rows"]), callbacks=[marks], **tools)
        marks.watch = TrlAgentWatch(trainer) if tools else None
        startup = time.perf_counter() - launched
        trainer.train()
        if marks.watch is not None:
            extra["agent"] = marks.watch.record().to_dict()
    finally:
        shutil.rmtree(output_dir, ignore_errors=True)
    marks.clock.write(startup_seconds=startup, settings={"model": spec["model_dir"], **spec["config"]}, **extra)


def run_worker(side: str, spec: dict[str, Any], directory: Path, allocator: str = "glibc") -> dict[str, Any]:
    """Run one side's worker to the end, on `allocator` (tcmalloc | mimalloc | glibc); its run.json. Its output goes to
    directory/log.txt."""
    from .peers import PeerError, peer_env

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "run.json").unlink(missing_ok=True)  # a reused --b5-dir: an old record must not pass for this run
    with open(directory / "log.txt", "w") as log:
        process = subprocess.run([sys.executable, "-m", "hasten.bench.b5", side], input=json.dumps(spec),
                                 stdout=log, stderr=subprocess.STDOUT, text=True,
                                 env=peer_env(allocator))
    record = directory / "run.json"
    if process.returncode != 0 or not record.is_file():
        tail = [line for line in (directory / "log.txt").read_text().splitlines() if line.strip()][-2:]
        raise PeerError(f"B5 {side} run in {directory} failed (exit {process.returncode}): {' | '.join(tail)}")
    return json.loads(record.read_text())


# ------------------------------------------------------------------ scoring: hasten's evaluator, one session


class Scorer:
    """The base model's session; `score(dir)` loads a checkpoint's weights into it and evaluates."""

    def __init__(self, cfg, log: Callable[[str], None]):
        from ..train.trainer import prepare

        self.cfg, self.session = cfg, prepare(cfg, log=log)
        self.base = self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        from ..train.evaluate import evaluate

        cfg, session = self.cfg, self.session
        metrics, _ = evaluate(session.task, session.engine, session.policy.tokenizer, session.rewards,
                              min(cfg.eval.num_examples, len(session.task.eval_rows)), cfg.eval.max_new_tokens,
                              cfg.eval.batch_size, cfg.generation.chat_template_kwargs, None,
                              cfg.generation.stop_strings, agent=session.agent)  # B7: the tool loop
        return metrics

    def score(self, directory: str | Path) -> dict[str, float]:
        from ..models import load_trained_weights

        load_trained_weights(self.session.policy.model, Path(directory))
        self.session.engine.weights_changed()  # the lean engine re-packs its weights
        return self._evaluate()

    def close(self) -> None:
        self.session.scorer.close()
        if self.session.agent is not None:
            self.session.agent.close()


# ------------------------------------------------------------------ the workload


def checkpoints_per_run(b5: B5Options, steps: int) -> int:
    """The most checkpoints one run writes: one per mark passed (or per step with marks of 0) and the last."""
    if b5.mark_minutes <= 0:
        return steps
    return min(steps, math.ceil(b5.minutes / b5.mark_minutes) + 1)


def check_disk(b5: B5Options, directory: Path, steps: int, checkpoint_bytes: int, runs: int,
               workload: str = "B5") -> None:
    """Refuse before training when the checkpoints the workload (B5, B7) will hold at once cannot fit in its
    --b5-dir (--b7-dir).

    Weights are deleted once a run is scored, so one run's checkpoints are on disk at a time
    (all runs' with --b5-keep-checkpoints). A full disk mid-run would kill a worker and lose the run.
    """
    from ..errors import UserError

    count = checkpoints_per_run(b5, steps) * (runs if b5.keep_checkpoints else 1)
    needed = int(count * checkpoint_bytes * 1.05) + (64 << 20)  # 5% + tokenizer/config files
    free = shutil.disk_usage(directory).free
    if needed > free:
        option = f"--{workload.lower()}"
        raise UserError(
            f"bench error: {option}-dir {directory}: {workload} would hold up to {count} checkpoints of "
            f"{checkpoint_bytes / 2**20:.0f} MiB ({needed / 2**30:.1f} GiB) there, but only {free / 2**30:.1f} GiB "
            f"are free; raise {option}-mark-minutes, lower train.steps, or point {option}-dir at a larger disk")


def plan_runs(b5: B5Options, peers: list[str], directory: Path, peer_label: str = "trl gc=off") -> list[RunPlan]:
    """Per seed: hasten (its config as is, unless --b5-only-profiles), hasten under each profile, then TRL:
    A B per seed."""
    plans = []
    for seed in b5.seeds:
        for profile in ([None] if b5.config_run else []) + b5.profiles:
            label = "hasten" if profile is None else f"hasten {profile}"
            plans.append(RunPlan(label, "hasten", seed, profile, directory / f"{label.replace(' ', '-')}-seed{seed}"))
        if "trl" in peers:
            plans.append(RunPlan(peer_label, "peer", seed, None, directory / f"trl-seed{seed}"))
    return plans


def add_variants(plans: list[RunPlan], variants: list[tuple[str, list[tuple[str, str]]]], directory: Path,
                 seeds: list[int]) -> list[RunPlan]:
    """One more hasten run per seed and --b5-variant (its label and config overrides), after the profiles."""
    for label, overrides in variants:
        for seed in seeds:
            plan = RunPlan(f"hasten {label}", "hasten", seed, None, directory / f"hasten-{label}-seed{seed}")
            plan.overrides = overrides
            first_peer = next((i for i, p in enumerate(plans) if p.seed == seed and p.side == "peer"), None)
            plans.insert(len(plans) if first_peer is None else first_peer, plan)
    return plans


def minutes_to_target(curve: list[list[float]], target: float) -> float:
    """Training minutes of the first point at or above `target` accuracy; inf when none is."""
    return next((minutes for minutes, _, accuracy in curve if accuracy >= target), math.inf)


@dataclass
class Workload:
    """What a time-to-accuracy workload changes in the procedure B5 and B7 share (b7.py is the other)."""

    name: str  # "B5" | "B7": the result, log lines, settings key, option names in messages, the plot's name
    options: B5Options
    overrides: list[tuple[str, Any]]  # config keys over options.config, for the scorer and every run
    peer_spec: Callable[[dict, Any, Scorer], None] | None = None  # adds to TRL's spec (B7: tools, template)
    rows: Callable[[Result, dict, dict, float, B5Options], None] | None = None  # None: accuracy_rows
    peer_label: str = "trl gc=off"  # TRL's row (B7: "trl", its checkpointing chosen per run and said in a note)


def run_b5(opts) -> Result:
    # The same lr at every step on both sides: transformers' warmup starts at lr 0, hasten's
    # default at lr/warmup_steps (one step ahead); B5 runs hasten with TRL's schedule.
    overrides = [("model.name", opts.model), ("train.warmup_from_zero", True)] + (QUICK_OVERRIDES if opts.quick else [])
    return run_time_to_accuracy(opts, Workload("B5", opts.b5, overrides))


def run_time_to_accuracy(opts, workload: Workload) -> Result:
    """Score the base model, then train each planned run in its own process and score its checkpoints."""
    from ..config import load_config
    from ..errors import UserError
    from .peers import PeerError

    b5, name = workload.options, workload.name
    cfg = load_config(b5.config, workload.overrides)
    directory = Path(b5.directory or tempfile.mkdtemp(prefix=f"hasten-{name.lower()}-"))
    directory.mkdir(parents=True, exist_ok=True)
    opts.log(f"{name}: output directory {directory}")
    result = Result(name, f"time to accuracy: {cfg.task.name} ({b5.config.name}), held-out greedy accuracy on "
                          f"{cfg.eval.num_examples} questions against training minutes; stop at "
                          f"{b5.minutes:g} min or {cfg.train.steps} steps")
    opts.log(f"{name}: scoring the base model")
    scorer = Scorer(cfg, lambda text: None)
    base = scorer.base.get("accuracy")
    plans = add_variants(plan_runs(b5, opts.peers, directory, workload.peer_label), b5.variants, directory,
                         b5.seeds)
    try:
        if base is None:  # time to accuracy: a task without a verdict per answer cannot be measured
            raise UserError(f"bench error: --{name.lower()}-config {b5.config}: task '{cfg.task.name}' reports no "
                            "held-out accuracy")
        model = scorer.session.policy.model  # the checkpoints are saved in fp32 whatever the run computes in
        check_disk(b5, directory, cfg.train.steps, sum(4 * p.numel() for p in model.parameters()), len(plans),
                   name)
    except Exception:
        scorer.close()
        if b5.directory is None:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    if "trl" not in opts.peers:
        result.notes.append("trl not measured (--peers, or the `trl` package does not import: pip install "
                            "'hasten[bench]')")
    curves: dict[str, dict[int, list[list[float]]]] = {}
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        for plan in plans:
            opts.log(f"{name}: {plan.label} seed {plan.seed}: training")
            try:
                record = train_run(opts, workload, plan, scorer, directory)
            except PeerError as error:
                result.notes.append(str(error))
                continue
            opts.log(f"{name}: {plan.label} seed {plan.seed}: scoring {len(record['checkpoints'])} checkpoints")
            curves.setdefault(plan.label, {})[plan.seed] = score_run(scorer, record, base, b5.keep_checkpoints)
            runs.setdefault(plan.label, {})[plan.seed] = {**record, "side": plan.side}
            result.settings.setdefault(plan.label, record.get("settings"))
    finally:
        scorer.close()
    (workload.rows or accuracy_rows)(result, runs, curves, base, b5)
    (directory / "curves.json").write_text(json.dumps({"base_accuracy": base, "curves": curves}))
    plot = plot_curves(curves, base, directory / f"{name.lower()}-accuracy.png", b5.minutes, name)
    result.settings["plot"] = str(plot)  # --report copies it
    result.settings.setdefault(name.lower(), {}).update({  # B7's rows put its own keys there first
        "directory": str(directory), "plot": str(plot), "seeds": b5.seeds, "profiles": b5.profiles,
        "minutes": b5.minutes, "mark_minutes": b5.mark_minutes, "base_accuracy": base,
        "target_accuracy": base + TARGET_GAIN,
        "eval_examples": min(cfg.eval.num_examples, scorer.base.get("num_examples", 0))})
    result.settings["curves"] = {label: {str(seed): curve for seed, curve in by_seed.items()}
                                 for label, by_seed in curves.items()}
    result.notes += [
        "minutes = training time: from the first step's start, checkpoint saving excluded; loading, "
        "startup and scoring not counted (startup_s: launch to the first step)",
        f"inf = +{100 * TARGET_GAIN:.0f} points not reached in {b5.minutes:g} min; "
        "every checkpoint of both sides scored by hasten's evaluator on one base-model session (weights loaded in place)",
        "hasten runs with train.warmup_from_zero=true: its warmup starts at lr 0 as transformers' does, so both "
        "sides use the same lr at every step; the two sides' samples come from different random streams",
    ]
    return result


def train_run(opts, workload: Workload, plan: RunPlan, scorer: Scorer, directory: Path) -> dict[str, Any]:
    """One planned run in its own process (PeerError when it fails): its run.json."""
    from ..compare import typed
    from ..config import load_config
    from ..kernels.allocator import resolve as resolve_allocator
    from ..tasks import make_task
    from ..tasks.sampler import PromptSampler
    from ..train.trainer import build_rewards
    from .workloads import peer_model_dir, trl_spec

    b5 = workload.options
    seeded = workload.overrides + [("train.seed", plan.seed)] + plan.overrides
    allocator = "glibc"  # TRL's documented setup
    if plan.side == "hasten":
        spec = {"config": str(b5.config), "overrides": [list(pair) for pair in seeded], "profile": plan.profile}
        run_cfg = load_config(b5.config, typed(seeded), profile=plan.profile)  # variants' keys are text
        allocator = resolve_allocator(run_cfg.speed.allocator)
    else:
        run_cfg = load_config(b5.config, seeded)
        task = make_task(run_cfg.task, run_cfg)
        rows = PromptSampler(task.train_rows, plan.seed).next(
            run_cfg.train.prompts_per_step * run_cfg.train.steps)  # hasten's prompt stream, in order
        spec = trl_spec(run_cfg, rows, build_rewards(run_cfg, task), peer_model_dir(run_cfg.model.name, directory),
                        False, run_cfg.train.steps, opts.trl_bf16)
        if workload.peer_spec is not None:
            workload.peer_spec(spec, run_cfg, scorer)
    spec.update(minutes=b5.minutes, mark_minutes=b5.mark_minutes, directory=str(plan.directory))
    return run_worker(plan.side if plan.side == "hasten" else "trl", spec, plan.directory, allocator)


def score_run(scorer: Scorer, record: dict[str, Any], base: float, keep: bool) -> list[list[float]]:
    """The run's curve: (training minutes, step, accuracy) from the base model's point on; weights deleted
    once scored unless `keep`."""
    curve = [[0.0, 0, base]]
    for checkpoint in record["checkpoints"]:
        accuracy = scorer.score(checkpoint["path"]).get("accuracy", 0.0)
        checkpoint["accuracy"] = accuracy
        curve.append([checkpoint["train_seconds"] / 60, checkpoint["step"], accuracy])
        if not keep:
            for weights in Path(checkpoint["path"]).glob("*.safetensors"):
                weights.unlink()
    return curve


def accuracy_rows(result: Result, runs: dict, curves: dict, base: float, b5: B5Options) -> None:
    """One row per label: minutes to +20 per seed (in seed order, so peer and hasten pair by seed)."""
    for label, by_seed in runs.items():
        seeds = [seed for seed in b5.seeds if seed in by_seed]
        minutes = [minutes_to_target(curves[label][seed], base + TARGET_GAIN) for seed in seeds]
        steps = [step for seed in seeds for step in by_seed[seed]["steps"]]
        side = by_seed[seeds[0]]["side"]
        # a peer row's table ratio is against the first hasten run; the ratios line has every hasten run
        result.rows.append(Row(label, side, "min", minutes, extra={
            "final_accuracy": statistics.mean(curves[label][seed][-1][2] for seed in seeds),
            "s_per_step": statistics.median(step["seconds"] for step in steps),
            "steps": statistics.mean(by_seed[seed]["steps"][-1]["step"] for seed in seeds),
            "train_minutes": statistics.mean(by_seed[seed]["steps"][-1]["train_seconds"] / 60 for seed in seeds),
            "startup_s": statistics.mean(by_seed[seed]["startup_seconds"] for seed in seeds),
            "reward_mean": statistics.mean(step["reward_mean"] for step in steps),
            "not_reached": sum(math.isinf(value) for value in minutes),
        }))


def plot_curves(curves: dict, base: float, target: Path, minutes: float, workload: str = "B5") -> Path:
    """Held-out accuracy against training minutes, one line per run; the base and +20 lines dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 5.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for index, (label, by_seed) in enumerate(curves.items()):
        for number, (seed, curve) in enumerate(sorted(by_seed.items())):
            axes.plot([point[0] for point in curve], [point[2] for point in curve], marker="o", markersize=3,
                      color=colors[index % len(colors)], alpha=0.9 if number == 0 else 0.5,
                      label=f"{label} seed {seed}")
    axes.axhline(base, color="grey", linestyle=":", label=f"base {base:.3f}")
    axes.axhline(base + TARGET_GAIN, color="black", linestyle="--", label=f"+{100 * TARGET_GAIN:.0f} points")
    ends = [curve[-1][0] for by_seed in curves.values() for curve in by_seed.values()]
    axes.set_xlim(0, (max(ends) if ends and max(ends) > 0 else minutes) * 1.03)
    axes.set_ylim(-0.02, 1.02)
    axes.set_xlabel("training minutes (checkpoint saving excluded)")
    axes.set_ylabel("held-out accuracy (greedy)")
    axes.set_title(f"{workload}: time to accuracy")
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.savefig(target, format="png", dpi=100)
    return target


if __name__ == "__main__":
    if sys.argv[1:] not in (["hasten"], ["trl"]):
        sys.exit("usage: python -m hasten.bench.b5 hasten|trl   (started by `hasten bench --workloads B5`)")
    (hasten_worker if sys.argv[1] == "hasten" else trl_worker)(json.loads(sys.stdin.read()))
