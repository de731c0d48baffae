"""`hasten config [SECTION ...]`: every config key with its type, default, allowed values and help.

Generated from config.py (and config_jobs.py) itself, so it cannot drift: the keys and defaults
are the dataclasses', the types `config.type_name`'s, the allowed values
`CHOICES` and the range checks' own wording, and the help line is the
field's trailing comment in config.py or config_jobs.py (read from the source with
`tokenize`; tests/test_config_help.py checks every key has one). Per-task
defaults (config.TASK_DEFAULTS) are shown beside the key they change.

The docs' tables that list what the code offers are generated here too, so the docs cannot drift either:
`python -m hasten.config_help losses` prints the losses table of docs/running.md (algo/losses.py's
LOSSES, each loss's docstring); tests/test_docs_tables.py checks the docs hold exactly that text.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
import typing
from dataclasses import dataclass

from . import config, config_jobs


@dataclass
class KeyHelp:
    key: str  # section.name
    type: str
    default: object
    allowed: str  # choices or a range, "" when any value of the type goes
    help: str
    task_defaults: dict[str, object]  # task name -> its default, where TASK_DEFAULTS sets one


def field_comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the trailing comment on the field's line in config.py or config_jobs.py."""
    found: dict[tuple[str, str], str] = {}
    for module in (config, config_jobs):
        found.update(_module_comments(inspect.getsource(module)))
    return found


def _module_comments(source: str) -> dict[tuple[str, str], str]:
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    found: dict[tuple[str, str], str] = {}
    klass = None
    for number, line in enumerate(source.splitlines(), start=1):
        if line.startswith("class "):
            klass = line.split()[1].split("(")[0].rstrip(":")
        elif klass and line.startswith("    ") and not line.startswith("     ") and ":" in line:
            name = line.strip().split(":")[0]
            if name.isidentifier() and number in comments:
                found[(klass, name)] = comments[number]
    return found


def keys() -> list[KeyHelp]:
    """Every key of Config, in section and field order."""
    comments = field_comments()
    ranges = {key: requirement for key, _, requirement in config._RANGES}
    defaults = config.Config()
    out = []
    for section in dataclasses.fields(defaults):
        value = getattr(defaults, section.name)
        hints = typing.get_type_hints(type(value))
        for item in dataclasses.fields(value):
            key = f"{section.name}.{item.name}"
            allowed = " | ".join(config.CHOICES[key]) if key in config.CHOICES else ranges.get(key, "")
            tasks = {task: values[key] for task, values in config.TASK_DEFAULTS.items() if key in values}
            out.append(KeyHelp(key, config.type_name(hints[item.name]), getattr(value, item.name), allowed,
                               comments.get((type(value).__name__, item.name), ""), tasks))
    return out


def render(sections: list[str]) -> str:
    """The listing for `sections` (all when empty); ConfigError for an unknown section."""
    known = [section.name for section in dataclasses.fields(config.Config)]
    unknown = [name for name in sections if name not in known]
    if unknown:
        raise config.ConfigError(f"config error: unknown section '{unknown[0]}' (sections: {', '.join(known)})")
    lines, current = [], None
    for entry in keys():
        section = entry.key.split(".")[0]
        if sections and section not in sections:
            continue
        if section != current:
            lines.append(f"\n{section}:" if lines else f"{section}:")
            current = section
        default = "null" if entry.default is None else repr(entry.default)
        detail = f"  [{entry.allowed}]" if entry.allowed else ""
        tasks = "".join(f"; {task}: {value!r}" for task, value in entry.task_defaults.items())
        lines.append(f"  {entry.key}  ({entry.type}, default {default}{tasks}){detail}")
        lines.append(f"      {entry.help}")
    lines.append("\nSet any key in a YAML file (section: {key: value}) or as --section.key=value.")
    return "\n".join(lines)


def losses_table() -> str:
    """The markdown table of `algo.loss` values: LOSSES' names in order, each loss's docstring summary."""
    from .algo.losses import LOSSES  # torch: only when the table is asked for

    default = config.AlgoConfig().loss
    lines = ["| `algo.loss` | what it computes |", "|---|---|"]
    for name, function in LOSSES.items():
        summary = " ".join((inspect.getdoc(function) or "").split("\n\n")[0].split())
        lines.append(f"| `{name}`{' (default)' if name == default else ''} | {summary} |")
    return "\n".join(lines)


GENERATED = {"losses": losses_table}  # what `python -m hasten.config_help NAME` prints (docs' generated blocks)

if __name__ == "__main__":
    import sys

    for table in sys.argv[1:] or list(GENERATED):
        print(GENERATED[table]())
