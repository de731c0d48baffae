"""Every command the docs show runs: each `hasten ...` line in a ```bash block of README.md or
docs/*.md, and their ```python blocks, on the tiny model, offline, in seconds.

The rule (README.md, "Tests", says the same):
- A `hasten` line (with its `\\` continuation lines) in a ```bash block is run, with `hasten` replaced
  by an in-process `hasten.cli.main`, in a fresh directory per doc file (so `data/rft.json` written by
  one command is read by the next) that holds a link to the repository's `configs/`.
- Before it runs, the tiny settings of its subcommand (TINY below) are appended: the model becomes
  `tiny` and the run one step (or one SFT step, 2 datagen questions, 2 held-out questions), small
  enough to run in seconds. A model directory that an earlier command of the same doc wrote is kept
  (the agentic recipe trains GRPO from the SFT step's checkpoint), so a command that reads a path no
  earlier command writes fails. Being last, they override the doc's own values; everything else (the
  preset file, the task, the profile, LoRA, tools, ...) runs as the doc wrote it. `hasten tasks`,
  `hasten models` and `hasten config` run as they are.
- A command that cannot run that way (the real model's weights or minutes of training are its point,
  it needs a GPU, vLLM, TRL or the network, or it names a file or a run the reader makes first, such
  as `runs/<run>`) carries the mark `not run by tests: <reason>` in its trailing comment, or the
  block that holds it is preceded by the line `<!-- not run by tests: <reason> -->`. The test fails
  for a command without the mark that does not run, and checks that every skipped one has a reason.
- A ```python block of README.md or docs/*.md runs as it is unless preceded by that line, on the tiny
  model: `model="smollm2-135m"` becomes `model="tiny"` and `max_steps=N` becomes `max_steps=1` (as TINY
  does for commands), in a fresh directory per block.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "not run by tests:"
BLOCK_MARK = re.compile(r"^<!-- not run by tests: (.+?) -->$")

# Appended to a command by its subcommand (the first word after `hasten`, two for `rft`).
TINY = {
    "train": ["--model.name=tiny", "--train.steps=1", "--train.prompts_per_step=2",
              "--generation.num_generations=2", "--generation.max_new_tokens=8", "--eval.num_examples=2",
              "--eval.max_new_tokens=8", "--eval.at_start=false", "--task.num_train=8", "--task.num_eval=2",
              "--output.progress=off", "--output.plot=false"],
    "sft": ["--model.name=tiny", "--sft.max_steps=1", "--sft.max_examples=2", "--sft.batch_size=2",
            "--sft.gradient_accumulation_steps=1", "--eval.num_examples=2", "--eval.max_new_tokens=8",
            "--task.num_train=8", "--task.num_eval=2", "--output.progress=off", "--output.plot=false"],
    "eval": ["--model.name=tiny", "--eval.num_examples=2", "--eval.max_new_tokens=8"],
    "rft datagen": ["--model.name=tiny", "--task.num_train=2", "--rft.oversample=2", "--rft.max_new_tokens=8"],
    "rft test": ["--model.name=tiny", "--num-examples=2", "--eval.max_new_tokens=8"],
    "tasks": [], "models": [], "config": [],
}


@dataclass
class Command:
    where: str  # doc:line
    words: list[str]  # after `hasten`, without the trailing comment
    skip: str | None  # the mark's reason; None: the test runs it

    @property
    def subcommand(self) -> str:
        return " ".join(self.words[:2]) if self.words[:1] == ["rft"] else (self.words[0] if self.words else "")


def documented(path: Path) -> tuple[list[Command], list[tuple[str, str, str | None]]]:
    """The `hasten` commands of `path`'s bash blocks and its python blocks (where, code, skip reason)."""
    commands, snippets = [], []
    lines = path.read_text().splitlines()
    index, previous = 0, ""
    while index < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[index])
        if not fence:
            if lines[index].strip():
                previous = lines[index].strip()
            index += 1
            continue
        language, start = fence.group(1), index + 1
        end = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
        block_mark = BLOCK_MARK.match(previous)
        block_skip = block_mark.group(1) if block_mark else None
        if language == "python":
            snippets.append((f"{path.name}:{start}", "\n".join(lines[start:end]), block_skip))
        elif language == "bash":
            line = start
            while line < end:
                text, first = lines[line], line
                while text.rstrip().endswith("\\") and line + 1 < end:
                    line += 1
                    text = text.rstrip()[:-1] + " " + lines[line].strip()
                line += 1
                if text.startswith("hasten "):
                    comment = text.split(" # ", 1)[1] if " # " in text else ""
                    skip = comment.split(MARK, 1)[1].strip(" )") if MARK in comment else block_skip
                    words = shlex.split(text, comments=True)[1:]
                    commands.append(Command(f"{path.name}:{first + 1}", words, skip))
        index, previous = end + 1, ""
    return commands, snippets


COMMANDS = [command for path in DOCS for command in documented(path)[0]]
SNIPPETS = [snippet for path in DOCS for snippet in documented(path)[1]]
# What a snippet's own values become, as TINY does for commands: the tiny model, one step.
SNIPPET_TINY = ((re.compile(r'model="smollm2-135m"'), 'model="tiny"'), (re.compile(r"max_steps=\d+"), "max_steps=1"))


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The commands run in this process and may set torch's thread count (train.num_threads): restore it."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_docs_show_commands():
    assert len(COMMANDS) > 40 and sum(command.skip is None for command in COMMANDS) >= 10


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.skip is not None], ids=lambda c: c.where)
def test_a_command_not_run_says_why(command):
    assert command.skip, f"{command.where}: the mark needs a reason"


def runnable_by_doc() -> dict[str, list[Command]]:
    """doc name -> its unmarked commands; one shown again in a later doc (running.md repeats README's
    quick start) runs once, where it is shown first."""
    found: dict[str, list[Command]] = {}
    seen: set[tuple[str, ...]] = set()
    for command in COMMANDS:
        if command.skip is None and tuple(command.words) not in seen:
            seen.add(tuple(command.words))
            found.setdefault(command.where.split(":")[0], []).append(command)
    return found


def named_model(words: list[str]) -> str | None:
    """The model a command names (--model X, --model=X, --model.name X or --model.name=X), if any."""
    for index, word in enumerate(words):
        for flag in ("--model", "--model.name"):
            if word == flag and index + 1 < len(words):
                return words[index + 1]
            if word.startswith(flag + "="):
                return word.split("=", 1)[1]
    return None


def tiny_settings(command: Command) -> list[str]:
    """TINY's settings for the command; a model directory an earlier command of the doc wrote (the agentic
    recipe's SFT checkpoint) is kept, so the path one command writes is the path the next one reads."""
    model = named_model(command.words)
    assert model is None or not model.startswith("runs/") or Path(model).is_dir(), (
        f"{command.where}: {model} is written by no command before it in the doc")
    if model is not None and Path(model).is_dir():
        return [setting for setting in TINY[command.subcommand] if not setting.startswith("--model.name=")]
    return TINY[command.subcommand]


@pytest.mark.parametrize("doc", sorted(runnable_by_doc()))
def test_documented_commands_run_on_tiny(doc, tmp_path, monkeypatch):
    """The doc's unmarked commands, in order, each rewritten by TINY; every one exits 0."""
    from hasten.cli import main

    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    for command in runnable_by_doc()[doc]:
        assert command.subcommand in TINY, (
            f"{command.where}: `hasten {' '.join(command.words)}` has no tiny settings in TINY; add them "
            f"or mark it '# {MARK} <reason>'")
        code = main([*command.words, *tiny_settings(command)])
        assert code == 0, f"{command.where}: `hasten {' '.join(command.words)}` exited {code}"


@pytest.mark.parametrize("where, code, skip", SNIPPETS, ids=[snippet[0] for snippet in SNIPPETS])
def test_documented_python_runs(where, code, skip, tmp_path, monkeypatch):
    if skip is not None:
        assert skip, f"{where}: the mark needs a reason"
        return
    for pattern, tiny in SNIPPET_TINY:
        code = pattern.sub(tiny, code)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})


def test_the_docs_python_blocks_are_all_collected():
    """docs/*.md's blocks are run too, not README's alone (issue 56: docs/agentic.md's did not run as written)."""
    assert {where.split(":")[0] for where, _, _ in SNIPPETS} >= {"README.md", "agentic.md", "trl.md", "running.md"}


def test_the_readme_is_a_front_door():
    """README.md stays <= 300 lines (issue 52); detail lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_readme_installs_as_the_makefile_does():
    """The README's install lines are the Makefile's recipe, in its order: the venv, pip's upgrade, the three
    pip lines (issue 56: a newcomer following the README got an old pip and no venv)."""
    recipe = (ROOT / "Makefile").read_text().split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    made = [line.strip().replace("$(BIN)/", "").replace(" -q", "") for line in recipe.splitlines()
            if "pip install" in line]
    readme = (ROOT / "README.md").read_text()
    shown = [line.split("#")[0].strip() for line in readme.splitlines() if line.startswith("pip install")]
    assert made and shown[:len(made)] == made
    assert "python3 -m venv .venv && . .venv/bin/activate" in readme and "-m venv $(VENV)" in recipe
    assert "pip check" in readme and "--no-deps" in readme
