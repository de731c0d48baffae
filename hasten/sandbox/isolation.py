"""Isolation steps for the sandboxed process tree (docs/sandbox.md says what each one stops).

Each step records in `layers` whether it held. With `strict` (the default:
code.sandbox_fallback off) a refused namespace or mount step raises Refused,
and the worker runs nothing; with the fallback opted in, the run goes on
with the layers that held. Standard library only (imported by worker.py
under python -I -S).
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import struct
import time

import seccomp  # top-level modules in the worker (python -I -S); see worker.py
import world

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER, PR_SET_CHILD_SUBREAPER = 22, 2, 36
UID_BASE = 0x70000000  # execution uids when root without a wide subordinate range: 0x70000000 + A's pid
PID_SPAN = 1 << 22  # the largest pid_max
SIGNALS_PENDING = 64  # queued signals an execution may hold (real-time ones, mostly); Python needs a handful
ALL_NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
WORKDIR = "/tmp"  # the code's own tmpfs inside the built root (world.py)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, -1)
# statvfs flag bits -> mount flags that a user namespace may not clear on a remount
_LOCKED_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                 (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

libc = ctypes.CDLL(None, use_errno=True)


class Refused(Exception):
    """A layer the strict sandbox needs was refused by the kernel; nothing runs."""


def mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> bool:
    encode = lambda text: text.encode() if text is not None else None  # noqa: E731
    return libc.mount(encode(source), encode(target), encode(kind), flags, encode(data)) == 0


def close_fds_except(keep: set[int]) -> None:
    """Close every descriptor above 2 not in keep: no host fd (a directory fd walks the host fs) survives."""
    previous = 2
    for fd in sorted({fd for fd in keep if fd > 2} | {1 << 20}):
        os.closerange(previous + 1, fd)
        previous = fd


def await_parent(middle: int) -> None:
    """In A and J: wait until the zygote's middle child is gone and the worker (a subreaper) is our parent.

    A parent-death signal set before that would fire when the middle child exits, at once.
    """
    while os.getppid() == middle:
        time.sleep(0.0002)


def die_with(parent: int) -> None:
    """SIGKILL when `parent` dies; leave at once if it already has (the signal would never come).

    A change of uid or gid clears the signal (the kernel's rule): set it after the last one.
    """
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL
    if os.getppid() != parent:
        os._exit(0)


def execution_ids(pid: int) -> tuple[int, int]:
    """The uid and gid an execution runs as when hasten is root: its own while A (`pid`) lives.

    A's pid is unique among live processes, and A outlives every process of its execution (B dies
    with it, and the pid namespace with B), so two executions at the same time never share the ids,
    and so never a per-uid kernel budget (pending signals, pipe pages, processes, epoll watches).
    The ids come from root's subordinate range (/etc/subuid, /etc/subgid) when one is as wide as
    the pid space, else from UID_BASE, a range systemd leaves unused (its container ranges end below it).
    """
    try:
        with open("/proc/sys/kernel/pid_max") as file:
            width = int(file.read())
    except (OSError, ValueError):
        width = PID_SPAN
    ids = []
    for path in ("/etc/subuid", "/etc/subgid"):
        start = UID_BASE
        try:
            with open(path) as file:
                for line in file:
                    fields = line.strip().split(":")
                    if len(fields) == 3 and fields[0] in ("root", "0") and fields[1].isdigit() and \
                            fields[2].isdigit() and int(fields[2]) >= width:
                        start = int(fields[1])
                        break
        except OSError:
            pass
        ids.append(start + pid % width)
    return ids[0], ids[1]


def enter_namespaces(strict: bool, layers: dict, workdir: str = "") -> None:
    """In A: leave root for the execution's own uid, then new user/mount/pid/net/ipc/uts namespaces.

    Smaller sets of namespaces only with the fallback, whose host work dir is handed to the new uid.
    """
    layers["own_uid"] = False
    if os.geteuid() == 0:
        # Root bypasses RLIMIT_NPROC and owns every file; run as an unused uid instead.
        uid, gid = execution_ids(os.getpid())
        try:
            if workdir:
                os.chown(workdir, uid, gid)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            layers["unprivileged_uid"] = layers["own_uid"] = True
        except OSError:
            layers["unprivileged_uid"] = False
    else:
        layers["unprivileged_uid"] = True  # but the user's own: per-uid budgets are shared (docs/sandbox.md)
    # The worker made itself non-dumpable (and setuid clears it too), which leaves /proc/self owned
    # by root; writing our own uid_map needs it back. B drops it again before the code runs.
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    uid, gid = os.geteuid(), os.getegid()
    choices = [ALL_NAMESPACES] if strict else [
        ALL_NAMESPACES, CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC, CLONE_NEWUSER | CLONE_NEWNET]
    flags = next((choice for choice in choices if libc.unshare(choice) == 0), 0)
    for name, bit in (("user_namespace", CLONE_NEWUSER), ("mount_namespace", CLONE_NEWNS),
                      ("pid_namespace", CLONE_NEWPID), ("network_namespace", CLONE_NEWNET),
                      ("ipc_namespace", CLONE_NEWIPC)):
        layers[name] = bool(flags & bit)
    if strict and not flags:
        raise Refused(f"unshare(user, mount, pid, net, ipc) failed: {os.strerror(ctypes.get_errno())}")
    if strict and not layers["unprivileged_uid"]:
        raise Refused("could not drop root to the execution's own uid")
    if flags & CLONE_NEWUSER:
        # Map our one outer uid to root inside, which may mount in the new mount namespace.
        try:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as file:
                    file.write(text)
        except OSError as error:
            if strict:
                raise Refused(f"cannot map the user namespace: {error}") from None


def setup_filesystem(disk_bytes: int, inodes: int, layers: dict, strict: bool) -> str:
    """In B (pid 1): private mounts, then the root built from the allowlist (world.py), read-only but /tmp.

    Returns the work dir. Without a mount namespace (fallback only) that is a host directory the
    worker made and deletes, and the whole host stays visible.
    """
    if layers["mount_namespace"] and not mount("none", "/", None, MS_REC | MS_PRIVATE):
        layers["mount_namespace"] = False  # e.g. an LSM that grants no capabilities in new user namespaces
    if not layers["mount_namespace"]:
        if strict:
            raise Refused("no private mount namespace")
        layers.update(read_only_root=False, tmpfs_workdir=False, private_proc=False, built_root=False)
        return ""
    layers.update(private_proc=False, tmpfs_workdir=False)
    layers["built_root"] = world.build(disk_bytes, inodes, layers)
    layers["read_only_root"] = _read_only_but_work()
    needed = ("private_proc", "tmpfs_workdir", "built_root", "read_only_root")
    if strict and not all(layers[name] for name in needed):
        raise Refused("mount setup incomplete: " + ", ".join(name for name in needed if not layers[name]))
    return WORKDIR


def enter_judge_world(layers: dict) -> None:
    """In J: a mount namespace (and a user namespace unless root) with the same built root, no /proc.

    J runs only trusted code (the row's tests and preamble), so this is a second line: tests never
    see task data or the project either. Refusals leave J where it is (layers["judge_root"] False).
    """
    uid, gid = os.geteuid(), os.getegid()
    flags = CLONE_NEWNS if uid == 0 else CLONE_NEWUSER | CLONE_NEWNS
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # writing our own uid_map needs it
    layers["judge_root"] = False
    if libc.unshare(flags) != 0:
        return
    try:
        if flags & CLONE_NEWUSER:
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as file:
                    file.write(text)
    except OSError:
        return
    if not mount("none", "/", None, MS_REC | MS_PRIVATE):
        return
    scratch = {"pid_namespace": False}  # no pid namespace of its own: no /proc at all
    built = world.build(1 << 20, 256, scratch)  # its binds are read-only as they are made
    layers["judge_root"] = built and scratch.get("tmpfs_workdir", False) and remount_read_only("/")


def _read_only_but_work() -> bool:
    """Remount every mount but the work dir and /proc read-only; True if all held."""
    failed = 0
    with open("/proc/self/mountinfo") as file:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in file]
    for point in points:
        if point == WORKDIR or point == "/proc" or point.startswith("/proc/"):
            continue
        failed += not remount_read_only(point)
    return failed == 0


def remount_read_only(point: str) -> bool:
    """Remount one mount read-only, keeping the flags a user namespace may not clear."""
    try:
        flags = os.statvfs(point).f_flag
    except OSError:
        return True  # gone (a detached path): nothing to make read-only
    locked = sum(mount_flag for stat_flag, mount_flag in _LOCKED_FLAGS if flags & stat_flag)
    return mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked)


def drop_privileges(limits: dict) -> None:
    """In C: resource limits, no capabilities (even as root of the namespace), no new privileges, the syscall allowlist."""
    megabyte = 1 << 20
    cpu = int(limits["cpu_seconds"])
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU at soft, SIGKILL at hard
        ("RLIMIT_AS", limits["memory_bytes"], limits["memory_bytes"]),
        ("RLIMIT_FSIZE", limits["file_bytes"], limits["file_bytes"]),
        ("RLIMIT_NOFILE", limits["open_files"], limits["open_files"]),  # bounds its pipes (accounting.open_files)
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_STACK", 64 * megabyte, 64 * megabyte),
        ("RLIMIT_MSGQUEUE", 0, 0),
        # Counted per uid and user namespace, and charged to the namespace's creator too: so, where the
        # execution has no uid of its own, it adds at most this many to the user's pending signals.
        ("RLIMIT_SIGPENDING", SIGNALS_PENDING, SIGNALS_PENDING),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))
    # Counted per user namespace from here (kernel >= 5.14), so it is a per-sandbox cap there;
    # without a user namespace it counts every process of this uid (the execution's own, or yours).
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    try:
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
    except (OSError, ValueError):
        last = 40
    for capability in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)
    # Not dumpable: no core, and no process of the same uid may ptrace it or read its memory files.
    # The allowlist refuses PR_SET_DUMPABLE from here on; an execve'd child is dumpable again (the kernel
    # resets it), but it has no capabilities and the same allowlist.
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    header = struct.pack("Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = ctypes.create_string_buffer(24)  # two zeroed {effective, permitted, inheritable}
    libc.capset(ctypes.c_char_p(header), data)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        seccomp.install()  # the syscall allowlist (seccomp.py)
    # Whether each of these held is read from /proc by B (inspect), not reported from here.


def _status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as file:
        return dict(line.rstrip("\n").split(":\t", 1) for line in file if ":\t" in line)


def inspect(pid: int, limits: dict, layers: dict, seconds: float = 5.0) -> dict[str, bool]:
    """In B: C's privileges as the kernel reports them (/proc/C/status and limits), once C has set them.

    These are the layers a result records for C; whatever C itself says is never asked. C cannot
    undo any of them once set (seccomp filters, no_new_privs and dropped capabilities are one-way),
    so reading them any time after they appear is enough. Without B's own /proc (fallback) nothing
    about C can be checked, and every C layer reads False.
    """
    found = {"rlimits": False, "no_capabilities": False, "no_new_privs": False, "seccomp": False, "own_session": False}
    if not layers.get("private_proc", False) and layers.get("pid_namespace", False):
        return found  # /proc is the host's: C's pid there is another process
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            fields = _status_fields(pid)
        except (OSError, ValueError):
            return found
        if fields.get("Seccomp", "0").strip() == "2" or fields.get("State", "").startswith(("Z", "X")):
            break
        time.sleep(0.001)
    found["seccomp"] = fields.get("Seccomp", "0").strip() == "2"
    found["no_new_privs"] = fields.get("NoNewPrivs", "0").strip() == "1"
    # Held capabilities; the bounding set only limits what execve could add, which no_new_privs forbids
    # (and an unprivileged uid, in the fallback, may not empty it).
    found["no_capabilities"] = all(int(fields.get(name, "1"), 16) == 0 for name in ("CapInh", "CapPrm", "CapEff",
                                                                                   "CapAmb"))
    try:
        with open(f"/proc/{pid}/stat") as file:  # the session id is the 4th field after the command's ")"
            found["own_session"] = int(file.read().rsplit(")", 1)[1].split()[3]) == pid
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/limits") as file:
            text = file.read()
        address = re.search(r"^Max address space\s+(\S+)\s+(\S+)", text, re.MULTILINE)
        processes = re.search(r"^Max processes\s+(\S+)\s+(\S+)", text, re.MULTILINE)
        signals = re.search(r"^Max pending signals\s+(\S+)\s+(\S+)", text, re.MULTILINE)
        found["rlimits"] = bool(address and processes) and address.group(2).isdigit() and \
            int(address.group(2)) <= int(limits["memory_bytes"]) and processes.group(2).isdigit() and \
            int(processes.group(2)) <= int(limits["max_processes"]) and bool(signals) and \
            signals.group(2).isdigit() and int(signals.group(2)) <= SIGNALS_PENDING
    except OSError:
        pass
    return found
