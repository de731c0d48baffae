"""Run TRL's own trainer test files against TRL (the control) and against hasten,
and say how many of the tests that pass on TRL pass on hasten.

    python dev/trl_conformance/run.py /path/to/trl-checkout [--files grpo sft] [-k EXPR]

The control is TRL from the same checkout as the tests (put first on
PYTHONPATH): a released trl cannot import main's test files, whose helpers
move between versions. Needs TRL's dependencies installed;
no network: the hub ids the tests load are tiny local stand-ins (hub.py), and
GPU, vLLM, liger and VLM tests are skipped on both sides (plugin.py). Not part
of `make test`, which must run offline without a TRL checkout.

The hasten side is a copy of the tests with one switch: `from trl import
GRPOConfig, GRPOTrainer` (and the SFT pair) import from hasten, and the
"trl.trainer.*" logger names the tests capture become hasten's. Everything else
is TRL's file unchanged. Tests that never name a switched class exercise TRL's
private helpers on both sides; they are listed as "internal" and not counted.

Each (side, file) is one pytest process with one thread; --jobs of them run at once (default 2).
`--reuse-control` keeps the TRL side's results from the last run with the
same checkout and selection, for quick re-runs while fixing hasten.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FILES = {"grpo": "tests/test_grpo_trainer.py", "sft": "tests/test_sft_trainer.py"}
SWITCH = [
    (r"^from trl import (GRPOConfig, GRPOTrainer|SFTConfig, SFTTrainer)$", r"from hasten import \1"),
    (r'"trl\.trainer\.grpo_trainer"', '"hasten.api.grpo_trainer"'),
    (r'"trl\.trainer\.sft_trainer"', '"hasten.api.sft"'),
]


def switched(source: str) -> str:
    for pattern, replacement in SWITCH:
        source = re.sub(pattern, replacement, source, flags=re.MULTILINE)
    return source


def prepare(side: str, trl_source: Path, work: Path, names: list[str]) -> Path:
    """A copy of TRL's tests/ folder for `side`, the hasten one with the import switched; the results of
    the files about to run are cleared (other files' stay, for --report-only)."""
    root = work / side
    shutil.rmtree(root / "tests", ignore_errors=True)
    for name in names:
        (root / f"results-{name}.json").unlink(missing_ok=True)
    shutil.copytree(trl_source / "tests", root / "tests",
                    ignore=shutil.ignore_patterns("experimental", "distributed", "__pycache__"))
    if side == "hasten":
        for name in names:
            path = root / FILES[name]
            path.write_text(switched(path.read_text()))
    return root


def launch(side: str, root: Path, name: str, args, env: dict) -> subprocess.Popen:
    env = dict(env, TRL_CONFORMANCE_RESULTS=str(root / f"results-{name}.json"))
    command = [sys.executable, "-m", "pytest", FILES[name], "-p", "plugin", "-p", "no:cacheprovider",
               "-q", "--no-header", "-rN", "--tb=line"]
    if args.k:
        command += ["-k", args.k]
    print(f"[{side}] {' '.join(command[1:])}  (log: {root / f'pytest-{name}.log'})", file=sys.stderr)
    with open(root / f"pytest-{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)


def outcomes(root: Path) -> dict[str, list]:
    """nodeid -> [passed|failed|skipped|missing, first line of the error, trainer|internal]."""
    found: dict[str, list] = {}
    for path in sorted(root.glob("results-*.json")):
        found.update(json.loads(path.read_text()))
    return found


def report(control: dict, hasten: dict, names: list[str]) -> dict:
    summary = {}
    print()
    for name in names:
        prefix = FILES[name] + "::"
        passing = sorted(n for n, (s, _, _) in control.items() if n.startswith(prefix) and s == "passed")
        counted = [n for n in passing if control[n][2] == "trainer"]
        internal = [n for n in passing if n not in counted]
        passed = [n for n in counted if hasten.get(n, ["missing"])[0] == "passed"]
        failed = [n for n in counted if n not in passed]
        summary[name] = {"passed": len(passed), "of": len(counted), "internal": len(internal),
                         "failed": {n.removeprefix(prefix): hasten.get(n, ["missing", "not run"])[1] for n in failed}}
        print(f"{FILES[name]}: hasten passes {len(passed)} of the {len(counted)} tests that pass on TRL "
              f"({100 * len(passed) / max(len(counted), 1):.0f}%); {len(internal)} more test TRL internals only")
        for n in failed:
            print(f"  FAIL {n.removeprefix(prefix)}: {summary[name]['failed'][n.removeprefix(prefix)]}")
    total, of = sum(s["passed"] for s in summary.values()), sum(s["of"] for s in summary.values())
    print(f"overall: hasten passes {total} of the {of} tests that pass on TRL ({100 * total / max(of, 1):.0f}%)")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trl_source", type=Path, help="a huggingface/trl source checkout")
    parser.add_argument("--files", nargs="+", choices=list(FILES), default=list(FILES))
    parser.add_argument("-k", help="pytest -k selection, applied to both sides")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "hasten" / "trl-conformance")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once (one thread each)")
    parser.add_argument("--reuse-control", action="store_true")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report the last results of both sides for --files")
    parser.add_argument("--hasten-only", action="store_true",
                        help="run the hasten side alone and list its outcomes (a quick check while fixing)")
    parser.add_argument("--test-seconds", type=int, default=300, help="wall-clock limit per test")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from hub import build  # this folder is on sys.path when run as a script

    commit = subprocess.run(["git", "-C", str(args.trl_source), "rev-parse", "--short=9", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip() or "unknown"
    print(f"TRL tests from {args.trl_source} at {commit}; building tiny stand-ins under {args.work}", file=sys.stderr)
    hub = build(args.work, args.trl_source)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TRL_CONFORMANCE_DATA=str(args.work / "datasets"),
               TRL_CONFORMANCE_TEST_SECONDS=str(args.test_seconds), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), str(args.trl_source.resolve()),
                                           os.environ.get("PYTHONPATH", "")]))

    stamps = {name: (args.work / "runs" / "trl" / f"selection-{name}.json", json.dumps([commit, args.k]))
              for name in args.files}  # the control's results are reused only for the same commit and -k
    reuse = args.report_only or (args.reuse_control and all(
        path.exists() and path.read_text() == selection for path, selection in stamps.values()))
    roots = {side: args.work / "runs" / side for side in ("trl", "hasten")}
    sides = [] if args.report_only else ["hasten"] if reuse or args.hasten_only else ["trl", "hasten"]
    for side in sides:
        roots[side] = prepare(side, args.trl_source, args.work / "runs", args.files)
    # one pytest per (side, file), --jobs of them at a time
    waiting = [(side, name) for side in sides for name in args.files]
    running: list[subprocess.Popen] = []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            side, name = waiting.pop(0)
            running.append(launch(side, roots[side], name, args, env))
        running[0].wait()
        running = [process for process in running if process.poll() is None]
    if args.hasten_only:
        for nodeid, (status, line, _) in sorted(outcomes(roots["hasten"]).items()):
            if status in ("passed", "failed"):
                print(f"{status.upper():6} {nodeid} {line}")
        return
    if "trl" in sides:
        for path, selection in stamps.values():
            path.write_text(selection)

    summary = report(outcomes(roots["trl"]), outcomes(roots["hasten"]), args.files)
    (args.work / "runs" / "summary.json").write_text(json.dumps({"commit": commit, **summary}, indent=1))


if __name__ == "__main__":
    main()
