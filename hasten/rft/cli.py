"""The RFT commands: `hasten rft datagen | test | compare | sft` and `hasten sft`.

    hasten rft datagen [--model NAME_OR_DIR] [--task NAME] [--data OUT.json] [--oversample 10]
                       [--temperature 0.6] [--keep one|all] [--config run.yaml] [--section.key=value ...]
    hasten sft         [--profile plain|conservative|balanced|aggressive] [--data IN.json] [--model ...] ...
    hasten rft test    [--model DIR] [--num-examples 100] ...
    hasten rft compare [--profiles conservative,balanced,aggressive] [--rounds 1] [--data IN.json] ...

Every convenience flag is a config key (`--data` is rft.data, `--oversample`
rft.oversample, ...), read and checked the way `--rft.oversample=12` is, so
bad values give the same one-line `config error` and exit code 2. Each
command prints a readable result, then one JSON line last (`--json`: only
the JSON line). hasten/cli.py passes `rft` and `sft` here untouched.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import EXIT_USER_ERROR, exit_code

# main() was given process=True: this is the `hasten` process itself, which sft, datagen and test may
# re-execute on the allocator their config asks for (kernels/allocator.py). False when called from Python.
_PROCESS_ENTRY = False

# flag -> config key; values stay text and are typed by the config (one-line errors).
FLAG_KEYS = {
    "model": "model.name", "task": "task.name", "data": "rft.data", "oversample": "rft.oversample",
    "temperature": "rft.temperature", "keep": "rft.keep", "num_examples": "eval.num_examples",
}


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (sections as in hasten/config.py)")
    parser.add_argument("--model", help="smollm2-135m (default), tiny, a model or adapter directory")
    parser.add_argument("--task", help="unit-conversion (default), arithmetic, or jsonl")
    parser.add_argument("--json", action="store_true", help="print only the JSON result")


def _parser() -> argparse.ArgumentParser:
    epilog = "Any config key can be overridden as --section.key=value (e.g. --sft.lr=1e-4)."
    parser = argparse.ArgumentParser(prog="hasten rft", description="Rejection-sampling fine-tuning (RFT).",
                                     epilog=epilog)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    datagen = commands.add_parser("datagen", help="sample, keep correct answers, write [question, answer, "
                                  "reasoning] records", epilog=epilog)
    _add_common(datagen)
    datagen.add_argument("--data", help="output JSON file (rft.data, default data/rft.json)")
    datagen.add_argument("--oversample", help="samples per question (rft.oversample, default 10)")
    datagen.add_argument("--temperature", help="sampling temperature (rft.temperature, default 0.6)")
    datagen.add_argument("--keep", help="one (first correct) or all (every distinct correct) (rft.keep)")
    for name, help_text in (("sft", "fine-tune on RFT records (LoRA by default)"),
                            ("compare", "run every SFT profile on the same records; table + JSON")):
        command = commands.add_parser(name, help=help_text, epilog=epilog)
        _add_common(command)
        command.add_argument("--data", help="RFT records (rft.data, default data/rft.json)")
        if name == "sft":
            command.add_argument("--profile", help="plain | conservative | balanced | aggressive")
            command.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted sft run (its newest "
                                 "checkpoint, or RUN_DIR/checkpoint-N) with its saved config")
        else:
            command.add_argument("--profiles", default="conservative,balanced,aggressive",
                                 help="comma list; plain always runs as the baseline")
            command.add_argument("--rounds", default="1", help="alternating rounds (median speed-up)")
            command.add_argument("--output-dir", help="where the runs go (default runs/<time>-rft-compare)")
    test = commands.add_parser("test", help="greedy held-out accuracy and answer rate", epilog=epilog)
    _add_common(test)
    test.add_argument("--num-examples", help="held-out questions (eval.num_examples, default 100)")
    return parser


def _pairs(args, extra: list[str]) -> list[tuple[str, object]]:
    from ..config import Raw, parse_overrides

    pairs = [(key, Raw(str(getattr(args, flag)))) for flag, key in FLAG_KEYS.items()
             if getattr(args, flag, None) is not None]
    return pairs + parse_overrides(extra)


def _print_result(args, lines: list[str], result: dict) -> None:
    if not args.json:
        print("\n".join(lines))
    print(json.dumps(result))


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _ensure_allocator(cfg) -> None:
    """Before torch is imported: the CLI process may re-execute itself on speed.allocator's malloc (never
    returns then), as `hasten train` does; a call from Python runs on what it has (the run logs it)."""
    if _PROCESS_ENTRY:
        from ..kernels.allocator import ensure

        ensure(cfg.speed.allocator)


def cmd_datagen(args, extra) -> int:
    from .datagen import run_datagen
    from .profiles import load_rft_config

    cfg = load_rft_config("datagen", args.config, _pairs(args, extra))
    _ensure_allocator(cfg)
    report = run_datagen(cfg, log=_log).to_dict()
    lines = [f"questions with >= 1 correct sample: {report['solved']}/{report['questions']} "
             f"({report['solved_fraction']:.3f}) at {cfg.rft.oversample} samples, temperature {cfg.rft.temperature}",
             f"correct samples: {report['correct_samples']}/{report['samples']} ({report['correct_fraction']:.3f})",
             f"records written: {report['records']} -> {report['path']} (keep={cfg.rft.keep})",
             f"generated {report['generated_tokens']} tokens in {report['seconds']:.1f} s "
             f"({report['tokens_per_second']:.0f} tok/s)"]
    _print_result(args, lines, {"model": cfg.model.name, "task": cfg.task.name, **report})
    return 0


def cmd_sft(args, extra) -> int:
    from .profiles import load_rft_config
    from .sft import run_sft

    if args.resume:
        from ..config import parse_overrides
        from ..train.loop import resume_config

        given = [f"--{name}" for name in ("config", "model", "task", "profile", "data") if getattr(args, name, None)]
        cfg = resume_config(args.resume, given, parse_overrides(extra))
    else:
        cfg = load_rft_config("sft", args.config, _pairs(args, extra), profile=args.profile)
    _ensure_allocator(cfg)
    report = run_sft(cfg, log=_log, profile=args.profile, resume=args.resume).to_dict()
    from ..train.distributed import is_main

    if not is_main():  # torchrun: rank 0 reports the run
        return 0
    examples, steps = report["examples"], report["optimizer_steps"]
    lines = [f"trained {examples} example{'' if examples == 1 else 's'}, {steps} optimizer step{'' if steps == 1 else 's'} in "
             f"{report['train_seconds']:.1f} s ({report['tokens_per_second']:.0f} tok/s); "
             f"loss {report['first_loss']:.4f} -> {report['final_loss']:.4f}",
             f"settings: {report['settings']}",
             f"checkpoint: {report['checkpoint']} ("
             + (f"{report['adapter_mb']:.1f} MB of LoRA adapters)" if report["lora"] else
                f"{report['model_mb']:.1f} MB model)")]
    if report["eval"]:
        lines.append(f"held-out: accuracy {report['eval'].get('accuracy', float('nan')):.3f}, answer rate "
                     f"{report['eval'].get('answer_rate', float('nan')):.3f} on {report['eval']['num_examples']}")
    _print_result(args, lines, report)
    return 0


def cmd_test(args, extra) -> int:
    from .evaluation import run_test
    from .profiles import load_rft_config

    cfg = load_rft_config("test", args.config, _pairs(args, extra))
    _ensure_allocator(cfg)
    metrics = run_test(cfg, log=_log)
    lines = [f"{key:>14}: {value:.4g}" if isinstance(value, float) else f"{key:>14}: {value}"
             for key, value in metrics.items()]
    _print_result(args, lines, {"model": cfg.model.name, "task": cfg.task.name, **metrics})
    return 0


def cmd_compare(args, extra) -> int:
    from .compare import CompareError, compare, default_output_dir, format_table
    from .profiles import load_rft_config

    load_rft_config("sft", args.config, _pairs(args, extra))  # check every flag before the first run
    try:
        rounds = int(args.rounds)
    except ValueError:
        raise CompareError(f"compare error: --rounds must be an integer (got {args.rounds!r})") from None
    sft_args = [item for flag in ("config", "model", "task", "data") if getattr(args, flag)
                for item in (f"--{flag}", getattr(args, flag))] + list(extra)
    output_dir = Path(args.output_dir) if args.output_dir else default_output_dir()
    profiles = [name.strip() for name in args.profiles.split(",") if name.strip()]
    result = compare(profiles, rounds, sft_args, output_dir, log=_log)
    _print_result(args, [format_table(result)], result)
    return 0


COMMANDS = {"datagen": cmd_datagen, "sft": cmd_sft, "test": cmd_test, "compare": cmd_compare}


def main(argv: list[str], process: bool = False) -> int:
    """argv after `hasten`: ["rft", COMMAND, ...] or ["sft", ...]. process: this is the `hasten` process
    itself (hasten/cli.py main() with no argv), which may re-execute on another allocator."""
    global _PROCESS_ENTRY
    _PROCESS_ENTRY = process
    parser = _parser()
    if argv[:1] == ["sft"]:
        argv = ["sft", *argv[1:]]
    elif argv[:1] == ["rft"]:
        argv = argv[1:]
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    return exit_code(lambda: COMMANDS[args.command](args, extra), "hasten sft --resume")
