"""B4: startup, each in a fresh process (docs/benchmarks.md): `hasten --help`; launch to the end of step 1 of
`hasten train` (B1 config, eval off); hasten import + prepare + Learner against TRL import + GRPOTrainer
construction. It measures the command line itself, so every figure is a new process's wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


PREPARE_SCRIPT = """
import json, sys, time
started = time.perf_counter()
from hasten.config import load_config
from hasten.train.learner import Learner
from hasten.train.trainer import prepare
imported = time.perf_counter()
spec = json.loads(sys.argv[1])
cfg = load_config(spec["config"], [tuple(pair) for pair in spec["overrides"]])
session = prepare(cfg, log=lambda text: None)
Learner.from_config(session.policy, cfg)
message = {"event": "built", "import_seconds": imported - started, "construct_seconds": time.perf_counter() - imported}
print(spec["prefix"] + json.dumps(message), flush=True)
"""


def _hasten_command() -> list[str]:
    """The installed `hasten` script beside this interpreter, else `python -m hasten.cli`."""
    script = Path(sys.executable).parent / "hasten"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "hasten.cli"]


def _wall(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - started


def _until_built(command: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Launch `command`; wall seconds until it prints its "built" message, plus the message."""
    from .peers import PREFIX, PeerError

    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        for line in process.stdout:
            if line.startswith(PREFIX):
                message = {**json.loads(line[len(PREFIX):]), "wall": time.perf_counter() - started}
                process.wait()
                return message
        process.wait()
        errors.seek(0)
        raise PeerError(f"{command[:3]} exited with code {process.returncode}: {errors.read()[-300:]}")


def _launch_to_first_step(command: list[str], env: dict[str, str], workdir: Path) -> tuple[float, float]:
    """Start `hasten train` for one step; seconds until its first metrics line exists, and that step's time."""
    metrics = workdir / "b4" / "metrics.jsonl"
    started = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(command + [f"--output.dir={workdir}", "--output.name=b4"],
                                   stdout=subprocess.DEVNULL, stderr=errors, env=env)
        try:
            while process.poll() is None:
                if metrics.is_file() and metrics.read_text().endswith("\n"):  # a whole line: step 1 is done
                    elapsed = time.perf_counter() - started
                    return elapsed, json.loads(metrics.read_text().splitlines()[0])["time/step"]
                time.sleep(0.02)
            errors.seek(0)
            from .peers import PeerError

            raise PeerError(f"hasten train exited with code {process.returncode}: {errors.read()[-300:]}")
        finally:
            if process.poll() is None:
                process.terminate()  # the step is done; skip saving the checkpoint
            process.wait()


def run_b4(opts) -> Any:
    import statistics

    from ..tasks import make_task
    from ..tasks.sampler import PromptSampler
    from ..train.trainer import build_rewards
    from .peers import PREFIX, PeerError, peer_env, trl_construct
    from .report import Result, Row
    from .workloads import QUICK_OVERRIDES, bench_config, peer_model_dir, trl_spec

    rounds = opts.rounds("B4")
    help_rounds = 2 if opts.quick else max(5, opts.repeats or 0)  # ~0.1 s each: always at least 5
    env, hasten = peer_env(), _hasten_command()
    result = Result("B4", "startup, each in a fresh process (wall seconds from launch)")
    overrides = [("model.name", opts.model)] + (QUICK_OVERRIDES if opts.quick else [])
    train_command = hasten + ["train", "--config", str(opts.config), "--steps", "1"] + [
        f"--{key}={value}" for key, value in overrides]
    result.settings["hasten"] = {"help": hasten + ["--help"], "train": train_command,
                                 "prepare": "import hasten; prepare(cfg); Learner.from_config(policy, cfg)"}

    opts.log("B4: hasten --help")
    help_seconds = [_wall(hasten + ["--help"], env) for _ in range(help_rounds)]
    result.rows.append(Row("hasten --help", "hasten", "s", help_seconds))

    launches, step_seconds = [], []
    runs = help_rounds + 2 * rounds  # --help, launches, import + construction rounds
    opts.progress(help_rounds, runs)
    for round_index in range(rounds):
        opts.log(f"B4: launch to step 1, round {round_index + 1}/{rounds}")
        opts.progress(help_rounds + round_index, runs)
        with tempfile.TemporaryDirectory(prefix="hasten-bench-") as workdir:
            elapsed, step = _launch_to_first_step(train_command, env, Path(workdir))
        launches.append(elapsed)
        step_seconds.append(step)
    result.rows.append(Row("hasten train: launch -> step 1", "hasten", "s", launches,
                           extra={"step_1": statistics.median(step_seconds)}))
    # Step 1's own seconds (time/step, measured from the moment the loop calls it) taken away:
    # launch until training starts, everything built (model, engine, optimizer, run directory).
    result.rows.append(Row("hasten train: launch -> step 1 begins", "hasten", "s",
                           [launch - step for launch, step in zip(launches, step_seconds)]))

    cfg = bench_config(opts, 1)
    spec = json.dumps({"config": str(opts.config), "overrides": overrides, "prefix": PREFIX})
    prepared, constructed = [], []
    trl = "trl" in opts.peers
    with tempfile.TemporaryDirectory(prefix="hasten-bench-") as workdir:
        if trl:
            task = make_task(cfg.task)
            rows = PromptSampler(task.train_rows, cfg.train.seed).next(cfg.train.prompts_per_step)
            peer = trl_spec(cfg, rows, build_rewards(cfg, task), peer_model_dir(cfg.model.name, Path(workdir)),
                            False, 1)
            result.settings["trl"] = {"model": peer["model_dir"], **peer["config"]}
        for round_index in range(rounds):  # A B A B
            opts.log(f"B4: import + construction, round {round_index + 1}/{rounds}")
            opts.progress(help_rounds + rounds + round_index, runs)
            prepared.append(_until_built([sys.executable, "-c", PREPARE_SCRIPT, spec], env))
            if trl:
                try:
                    constructed.append(trl_construct(peer))
                except PeerError as error:
                    result.notes.append(str(error))
                    trl = False

    opts.progress(runs, runs)

    def split(messages: list[dict]) -> dict[str, float]:
        return {"import": statistics.median(m["import_seconds"] for m in messages),
                "construct": statistics.median(m["construct_seconds"] for m in messages)}

    result.rows.append(Row("hasten import+prepare", "hasten", "s", [m["wall"] for m in prepared],
                           extra=split(prepared)))
    if constructed and len(constructed) == rounds:
        result.rows.append(Row("trl import+GRPOTrainer", "peer", "s", [m["wall"] for m in constructed],
                               baseline="hasten import+prepare", extra=split(constructed)))
    elif "trl" not in opts.peers:
        result.notes.append("trl not measured: the `trl` package does not import here (pip install 'hasten[bench]')")
    result.notes.append("launch -> step 1 stops the run once step 1's metrics line is written (no checkpoint); "
                        "import+construction: wall from launch to the built object; both load the same weights")
    return result
