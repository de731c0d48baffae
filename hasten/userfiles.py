"""Loading a name from a user's Python file (`path/to/file.py:name`): reward functions, tools, environments.

One loader, so every kind of user file fails the same way: a one-line error of the caller's kind
(`reward error: ...`, `tool error: ...`) naming the file, never a traceback from the import. Each file
gets a module name made from its resolved path, so two files that share a base name
(rewards/a/reward.py, rewards/b/reward.py) do not replace each other in sys.modules.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from .errors import UserError


def one_line(error: BaseException) -> str:
    """'ExcType: first line of the message', so an error stays one line."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def check_source(path_text: str, kind: str, error: type[UserError]) -> None:
    """A user file that is missing or does not parse: the one line load_attribute would give, found without
    running the file (or importing what it imports): the CLI says it before torch is imported."""
    path = Path(path_text)
    if not path.is_file():
        raise error(f"{kind} error: '{path_text}' does not exist")
    try:
        compile(path.read_bytes(), str(path), "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        raise error(f"{kind} error: importing {path_text} failed: {one_line(exc)}") from None


def load_attribute(path_text: str, name: str, kind: str, error: type[UserError], what: str = "") -> Any:
    """The attribute `name` of the Python file at `path_text`; `error(f"{kind} error: ...")` if it cannot be had.
    what: a word for the attribute in the message ("function": "has no function 'f'")."""
    path = Path(path_text)
    if not path.is_file():
        raise error(f"{kind} error: '{path_text}' does not exist")
    module_name = f"hasten_user_{kind}_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{kind} error: {path_text} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file may raise anything at import time
        sys.modules.pop(module_name, None)
        raise error(f"{kind} error: importing {path_text} failed: {one_line(exc)}") from None
    if not hasattr(module, name):
        raise error(f"{kind} error: {path_text} has no {what + ' ' if what else ''}'{name}'")
    return getattr(module, name)
