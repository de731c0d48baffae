"""Which malloc the process runs on (speed.allocator): tcmalloc where installed, else mimalloc, else glibc.

Why: the learning pass allocates a few GB of activations and logits whose
sizes change every step (packed width, completion lengths, token count).
With glibc and speed.keep_freed_memory (everything in the heap, never
trimmed) those changing sizes fragment the heap: in a bf16 run the resident
memory keeps growing while the memory in use stays flat, and each growing step
pays seconds of page faults. Fed the same rollout every step (same shapes)
glibc's heap stops growing, so shape variety is the cause; bucketing the shapes
only halved the growth. tcmalloc keeps freed memory in size classes, so those
sizes find their pages again (docs/results/speedups-notes.md has the figures).

tcmalloc is a system library that fresh machines lack, so `auto` falls back
on mimalloc from the `cmeel-mimalloc` wheel (a default dependency on Linux
x86-64, 0.5 MB), kept from returning freed pages (MIMALLOC_PURGE_DELAY=-1):
with its default purging every learning pass re-faults its pages; kept, its
learning passes run as tcmalloc's. The wheel's library needs libatomic.so.1, so it is tried in a
throwaway process first and `auto` passes over it where it does not load.

How: an allocator is chosen when the process starts (LD_PRELOAD), so the
`hasten train`, `bench`, `sft` and `rft` commands re-execute themselves once
(their own command line, sys.orig_argv), with LD_PRELOAD naming the library,
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
import functools
import importlib.metadata
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from ..config import CHOICES as CONFIG_CHOICES, ConfigError

CHOICES = CONFIG_CHOICES["speed.allocator"]  # auto | tcmalloc | mimalloc | glibc
PRELOADED = ("tcmalloc", "mimalloc")  # the ones LD_PRELOAD switches to, in auto's order of preference
SONAME = {"tcmalloc": "tcmalloc_minimal", "mimalloc": "mimalloc"}  # ctypes.util.find_library's names
MIMALLOC_WHEEL = "cmeel-mimalloc"  # PyPI: the library under site-packages/cmeel.prefix/lib
MARKER = "HASTEN_ALLOCATOR_REEXEC"  # "allocator:pid" on the re-executed process (same pid): never twice
# Set in the re-executed process unless the user set them. tcmalloc: gperftools documents a stderr report
# of every allocation above 1 GB (a 1B+ model's embedding, its AdamW state); never. mimalloc: never give
# freed pages back, as glibc with speed.keep_freed_memory and tcmalloc do (the measurement is above).
TUNING = {"tcmalloc": {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 62)},
          "mimalloc": {"MIMALLOC_PURGE_DELAY": "-1"}}
INSTALL_HINTS = {
    "tcmalloc": "install it (Debian/Ubuntu: apt install libtcmalloc-minimal4) or set speed.allocator=glibc",
    "mimalloc": f"pip install {MIMALLOC_WHEEL} (its library needs libatomic.so.1: Debian/Ubuntu apt install "
                "libatomic1) or set speed.allocator=glibc",
}


def _preload(env: dict[str, str] | None = None) -> list[str]:
    """LD_PRELOAD's entries (the loader splits on spaces and colons)."""
    return (os.environ if env is None else env).get("LD_PRELOAD", "").replace(":", " ").split()


def _names(entry: str) -> str | None:
    """The allocator an LD_PRELOAD entry or a mapped file is (by its file name), or None."""
    stem = Path(entry).name
    return next((name for name in PRELOADED if stem.startswith(f"lib{name}")), None)


def _preloaded(name: str, env: dict[str, str] | None = None) -> str | None:
    """`name`'s library already named in LD_PRELOAD (a user's, conda's: often a path ldconfig does not know)."""
    return next((part for part in _preload(env) if _names(part) == name), None)


def _checked(setting: str) -> str:
    if setting not in CHOICES:
        raise ConfigError(f"speed.allocator={setting!r}: expected one of {', '.join(CHOICES)}")
    return setting


def _not_found(name: str) -> ConfigError:
    if not sys.platform.startswith("linux"):
        return ConfigError(f"speed.allocator={name}: it is switched by LD_PRELOAD, on Linux only")
    tried = [f"{library}: {why}" for library in _candidates(name) if (why := preload_error(library))]
    found = f"{tried[0]}" if tried else f"lib{SONAME[name]}.so not found"
    return ConfigError(f"speed.allocator={name}: {found}; {INSTALL_HINTS[name]}")


def _wheel_mimalloc() -> str | None:
    """libmimalloc.so from the cmeel-mimalloc wheel, when it is installed."""
    try:
        files = importlib.metadata.distribution(MIMALLOC_WHEEL).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    libraries = sorted((file for file in files if re.fullmatch(r"libmimalloc\.so(\.\d+)*", file.name)),
                       key=lambda file: len(file.name))
    for file in libraries:
        path = Path(str(file.locate())).resolve()
        if path.is_file():
            return str(path)
    return None


def _candidates(name: str) -> list[str]:
    """Where `name`'s library may be, in order: the wheel's (mimalloc), then the loader's (ldconfig)."""
    found = [_wheel_mimalloc() if name == "mimalloc" else None, ctypes.util.find_library(SONAME[name])]
    return list(dict.fromkeys(library for library in found if library))


@functools.lru_cache(maxsize=None)
def preload_error(library: str) -> str | None:
    """None when a new process started with LD_PRELOAD=`library` runs on it, else why not (the loader's
    first line: a missing libatomic.so.1, a wrong architecture). Tried once per library and process."""
    probe = f"import sys; sys.exit(0 if {Path(library).name.split('.so')[0]!r} in open('/proc/self/maps').read() else 3)"
    env = {key: value for key, value in os.environ.items() if key not in (MARKER, "LD_PRELOAD")}
    try:
        result = subprocess.run([sys.executable, "-S", "-c", probe], env={**env, "LD_PRELOAD": library},
                                capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"could not be tried ({error})"
    if result.returncode == 0:
        return None
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    return lines[0] if lines else "a process started with it in LD_PRELOAD does not run on it"


def find(name: str) -> str | None:
    """The library to preload for `name` (tcmalloc | mimalloc): one LD_PRELOAD already names, else the
    first of its candidates that a new process loads, else None.

    Linux only: the switch is LD_PRELOAD, and loaded() reads /proc/self/maps (macOS's
    DYLD_INSERT_LIBRARIES is not supported, so `auto` stays on the system malloc there)."""
    if not sys.platform.startswith("linux"):
        return None
    preloaded = _preloaded(name)
    if preloaded:
        return preloaded
    if name == "tcmalloc":  # a system library: the loader resolves its dependencies as it found it
        return ctypes.util.find_library(SONAME[name])
    return next((library for library in _candidates(name) if preload_error(library) is None), None)


def loaded() -> str:
    """The allocator this process runs on: "tcmalloc" or "mimalloc" when its library is mapped, else "glibc"."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "glibc"
    mapped = {_names(line.rpartition(" ")[2]) for line in maps.splitlines()}
    return next((name for name in PRELOADED if name in mapped), "glibc")


def resolve(setting: str) -> str:
    """The allocator `setting` asks for in a fresh process: tcmalloc, mimalloc or glibc."""
    if _checked(setting) == "auto":
        return next((name for name in PRELOADED if find(name)), "glibc")
    if setting in PRELOADED and not find(setting):
        raise _not_found(setting)
    return setting


def check_in_process(setting: str, log: Callable[[str], None] = print) -> str:
    """For a process that cannot re-execute (the Python API, `hasten eval`, a compare or bench worker): the
    allocator it runs on. Where `setting` names another, one line says so: speed and memory differ from
    what was asked, results do not (an allocator places memory, it does not compute)."""
    current = loaded()
    if _checked(setting) != "auto" and setting != current:
        how = (f"LD_PRELOAD={find(setting) or f'lib{SONAME[setting]}.so'}" if setting in PRELOADED
               else "LD_PRELOAD without " + " or ".join(f"lib{name}" for name in PRELOADED))
        log(f"speed.allocator={setting}: this process runs on {current} and cannot switch (an allocator is "
            f"chosen at start: the `hasten train` command re-executes itself, Python needs {how})")
    return current


def environment(wanted: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `env` (default os.environ) whose LD_PRELOAD gives `wanted` to a new process (and without
    the re-execution marker: a child's own `ensure` must not take its parent's re-execution for its own)."""
    env = dict(os.environ if env is None else env)
    env.pop(MARKER, None)
    rest = [part for part in _preload(env) if _names(part) is None]
    if wanted in PRELOADED:
        library = _preloaded(wanted, env) or find(wanted)
        if library is None:
            raise _not_found(wanted)
        rest.insert(0, library)
        for key, value in TUNING[wanted].items():
            env.setdefault(key, value)
    if rest:
        env["LD_PRELOAD"] = " ".join(rest)
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
        advice = "set speed.allocator=glibc" if wanted != "glibc" else f"is {current} linked into {sys.executable}?"
        raise ConfigError(f"speed.allocator={setting}: re-executed with LD_PRELOAD="
                          f"{os.environ.get('LD_PRELOAD', '')!r}, this process still runs on {current}; {advice}")
    env = environment(wanted)
    env[MARKER] = f"{wanted}:{os.getpid()}"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable")  # pragma: no cover
