"""Reading config text: a YAML file and the command line's `--section.key=value` overrides.

Both become (section.key, value) pairs that hasten/config.py sets on the dataclasses in order
(later pairs win), each value made the field's type by `coerce` (below) or one error naming the key. Two choices are made here: a key given twice in one
YAML mapping is an error (plain YAML keeps the later value silently), and an override's text
stays a `Raw` string until the field it sets is known (`Raw.parse`), so a str field takes the
text as it is. `MOVED` is the one table of old key names: keys that left `speed` because they
change what is learned (a `speed` switch never does: tests/test_speed_exact.py).
"""

from __future__ import annotations

import math
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from .errors import ConfigError


# Old name -> new name. Each of these changes what is learned, so it left `speed` for the section where a
# reader expects a trade: the algorithm, the sampler, or the optimizer's numerics. The old name still sets
# the new key (YAML, overrides, profiles, the Python API), with one line per old name per process.
_ALGO = ("dynamic_sampling", "dynamic_sampling_max_rounds", "curriculum", "curriculum_warmup_steps", "gate_reward",
         "gate_threshold", "gate_failed_reward", "async_steps", "vllm_importance_sampling_correction",
         "vllm_importance_sampling_cap")
MOVED: dict[str, str] = {
    **{f"speed.{name}": f"algo.{name}" for name in _ALGO},
    "speed.generation_precision": "generation.precision",
    **{f"speed.{name}": f"train.{name}" for name in ("precision", "attention_fp32", "tf32", "optimizer_moments")},
}
_TOLD: set[str] = set()  # old names already announced in this process


def current_name(key: str) -> str:
    """The key's name today: a MOVED old name -> its new one, with one deprecation line the first time."""
    new = MOVED.get(key)
    if new is None:
        return key
    if key not in _TOLD:
        _TOLD.add(key)
        print(f"config: {key} is now {new} (the old name still works for now)", file=sys.stderr)
    return new


class Raw(str):
    """Override text from the command line, read according to the field it sets.

    A str field takes the text as it is (so `--output.progress=off` stays "off"
    rather than YAML's boolean), except `null` for an optional field; any other
    field reads it as a YAML scalar or list.
    """

    def parse(self, tp: Any) -> Any:
        import yaml

        text = str(self)
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        if text in ("null", "~", "None") and type(None) in args:
            return None
        # A str field keeps the text; `int | str` (token_budget: a number or auto) and `bool | str` (true, false
        # or auto) take the number or boolean YAML reads in it, where the field takes that type, else the text.
        others = tuple(arg for arg in args if arg not in (str, type(None)))
        if str in args and not others:
            return text
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            return text
        if str in args:
            return value if type(value) in others else text
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" as a string; plain float syntax is fine here
            try:
                return float(value)
            except ValueError:
                return value
        return value


def parse_override(text: str) -> tuple[str, Raw]:
    """'train.lr=1e-6' -> ('train.lr', Raw('1e-6')); the value is typed when it is set."""
    if "=" not in text:
        raise ConfigError(f"config error: override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip().removeprefix("--"), Raw(raw)


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int, first: int):
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


def _unique_key_loader() -> type:
    """yaml's SafeLoader, except that a key given twice in one mapping raises _DuplicateKey.

    Plain YAML keeps the later value silently, so a config edited in two places would train
    on whichever came last.
    """
    import yaml

    def construct_mapping(loader, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(str(key), line, seen[key])
            seen[key] = line
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    loader = type("UniqueKeyLoader", (yaml.SafeLoader,), {})
    loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return loader


def read_file(path: str | Path) -> list[tuple[str, Any]]:
    """A config file's (section.key, value) pairs in file order; ConfigError for a missing file, text that is
    not YAML, a key given twice, or anything but a mapping of section mappings."""
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config error: config file '{path}' is a directory")
    if not path.is_file():
        raise ConfigError(f"config error: config file '{path}' does not exist")
    try:
        data = yaml.load(path.read_text(), Loader=_unique_key_loader()) or {}
    except _DuplicateKey as duplicate:
        raise ConfigError(f"config error: {path} line {duplicate.line}: key '{duplicate.key}' is given twice "
                          f"(first on line {duplicate.first}); keep one") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config error: {path}{where} is not valid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config error: {path} must hold a mapping of sections")
    pairs: list[tuple[str, Any]] = []
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"config error: '{section}' in {path} must be a mapping of keys")
        pairs += [(f"{section}.{key}", value) for key, value in values.items()]
    return pairs


def parse_overrides(extra: list[str]) -> list[tuple[str, object]]:
    """Command-line leftovers -> (key, value) pairs; accepts --section.key=value and --section.key value."""
    pairs, index = [], 0
    while index < len(extra):
        item = extra[index]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"config error: unrecognized argument '{item}' (overrides look like --train.lr=1e-6)")
        if "=" not in item:
            if index + 1 >= len(extra):
                raise ConfigError(f"config error: {item[2:]} needs a value")
            item = f"{item}={extra[index + 1]}"
            index += 1
        pairs.append(parse_override(item[2:]))
        index += 1
    return pairs


# ------------------------------------------------------------------ values to a field's type

def type_name(tp: Any) -> str:
    """A config type as `hasten config` and errors spell it: "int or null", "list of str"."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Return `value` as type `tp`, or raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(key, value, arg)
            except ConfigError:
                pass
        raise ConfigError(f"config error: {key} must be {type_name(tp)} (got {value!r})")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config error: {key} must be {type_name(tp)} (got {value!r})")
        (item_tp,) = typing.get_args(tp)
        return [coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads `lr: 1e-5` (no dot) as a string; every user means the number
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:  # free-form (chat template variables): string keys, YAML-safe values
        if isinstance(value, dict) and all(isinstance(name, str) for name in value):
            return dict(value)
    raise ConfigError(f"config error: {key} must be {type_name(tp)} (got {value!r})")
