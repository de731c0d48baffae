"""B1: one GRPO step, hasten's prepare / Learner / grpo_step on configs/b1.yaml against TRL processes.

Measuring and reporting are apart. B1Rounds.measure(round) takes one round: at
each contention level, under its neighbours, hasten's step and then one step
of each TRL process (peers.py), and returns a StepRecord for each. b1_rows()
builds the table's rows from all the records: per side and level, the median
step seconds over rounds 2..N (round 1 pays one-off allocation). Every side's
step r at level L ran under the same neighbours, so rows pair by round.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .contention import Neighbours, label
from .machine import minor_faults
from .report import Result, Row, Work
from .workloads import (BenchOptions, HastenSide, RecordingEngine, b1_flops, contention_slowdowns, hasten_settings,
                        peer_model_dir, step_work, trl_spec)

PHASES = ("generate", "reward", "learn")  # hasten's step split; TRL's process times generate and learn


@dataclass
class StepRecord:
    """One side's step at one contention level of one round: what a B1 row is built from."""

    name: str  # "hasten", or the TRL process's ("trl gc=off")
    level: int  # busy neighbour processes beside it
    seconds: float
    flops: float  # the step's model FLOPs (the MFU column)
    work: dict[str, Work]  # its work by phase (the limit column)
    load: tuple[float, float]  # the load average before and after the level's neighbours ran
    extra: dict[str, float]  # phase seconds, page_faults, peak_rss_mib, reward_mean, completion_length, ...


class B1Rounds:
    """B1's sides, started once (hasten's learner and prompt feeder, the TRL processes); measure() takes a round."""

    def __init__(self, side: HastenSide, opts: BenchOptions, workdir: Path, result: Result):
        from ..train.feeder import make_feeder
        from .peers import PeerError, TrlProcess

        self.side, self.opts, self.notes = side, opts, result.notes
        self.learning = side.learner.optimization.precision.mode  # the learning precision as the plan resolved it
        cfg, session, levels = side.cfg, side.session, opts.contention
        self.steps = opts.rounds("B1") * len(levels)  # each process takes one step per level per round
        per_step = cfg.train.prompts_per_step
        rows, prompt_ids = side.prompts(per_step * self.steps)  # hasten's own sampler yields these rows, in order
        self.prompts = [prompt_ids[i * per_step:(i + 1) * per_step] for i in range(self.steps)]  # per step
        self.workers: dict[str, TrlProcess] = {}
        if "trl" in opts.peers:
            model_dir = peer_model_dir(cfg.model.name, workdir)
            for checkpointing in opts.trl_checkpointing:  # TRL's CPU best, then its default (--trl-checkpointing)
                name = f"trl gc={'on' if checkpointing else 'off'}" + (" bf16" if opts.trl_bf16 else "")
                spec = trl_spec(cfg, rows, session.rewards, model_dir, checkpointing, self.steps, opts.trl_bf16)
                result.settings[name] = {"model": model_dir, **spec["config"]}
                opts.log(f"B1: starting {name}")
                try:
                    self.workers[name] = TrlProcess(name, spec)
                except PeerError as error:
                    self.notes.append(str(error))
        self.sampler = make_feeder(cfg, session.task.train_rows, session.policy.tokenizer)
        self.recorder = session.engine = RecordingEngine(session.engine)
        self.step = 0

    def measure(self, round_index: int) -> list[StepRecord]:
        """One round: at each contention level, hasten's step, then each TRL process's (no two overlap)."""
        from ..train.trainer import grpo_step
        from .peers import PeerError

        records, rounds = [], self.opts.rounds("B1")
        for level in self.opts.contention:
            self.step += 1
            self.opts.log(f"B1: round {round_index + 1}/{rounds}{label(level)}")
            self.opts.progress(self.step - 1, self.steps)
            with Neighbours(level) as neighbours:
                faults = minor_faults()
                metrics = grpo_step(self.side.session, self.side.learner, self.sampler, self.step)
                faults = minor_faults() - faults
                messages = {}
                for name in list(self.workers):
                    try:
                        messages[name] = self.workers[name].step()
                    except PeerError as error:
                        self.notes.append(str(error))
                        self.workers.pop(name).close()
            load = (neighbours.load_before, neighbours.load_after)
            records.append(self._hasten_record(metrics, faults, level, load))
            records += [self._peer_record(name, message, level, load) for name, message in messages.items()]
        return records

    def _hasten_record(self, metrics: dict, faults: int, level: int, load: tuple[float, float]) -> StepRecord:
        cfg, rollout = self.side.cfg, self.recorder.last
        prompt, completion = float(rollout.prompt_mask.sum()), float(rollout.completion_mask.sum())
        work = step_work(self.side.size, self.side.shape, prompt, completion, rollout.completion_ids.shape[1],
                         float(rollout.prompt_mask.sum(1).min()),
                         (cfg.generation.precision, self.learning), cfg.model.lora)
        extra = {**{part: metrics[f"time/{part}"] for part in PHASES}, "page_faults": faults,
                 "peak_rss_mib": metrics["memory/peak_mib"],  # the bench process, so far
                 "reward_mean": metrics["reward_mean"], "completion_length": metrics["completion_length"],
                 # speed.skip_zero_advantage: samples with no gradient left out of the pass (the limit counts all)
                 "skipped_samples": metrics.get("learn/skipped_samples", 0.0)}
        return StepRecord("hasten", level, metrics["time/step"],
                          b1_flops(self.side.size, prompt, completion, cfg.model.lora), work, load, extra)

    def _peer_record(self, name: str, message: dict, level: int, load: tuple[float, float]) -> StepRecord:
        prompts, lora = self.prompts[message["step"] - 1], self.side.cfg.model.lora
        prompt, completion = float(sum(len(ids) for ids in prompts)), message["completion_tokens"]
        precision = "bf16" if self.opts.trl_bf16 else "fp32"
        work = step_work(self.side.size, self.side.shape, prompt, completion,
                         completion / max(message["num_samples"], 1),  # mean length <= steps taken
                         min(len(ids) for ids in prompts), (precision, precision), lora)
        # TRL's step split as its process times it: generate(), then everything else (rewards, log-probs,
        # backward, optimizer): the plot's bars and the per-phase limits
        extra = {**{part: message[part] for part in PHASES if part in message},
                 "page_faults": message["page_faults"], "peak_rss_mib": message["peak_rss_mib"],  # that process
                 "reward_mean": message["reward_mean"],
                 "completion_length": completion / max(message["num_samples"], 1)}
        return StepRecord(name, level, message["seconds"], b1_flops(self.side.size, prompt, completion, lora), work,
                          load, extra)

    def close(self) -> None:
        self.side.session.engine = self.recorder.engine
        self.sampler.close()  # the prefetch thread
        for worker in self.workers.values():
            worker.close()


def run_b1(side: HastenSide, opts: BenchOptions) -> Result:
    """Rounds of steps, measured alternately, then the rows built from their records."""
    cfg, rounds = side.cfg, opts.rounds("B1")
    learning = side.learner.optimization.precision.mode  # the learning precision as the plan resolved it
    result = Result("B1", f"one GRPO step ({cfg.train.prompts_per_step} prompts x {cfg.generation.num_generations} "
                          f"generations, max {cfg.generation.max_new_tokens} new tokens, "
                          f"{'LoRA' if cfg.model.lora else 'full fine-tune'}, learning {learning}, "
                          f"generation {cfg.generation.precision})")
    result.settings["hasten"] = hasten_settings(cfg)
    records: list[StepRecord] = []
    with tempfile.TemporaryDirectory(prefix="hasten-bench-") as workdir:
        sides = B1Rounds(side, opts, Path(workdir), result)
        try:
            for round_index in range(rounds):  # A B B, A B B, ...
                records += sides.measure(round_index)
            opts.progress(sides.steps, sides.steps)
        finally:
            sides.close()
    result.rows = b1_rows(records, opts, learning)
    levels = opts.contention
    if len(levels) > 1:
        slowdowns = result.settings["contention"] = contention_slowdowns(result, levels)
        result.notes.append("slowdown under contention (busy / idle step seconds, median over rounds): "
                            + ", ".join(f"{pair} {value:.2f}x" for pair, value in slowdowns.items()))
    result.notes.append(f"rounds 1..{rounds} run alternately (hasten, then each TRL process"
                        f"{', at each contention level' if len(levels) > 1 else ''}); median over rounds "
                        f"{'2' if rounds > 1 else '1'}..{rounds}; both sides get the same prompt rows; "
                        "samples differ (different random streams), so completion lengths differ a little")
    if any(record.extra.get("skipped_samples") for record in records):
        result.notes.append("the limit counts the model FLOPs of every sample; hasten's learning pass left out the "
                            "samples that cannot have a gradient (skipped_samples, speed.skip_zero_advantage), "
                            "TRL's ran them")
    return result


def b1_rows(records: list[StepRecord], opts: BenchOptions, precision: str) -> list[Row]:
    """Per contention level: hasten's row, then each TRL process's that took every round's step, in start order."""
    rounds = opts.rounds("B1")
    rows = []
    for level in opts.contention:
        at_level = [record for record in records if record.level == level]
        for name in dict.fromkeys(record.name for record in at_level):
            steps = [record for record in at_level if record.name == name]
            if len(steps) < rounds:  # the process failed part way (its error is a note)
                continue
            peer = name != "hasten"
            rows.append(Row(f"{name}{label(level)}", "peer" if peer else "hasten", "s/step",
                            **_row_fields(steps, rounds),
                            baseline=f"hasten{label(level)}" if peer else None,
                            precision=("bf16" if opts.trl_bf16 else "fp32") if peer else precision))
    return rows


def _row_fields(steps: list[StepRecord], rounds: int) -> dict:
    """seconds, flops, phases and extra of one side's row at one level: medians over rounds 2..N."""
    measured = steps[1:] if rounds > 1 else steps  # round 1 pays one-off allocation
    extra = {part: statistics.median(step.extra[part] for step in measured)
             for part in PHASES if all(part in step.extra for step in steps)}
    extra.update(first_step=steps[0].seconds,
                 page_faults=int(statistics.median(step.extra["page_faults"] for step in measured)),
                 peak_rss_mib=round(steps[-1].extra["peak_rss_mib"]),
                 reward_mean=statistics.mean(step.extra["reward_mean"] for step in steps),
                 completion_length=statistics.mean(step.extra["completion_length"] for step in steps))
    if "skipped_samples" in steps[0].extra:
        extra["skipped_samples"] = statistics.mean(step.extra["skipped_samples"] for step in measured)
    if steps[0].level:
        extra.update(load_before=steps[0].load[0], load_after=steps[-1].load[1])
    return {"seconds": [step.seconds for step in measured], "flops": [step.flops for step in measured],
            "phases": [step.work for step in measured], "extra": extra}
