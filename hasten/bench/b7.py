"""B7 of docs/benchmarks.md: agentic GRPO, hasten against TRL 1.16's GRPOTrainer(tools=...).

    hasten bench --workloads B7 [--b7-model NAME|DIR] [--b7-config configs/agent-demo.yaml] [--seeds 0,1,2]
                 [--b7-minutes 30] [--b7-mark-minutes 0] [--b7-dir DIR] [--profiles ...] [--peers trl|none]

B5's procedure (b5.py's run_time_to_accuracy: each run in its own process, one training clock, checkpoints
at the marks, every checkpoint of both sides scored by hasten's held-out evaluator on one session of the
base model) on a tool task: configs/agent-demo.yaml's `calculator` (3-4 digit products, the calculator
tool, a worked example as a whole tool conversation). The tool loop runs in training and in scoring.
Both sides start from --b7-model (default: --model, the default model; a local checkpoint directory such
as an SFT warm start on tool conversations works as it does for model.name) and get the same rows in the
same order, reward functions and hyperparameters (peers.trl_settings), plus the same tools, tool template
and turn cap (generation.max_tool_turns = TRL's max_tool_calling_iterations). agentic.py describes how TRL
is handed hasten's template and how each side records the setup it used; the records are compared
field by field, and a difference is a note and `same_setup: false`.

Rows, per run label: minutes to +20 points of held-out accuracy per seed (unit min, as B5; the peer's
ratio is TRL minutes / hasten minutes, paired by seed), then "<label> s/step": each seed's median step
seconds (paired by seed as well). Both carry the final accuracy and `tool_calls` (calls per rollout, the
mean over steps). The target of issue 32 (at least 5x TRL's time to +20 points, with final accuracy at
least TRL's) is reported in settings.b7.target, never asserted.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cost
from .b5 import (
    QUICK_OVERRIDES,
    B5Options,
    Scorer,
    Workload,
    accuracy_rows,
    run_time_to_accuracy,
)
from .report import Result, Row, pair_ratio

AGENT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "agent-demo.yaml"
TARGET_RATIO = 5.0  # issue 32: TRL's minutes to +20 points / hasten's, at least this
# --quick: B5's toy sizes (2 steps of 2 prompts x 4 rollouts x 8 tokens, 8 held-out questions), --b7-model's model
B7_QUICK_OVERRIDES = [(key, value) for key, value in QUICK_OVERRIDES if key != "model.name"]


def run_b7(opts) -> Result:
    from ..errors import UserError
    from .scaling import available_gib

    b7: B5Options = opts.b7
    # train.warmup_from_zero: the same lr at every step on both sides, as in B5
    overrides = [("model.name", b7.model or opts.model), ("train.warmup_from_zero", True)]
    overrides += B7_QUICK_OVERRIDES if opts.quick else []
    problem = tool_problem(b7.config, overrides)
    if problem:
        raise UserError(f"bench error: --b7-config {b7.config}: {problem}")
    forced = {(False,): False, (True,): True}.get(tuple(opts.trl_checkpointing))  # None: both (default) = chosen
    checkpointing = TrlCheckpointing(forced, available_gib())
    workload = Workload("B7", b7, overrides, peer_spec=functools.partial(tool_spec, checkpointing=checkpointing),
                        rows=functools.partial(b7_rows, checkpointing=checkpointing), peer_label="trl")
    return run_time_to_accuracy(opts, workload)


@dataclass
class TrlCheckpointing:
    """TRL's gradient checkpointing in B7, one choice for every seed: off (its CPU best) unless the estimate of
    its step's memory without it passes the memory available when B7 started; then on. The estimate is
    cost.training_memory_bytes at B7's own prompt length: every TRL sample carries the ~400-token tool prompt
    (401 for SmolLM2), where B1's carry ~48. --trl-checkpointing off|on forces one."""

    forced: bool | None
    budget_gib: float
    estimate_gib: float | None = None
    chosen: bool | None = None

    def choose(self, cfg, scorer: Scorer) -> bool:
        if self.chosen is None:
            self.chosen = self.forced
        if self.chosen is None:
            from .scaling import GIB, memory_estimate

            session = scorer.session
            prompt = session.task.train_rows[0]["prompt"]
            tokens = len(session.agent.template.encode_prompt(prompt, [t.schema for t in session.agent.tools.values()]))
            shape = cost.Shape.from_config(session.policy.model.config)
            self.estimate_gib = memory_estimate(shape, cfg, "trl", tokens)["total"] / GIB
            self.chosen = self.estimate_gib > self.budget_gib
        return self.chosen

    def note(self) -> str | None:
        if self.chosen is None:
            return None
        state = "on" if self.chosen else "off"
        if self.estimate_gib is None:
            return f"TRL ran with gradient checkpointing {state} (--trl-checkpointing {state})"
        return (f"TRL ran with gradient checkpointing {state}: its step's memory estimate without it is "
                f"{self.estimate_gib:.1f} GiB against {self.budget_gib:.1f} GiB available at the start "
                "(--trl-checkpointing off|on forces one)")


def tool_problem(config: Path, overrides: list[tuple[str, Any]]) -> str | None:
    """Why the config cannot be B7's task (no tools; an environment; stop strings TRL would not apply), or None."""
    from ..agent import make_agent
    from ..config import load_config
    from ..tasks import make_task

    cfg = load_config(config, overrides)
    parts = make_agent(cfg, make_task(cfg.task, cfg))
    if parts is None or not parts.tools:
        return f"task '{cfg.task.name}' has no tools (B7 trains a tool task: calculator, or generation.tools)"
    if parts.environments is not None:
        return "B7 compares tools= runs; environments (TRL's environment_factory) are not part of it"
    if cfg.generation.stop_strings:
        return "generation.stop_strings has no TRL counterpart in B7; leave it empty"
    return None


def tool_spec(spec: dict[str, Any], cfg, scorer: Scorer, checkpointing: TrlCheckpointing) -> None:
    """TRL's spec gets hasten's tools (by import name), its resolved tool template, its turn cap, and the
    gradient checkpointing chosen for B7."""
    from .peers import importable

    spec["config"]["gradient_checkpointing"] = checkpointing.choose(cfg, scorer)
    agent = scorer.session.agent  # built from the same config: the template `auto` resolved to, the tools
    spec["agent"] = {"template": agent.template.template,
                     "tools": [importable(tool.fn, f"tool '{tool.name}'") for tool in agent.tools.values()]}
    spec["config"]["max_tool_calling_iterations"] = agent.settings.max_turns
    if cfg.generation.chat_template_kwargs:
        spec["config"]["chat_template_kwargs"] = dict(cfg.generation.chat_template_kwargs)


def b7_rows(result: Result, runs: dict, curves: dict, base: float, b7: B5Options,
            checkpointing: TrlCheckpointing) -> None:
    """B5's minutes rows, then an s/step row per label; the tool-call rate on both; the setups compared."""
    accuracy_rows(result, runs, curves, base, b7)
    note = checkpointing.note()
    if note:
        result.notes.append(note)
    timed = []
    for row in result.rows:
        by_seed = runs[row.name]
        seeds = [seed for seed in b7.seeds if seed in by_seed]
        steps = [step for seed in seeds for step in by_seed[seed]["steps"]]
        calls = [step["tools/call_frequency"] for step in steps if "tools/call_frequency" in step]
        row.extra["tool_calls"] = statistics.mean(calls) if calls else float("nan")
        seconds = [statistics.median(step["seconds"] for step in by_seed[seed]["steps"]) for seed in seeds]
        timed.append(Row(f"{row.name} s/step", row.side, "s/step", seconds,  # a peer's: against each hasten s/step
                         extra={"final_accuracy": row.extra["final_accuracy"], "tool_calls": row.extra["tool_calls"]}))
    result.rows += timed
    result.settings["b7"] = {"setup": compare_setups(result, runs, b7), "target": target(result)}


def compare_setups(result: Result, runs: dict, b7: B5Options) -> dict[str, Any]:
    """Every run's AgentRecord against the first hasten run's: the fields that differ, per run; a summary of
    the reference. The records themselves go to the runs' run.json files."""
    from ..agent import HERMES_TEMPLATE
    from .agentic import differences

    records = [(label, seed, by_seed[seed].get("agent"), by_seed[seed]["side"])
               for label, by_seed in runs.items() for seed in b7.seeds if seed in by_seed]
    reference = next((record for _, _, record, side in records if side == "hasten" and record), None)
    if reference is None:
        return {"same_setup": None}
    found = {f"{label} seed {seed}": differences(reference, record or {}) for label, seed, record, _ in records}
    for run, fields in found.items():
        if fields:
            result.notes.append(f"B7 setups differ: {run} used another {', '.join(fields)} than the first hasten run")
    compared = any(side == "peer" for *_, side in records)
    return {"same_setup": not any(found.values()) if compared else None, "differences": found,
            "template": "hermes" if reference["template"] == HERMES_TEMPLATE else "the model's own",
            "tools": [schema["function"]["name"] for schema in reference["tools"]],
            "max_tool_turns": reference["max_tool_turns"],
            "prompt_tokens": len(reference["first_prompt_ids"] or [])}


def target(result: Result) -> dict[str, Any]:
    """Issue 32's goal, reported: TRL minutes / hasten minutes (median of seed pairs) >= 5 and hasten's final
    accuracy >= TRL's. None where a side is missing or neither side reached +20 points."""
    rows = {row.name: row for row in result.rows}
    hasten, peer = rows.get("hasten"), rows.get("trl")
    if hasten is None or peer is None:
        return {"goal": f">= {TARGET_RATIO:g}x TRL's minutes to +20 points, final accuracy >= TRL's", "met": None}
    ratio = pair_ratio(peer, hasten)
    accurate = hasten.extra["final_accuracy"] >= peer.extra["final_accuracy"]
    return {"goal": f">= {TARGET_RATIO:g}x TRL's minutes to +20 points, final accuracy >= TRL's",
            "ratio": ratio, "final_accuracy_at_least_trl": accurate,
            "met": None if ratio is None else bool(ratio >= TARGET_RATIO and accurate)}

