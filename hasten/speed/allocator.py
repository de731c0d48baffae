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
`hasten train`, `bench`, `sft` and `rft` commands re-execute themselves once
(their own command line, sys.orig_argv), with LD_PRELOAD naming libtcmalloc_minimal,
before they import torch; `hasten compare`, `bench --ablate` and B5 start
each run's process with the LD_PRELOAD its config asks for. Code that calls
hasten from Python (the API, tests, `hasten eval`) cannot switch: there
`auto` means "whatever this process runs on", and a named allocator it does
not run on gets one line saying so. What ran is reported (`allocator` in the
run's summary, the bench's header).

Results do not change: an allocator places memory, it does not compute.
tests/test_allocator.py trains the same steps both ways and compares.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from ..config import CHOICES as CONFIG_CHOICES, ConfigError

CHOICES = CONFIG_CHOICES["speed.allocator"]  # auto | tcmalloc | glibc
LIBRARY = "tcmalloc_minimal"  # Debian/Ubuntu: apt install libtcmalloc-minimal4; Fedora: gperftools-libs
MARKER = "HASTEN_ALLOCATOR_REEXEC"  # "allocator:pid" on the re-executed process (same pid): never twice
INSTALL_HINT = "install it (Debian/Ubuntu: apt install libtcmalloc-minimal4) or set speed.allocator=glibc"


def _preload(env: dict[str, str] | None = None) -> list[str]:
    """LD_PRELOAD's entries (the loader splits on spaces and colons)."""
    return (os.environ if env is None else env).get("LD_PRELOAD", "").replace(":", " ").split()


def _preloaded_tcmalloc(env: dict[str, str] | None = None) -> str | None:
    """A tcmalloc already named in LD_PRELOAD (a user's, conda's: often a path ldconfig does not know)."""
    return next((part for part in _preload(env) if "libtcmalloc" in part), None)


def _checked(setting: str) -> str:
    if setting not in CHOICES:
        raise ConfigError(f"speed.allocator={setting!r}: expected one of {', '.join(CHOICES)}")
    return setting


def _not_found() -> ConfigError:
    where = INSTALL_HINT if sys.platform.startswith("linux") else "it is switched by LD_PRELOAD, on Linux only"
    return ConfigError(f"speed.allocator=tcmalloc: lib{LIBRARY}.so not found; {where}")


def find_tcmalloc() -> str | None:
    """The tcmalloc library to preload: one LD_PRELOAD already names, else the loader's (ldconfig), else None.

    Linux only: the switch is LD_PRELOAD, and loaded() reads /proc/self/maps (macOS's
    DYLD_INSERT_LIBRARIES is not supported, so `auto` stays on the system malloc there)."""
    if not sys.platform.startswith("linux"):
        return None
    return _preloaded_tcmalloc() or ctypes.util.find_library(LIBRARY)


def loaded() -> str:
    """The allocator this process runs on: "tcmalloc" when libtcmalloc is mapped, else "glibc"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "glibc"
    return "tcmalloc" if "libtcmalloc" in maps else "glibc"


def resolve(setting: str) -> str:
    """The allocator `setting` asks for in a fresh process: tcmalloc or glibc."""
    if _checked(setting) == "auto":
        return "tcmalloc" if find_tcmalloc() else "glibc"
    if setting == "tcmalloc" and not find_tcmalloc():
        raise _not_found()
    return setting


def check_in_process(setting: str, log: Callable[[str], None] = print) -> str:
    """For a process that cannot re-execute (the Python API, `hasten eval`, a compare or bench worker): the
    allocator it runs on. Where `setting` names another, one line says so: speed and memory differ from
    what was asked, results do not (an allocator places memory, it does not compute)."""
    current = loaded()
    if _checked(setting) != "auto" and setting != current:
        how = (f"LD_PRELOAD={find_tcmalloc() or f'lib{LIBRARY}.so.4'}" if setting == "tcmalloc"
               else "LD_PRELOAD without libtcmalloc")
        log(f"speed.allocator={setting}: this process runs on {current} and cannot switch (an allocator is "
            f"chosen at start: the `hasten train` command re-executes itself, Python needs {how})")
    return current


def environment(wanted: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) whose LD_PRELOAD gives `wanted` to a new process (and without
    the re-execution marker: a child's own `ensure` must not take its parent's re-execution for its own)."""
    env = dict(os.environ if env is None else env)
    env.pop(MARKER, None)
    rest = " ".join(part for part in _preload(env) if "libtcmalloc" not in part)
    if wanted == "tcmalloc":
        library = _preloaded_tcmalloc(env) or find_tcmalloc()
        if library is None:
            raise _not_found()
        rest = f"{library} {rest}".strip()
        # gperftools documents a stderr report of every allocation above 1 GB (a 1B+ model's embedding,
        # its AdamW state); Debian's 2.10 build printed none for 8 GB here. Either way: never.
        env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 62))
    if rest:
        env["LD_PRELOAD"] = rest
    else:
        env.pop("LD_PRELOAD", None)
    return env


def ensure(setting: str) -> str:
    """Make this CLI process run on the allocator `setting` asks for: return it when it already does, else
    re-execute the process's own command line (sys.orig_argv: interpreter flags, console script or -m)
    with LD_PRELOAD set; that never returns."""
    # exec keeps the pid: the marker is ours only if it names this pid (a leaked one names a parent's)
    reexecuted = os.environ.pop(MARKER, "").rpartition(":")[2] == str(os.getpid())
    wanted = resolve(setting)
    current = loaded()
    if wanted == current:
        return current
    if reexecuted:  # re-executed already and still not on it
        advice = "set speed.allocator=glibc" if wanted == "tcmalloc" else f"is tcmalloc linked into {sys.executable}?"
        raise ConfigError(f"speed.allocator={setting}: re-executed with LD_PRELOAD="
                          f"{os.environ.get('LD_PRELOAD', '')!r}, this process still runs on {current}; {advice}")
    env = environment(wanted)
    env[MARKER] = f"{wanted}:{os.getpid()}"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable")  # pragma: no cover
