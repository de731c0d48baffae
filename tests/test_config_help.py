"""`hasten config`: every key with type, default, allowed values and a help line, from config.py itself."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from hasten.cli import main
from hasten.config import Config
from hasten.config_help import keys, render


def test_every_key_is_listed_with_a_help_line():
    listed = {entry.key: entry for entry in keys()}
    expected = {f"{section.name}.{item.name}" for section in dataclasses.fields(Config())
                for item in dataclasses.fields(getattr(Config(), section.name))}
    assert set(listed) == expected
    assert [key for key, entry in listed.items() if not entry.help] == []


def test_listing_shows_type_default_choices_and_task_defaults():
    text = render(["train", "algo"])
    assert "train.lr_schedule  (str, default 'cosine')  [cosine | linear | constant]" in text
    assert "train.lr  (float, default 1e-06; fruit-catcher: 0.003)  [> 0]" in text
    assert "algo.loss  (str, default 'dapo')  [grpo | bnpo | dr_grpo | dapo | gspo | cispo | sapo | luspo | vespo]" in text
    assert "speed." not in text


def test_cli_config_command(capsys):
    assert main(["config", "generation"]) == 0
    assert "generation.min_p  (float, default 0.0)" in capsys.readouterr().out
    assert main(["config", "nope"]) == 2
    assert "unknown section 'nope'" in capsys.readouterr().err


def test_cli_config_does_not_import_torch():
    code = "import sys; from hasten.cli import main; main(['config']); assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
