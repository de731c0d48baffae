"""Which malloc the process runs on (speed.allocator): tcmalloc where installed, else glibc.

Why: the learning pass allocates a few GB of activations and logits whose
sizes change every step (packed width, completion lengths, token count).
With glibc and speed.keep_freed_memory (everything in the heap, never
trimmed) those changing sizes fragment the heap: in a bf16 B1 run the heap
grew by 200-600 MB about every other step (6.1 -> 12.7 GB resident over 59
steps) while the memory in use stayed at 4.5-5 GB, and each growing step
paid 0.5-1.7 s of page faults. Fed the same rollout every step (same
shapes) glibc's heap stopped growing after two steps, so shape variety is
the cause; bucketing the shapes only halved the growth. tcmalloc keeps
freed memory in size classes, so those sizes find their pages again:
14 bf16 steps grew 5640 -> 6021 MiB (one growth step), learning passes
2.8-3.2 s against glibc's 2.9-3.1 s (4.0 s on growth steps); fp32 stayed
flat at 6732 MiB against glibc's 7375 (docs/speedups.md has the table).

How: an allocator is chosen when the process starts (LD_PRELOAD), so the
`hasten train` and `hasten bench` commands re-execute themselves once, with
LD_PRELOAD naming libtcmalloc_minimal, before they import torch. Code that
calls hasten from Python (the API, tests) cannot switch: there `auto` means
"whatever this process runs on", and asking for tcmalloc where it is not
loaded is an error that says how to launch. What ran is reported
(`allocator` in the run's summary, the bench's machine line).

Results do not change: an allocator places memory, it does not compute.
tests/test_allocator.py trains the same steps both ways and compares.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

from ..config import ConfigError

CHOICES = ("auto", "tcmalloc", "glibc")
LIBRARY = "tcmalloc_minimal"  # Debian/Ubuntu: apt install libtcmalloc-minimal4; Fedora: gperftools-libs
MARKER = "HASTEN_ALLOCATOR_REEXEC"  # set on the re-executed process: never re-execute twice
INSTALL_HINT = "install it (Debian/Ubuntu: apt install libtcmalloc-minimal4) or set speed.allocator=glibc"


def find_tcmalloc() -> str | None:
    """The tcmalloc shared library's name as the loader finds it (ldconfig's cache), or None.

    Linux only: the switch is LD_PRELOAD, and loaded() reads /proc/self/maps (macOS's
    DYLD_INSERT_LIBRARIES is not supported, so `auto` stays on the system malloc there)."""
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.util.find_library(LIBRARY)


def loaded() -> str:
    """The allocator this process runs on: "tcmalloc" when libtcmalloc is mapped, else "glibc"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "glibc"
    return "tcmalloc" if "libtcmalloc" in maps else "glibc"


def resolve(setting: str) -> str:
    """The allocator `setting` asks for in a fresh process: tcmalloc or glibc."""
    if setting not in CHOICES:
        raise ConfigError(f"speed.allocator={setting!r}: expected one of {', '.join(CHOICES)}")
    if setting == "auto":
        return "tcmalloc" if find_tcmalloc() else "glibc"
    if setting == "tcmalloc" and not find_tcmalloc():
        raise ConfigError(f"speed.allocator=tcmalloc: lib{LIBRARY}.so not found; {INSTALL_HINT}")
    return setting


def check_in_process(setting: str) -> str:
    """For a process that cannot re-execute (the Python API, tests): the allocator it runs on, or an
    error where `setting` names one it does not run on."""
    if setting not in CHOICES:
        raise ConfigError(f"speed.allocator={setting!r}: expected one of {', '.join(CHOICES)}")
    current = loaded()
    if setting != "auto" and setting != current:
        raise ConfigError(f"speed.allocator={setting}: this process runs on {current} and cannot switch; "
                          f"launch it with the `hasten` command, or start python with "
                          + (f"LD_PRELOAD=lib{LIBRARY}.so.4" if setting == "tcmalloc" else "LD_PRELOAD unset")
                          + ", or set speed.allocator=auto")
    return current


def _preload_without_tcmalloc(value: str) -> str:
    return " ".join(part for part in value.replace(":", " ").split() if "libtcmalloc" not in part)


def environment(wanted: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) whose LD_PRELOAD gives `wanted` to a new process."""
    env = dict(os.environ if env is None else env)
    rest = _preload_without_tcmalloc(env.get("LD_PRELOAD", ""))
    if wanted == "tcmalloc":
        library = find_tcmalloc()
        if library is None:
            raise ConfigError(f"speed.allocator=tcmalloc: lib{LIBRARY}.so not found; {INSTALL_HINT}")
        rest = f"{library} {rest}".strip()
        # gperftools documents a stderr report of every allocation above 1 GB (a 1B+ model's embedding,
        # its AdamW state); Debian's 2.10 build printed none for 8 GB here. Either way: never.
        env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 62))
    if rest:
        env["LD_PRELOAD"] = rest
    else:
        env.pop("LD_PRELOAD", None)
    return env


def ensure(setting: str, argv: list[str]) -> str:
    """Make this CLI process run on the allocator `setting` asks for: return it when it already does,
    else re-execute `python -m hasten.cli *argv` with LD_PRELOAD set (never returns)."""
    wanted = resolve(setting)
    current = loaded()
    if wanted == current:
        return current
    if os.environ.get(MARKER):  # re-executed already and still not on it: the preload failed
        raise ConfigError(f"speed.allocator={setting}: LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r} "
                          f"did not give this process {wanted}; set speed.allocator=glibc")
    env = environment(wanted)
    env[MARKER] = wanted
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "hasten.cli", *argv], env)
    raise AssertionError("unreachable")  # pragma: no cover
