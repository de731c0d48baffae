"""The candidate's syscall allowlist: a seccomp BPF program built by hand (no libseccomp).

C (the process running the model's code) may make only the calls below, the
ones a Python computation needs: files, memory, time, signals, threads and
forks, pipes, inet sockets (its network namespace is empty). Everything
else fails with ENOSYS, as on a kernel that lacks the call, so glibc falls
back where it can (clone3 -> clone). Some calls are decided by their
arguments, the rest of each fails with EPERM:

    socket    AF_INET and AF_INET6 only, protocol 0, TCP or UDP: no unix sockets of any kind, no MPTCP
    open, openat   without O_DIRECT (a read past the page cache is a read from the host's disk, every time)
    sendto    without an address (addressed datagrams reach paths)
    clone     without namespace flags (threads and forks, no new namespace)
    fcntl     F_DUPFD, F_DUPFD_CLOEXEC, F_GETFD, F_SETFD, F_GETFL, F_SETFL (without O_DIRECT) only: no
              locks (they block host processes), no F_SETPIPE_SZ (pipe pages count per uid), no F_NOTIFY
              (watches host dirs), no leases, owners or signals
    madvise   not WILLNEED, COLD, PAGEOUT, POPULATE_READ, POPULATE_WRITE, COLLAPSE: on a file mapping each
              reads the host's file into its page cache or evicts it (the filter cannot tell anonymous memory)
    ioctl     no pty unlocking or naming (TIOCSPTLCK, TIOCGPTN, TIOCGPTPEER), no TIOCSTI
    preadv2, pwritev2   flags zero only (RWF_NOWAIT tells which host pages are cached)
    prlimit64 on the calling process only (pid 0): pid 1 of the sandbox is B
    prctl     not PR_SET_DUMPABLE (C made itself non-dumpable and stays so), PR_SET_CHILD_SUBREAPER (an
              orphan would stay in the sandbox's tree instead of going to B), PR_SET_KEEPCAPS

Calls that only reach host state from a read-only file are answered without
running: the sync family (fsync, fdatasync, sync, syncfs, msync,
sync_file_range) returns success and flushes nothing (each call would flush
the host's disk); fadvise64 and readahead (evicting or loading the host's
page cache), timer_create, rt_sigqueueinfo and rt_tgsigqueueinfo (entries
in the per-uid pending-signal budget) fail with EPERM. openat2 fails with
ENOSYS (its flags sit in a struct the filter cannot read), so glibc falls
back to openat.

Left out on purpose, so each fails: socketpair, sendmsg/recvmsg (fd passing),
unshare, setns, memfd_create, SysV shm/msg/sem, POSIX mqueues, flock, mount
and friends, ptrace, process_vm_*, bpf, perf_event_open, userfaultfd,
io_uring, keyctl, inotify, set*id, personality. asyncio's default loop (it
needs a socketpair) does not work under it.

x86-64 only: elsewhere `install` returns False and the worker records the
layer as missing (docs/sandbox.md). Standard library only (worker.py's
python -I -S imports it as a top-level module).
"""

from __future__ import annotations

import ctypes
import os
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
EPERM, ENOSYS = 1, 38
# BPF opcodes: load word at absolute offset, jumps on equal / >= / any-bit-set against K, return K
LOAD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
NR, ARCH = 0, 4  # offsets in struct seccomp_data


def _arg(index: int, high: bool = False) -> int:
    """Offset of the low (or high) 32 bits of syscall argument `index` (little-endian)."""
    return 16 + 8 * index + (4 if high else 0)


# x86-64 numbers (asm/unistd_64.h). Frequent calls first: the filter tests them in order.
ALLOWED = {
    "read": 0, "write": 1, "close": 3, "fstat": 5, "mmap": 9, "mprotect": 10, "munmap": 11, "brk": 12,
    "rt_sigaction": 13, "rt_sigprocmask": 14, "rt_sigreturn": 15, "futex": 202, "newfstatat": 262,
    "lseek": 8, "getpid": 39, "setitimer": 38, "getdents64": 217, "clock_gettime": 228,
    "stat": 4, "lstat": 6, "poll": 7, "pread64": 17, "pwrite64": 18, "readv": 19, "writev": 20,
    "access": 21, "pipe": 22, "select": 23, "sched_yield": 24, "mremap": 25, "mincore": 27,
    "dup": 32, "dup2": 33, "pause": 34, "nanosleep": 35, "getitimer": 36, "alarm": 37,
    "sendfile": 40, "connect": 42, "accept": 43, "recvfrom": 45, "shutdown": 48, "bind": 49, "listen": 50,
    "getsockname": 51, "getpeername": 52, "setsockopt": 54, "getsockopt": 55, "fork": 57, "vfork": 58,
    "execve": 59, "exit": 60, "wait4": 61, "kill": 62, "uname": 63,
    "truncate": 76, "ftruncate": 77, "getdents": 78, "getcwd": 79, "chdir": 80, "fchdir": 81, "rename": 82,
    "mkdir": 83, "rmdir": 84, "creat": 85, "link": 86, "unlink": 87, "symlink": 88, "readlink": 89,
    "chmod": 90, "fchmod": 91, "chown": 92, "fchown": 93, "lchown": 94, "umask": 95, "gettimeofday": 96,
    "getrlimit": 97, "getrusage": 98, "sysinfo": 99, "times": 100, "getuid": 102, "getgid": 104,
    "geteuid": 107, "getegid": 108, "setpgid": 109, "getppid": 110, "getpgrp": 111, "setsid": 112,
    "getgroups": 115, "getresuid": 118, "getresgid": 120, "getpgid": 121, "getsid": 124, "capget": 125,
    "rt_sigpending": 127, "rt_sigtimedwait": 128, "rt_sigsuspend": 130,
    "sigaltstack": 131, "utime": 132, "statfs": 137, "fstatfs": 138, "getpriority": 140, "setpriority": 141,
    "sched_setparam": 142, "sched_getparam": 143, "sched_setscheduler": 144, "sched_getscheduler": 145,
    "sched_get_priority_max": 146, "sched_get_priority_min": 147, "sched_rr_get_interval": 148,
    "arch_prctl": 158, "setrlimit": 160, "gettid": 186, "getxattr": 191,
    "lgetxattr": 192, "fgetxattr": 193, "listxattr": 194, "llistxattr": 195, "flistxattr": 196,
    "tkill": 200, "time": 201, "sched_setaffinity": 203, "sched_getaffinity": 204, "epoll_create": 213,
    "set_tid_address": 218, "restart_syscall": 219,
    "timer_settime": 223, "timer_gettime": 224, "timer_getoverrun": 225, "timer_delete": 226,
    "clock_getres": 229, "clock_nanosleep": 230, "exit_group": 231, "epoll_wait": 232, "epoll_ctl": 233,
    "tgkill": 234, "utimes": 235, "waitid": 247, "mkdirat": 258, "fchownat": 260, "futimesat": 261,
    "unlinkat": 263, "renameat": 264, "linkat": 265, "symlinkat": 266, "readlinkat": 267, "fchmodat": 268,
    "faccessat": 269, "pselect6": 270, "ppoll": 271, "set_robust_list": 273, "get_robust_list": 274,
    "splice": 275, "tee": 276, "vmsplice": 278, "utimensat": 280, "epoll_pwait": 281,
    "signalfd": 282, "timerfd_create": 283, "eventfd": 284, "fallocate": 285, "timerfd_settime": 286,
    "timerfd_gettime": 287, "accept4": 288, "signalfd4": 289, "eventfd2": 290, "epoll_create1": 291,
    "dup3": 292, "pipe2": 293, "preadv": 295, "pwritev": 296,
    "getcpu": 309, "sched_setattr": 314, "sched_getattr": 315, "renameat2": 316, "getrandom": 318,
    "execveat": 322, "membarrier": 324, "copy_file_range": 326, "statx": 332,
    "rseq": 334, "pidfd_send_signal": 424, "pidfd_open": 434, "close_range": 436,
    "faccessat2": 439, "epoll_pwait2": 441, "futex_waitv": 449,
}
# Answered without running: success with nothing done, or EPERM.
NO_OPS = {"fsync": 74, "fdatasync": 75, "sync": 162, "syncfs": 306, "msync": 26, "sync_file_range": 277}
REFUSED = {"fadvise64": 221, "readahead": 187, "timer_create": 222, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297}
SOCKET, SENDTO, CLONE, FCNTL, IOCTL = 41, 44, 56, 72, 16
PREADV2, PWRITEV2, PRLIMIT64, PRCTL = 327, 328, 302, 157
OPEN, OPENAT, MADVISE = 2, 257, 28
AF_INET, AF_INET6 = 2, 10
SOCKET_PROTOCOLS = (0, 6, 17)  # the family's default, IPPROTO_TCP, IPPROTO_UDP; not IPPROTO_MPTCP (262)
O_DIRECT = 0o40000  # x86-64
F_SETFL = 4
# MADV_WILLNEED, MADV_COLD, MADV_PAGEOUT, MADV_POPULATE_READ, MADV_POPULATE_WRITE, MADV_COLLAPSE
PAGE_CACHE_ADVICE = (3, 20, 21, 22, 23, 25)
NAMESPACE_FLAGS = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x02000000 | 0x80
# F_DUPFD, F_GETFD, F_SETFD, F_GETFL, F_SETFL, F_DUPFD_CLOEXEC: what CPython's os, io and subprocess use.
FCNTL_COMMANDS = (0, 1, 2, 3, 4, 1030)
PR_SET_DUMPABLE, PR_SET_KEEPCAPS, PR_SET_CHILD_SUBREAPER = 4, 8, 36
PTY_IOCTLS = (0x40045431, 0x80045430, 0x5441, 0x5412)  # TIOCSPTLCK, TIOCGPTN, TIOCGPTPEER, TIOCSTI


def _checked(number: int, body: list[tuple]) -> list[tuple]:
    """A block: if nr == number, run body (which must end in a return); else skip it."""
    return [(JEQ, 0, len(body), number), *body]


def _one_of(offset: int, values: tuple[int, ...], match: int, otherwise: int) -> list[tuple]:
    """Return `match` if the argument word at offset is one of values, else `otherwise`."""
    body = [(LOAD, 0, 0, offset)]
    for position, value in enumerate(values):
        body.append((JEQ, len(values) - position, 0, value))  # to the `match` return
    return body + [(RET, 0, 0, otherwise), (RET, 0, 0, match)]


def _without(offset: int, bits: int, match: int, otherwise: int) -> list[tuple]:
    """Return `match` if the argument word at offset has none of `bits` set, else `otherwise` (4 instructions)."""
    return [(LOAD, 0, 0, offset), (JSET, 0, 1, bits), (RET, 0, 0, otherwise), (RET, 0, 0, match)]


def program() -> list[tuple]:
    """The filter as (code, jump if true, jump if false, k); jumps count from the next instruction."""
    allow, deny, missing = RET_ALLOW, RET_ERRNO | EPERM, RET_ERRNO | ENOSYS
    instructions = [
        (LOAD, 0, 0, ARCH), (JEQ, 1, 0, AUDIT_ARCH_X86_64), (RET, 0, 0, deny),  # another ABI: refused
        (LOAD, 0, 0, NR), (JGE, 0, 1, X32_SYSCALL_BIT), (RET, 0, 0, deny),  # x32 calls: refused
    ]
    for number in ALLOWED.values():
        instructions += [(JEQ, 0, 1, number), (RET, 0, 0, allow)]
    for number in NO_OPS.values():
        instructions += [(JEQ, 0, 1, number), (RET, 0, 0, RET_ERRNO | 0)]  # errno 0: the call "succeeds"
    for number in REFUSED.values():
        instructions += [(JEQ, 0, 1, number), (RET, 0, 0, deny)]
    family_not_inet = 3 + len(SOCKET_PROTOCOLS)  # from the second family test past the protocol block
    instructions += _checked(SOCKET, [(LOAD, 0, 0, _arg(0)), (JEQ, 1, 0, AF_INET), (JEQ, 0, family_not_inet, AF_INET6),
                                      *_one_of(_arg(2), SOCKET_PROTOCOLS, allow, deny), (RET, 0, 0, deny)])
    # open's flags are its second argument, openat's its third; an int, so the low word is all of it.
    instructions += _checked(OPEN, _without(_arg(1), O_DIRECT, allow, deny))
    instructions += _checked(OPENAT, _without(_arg(2), O_DIRECT, allow, deny))
    instructions += _checked(MADVISE, _one_of(_arg(2), PAGE_CACHE_ADVICE, deny, allow))
    # sendto's address pointer, both halves zero: a connected or stream send.
    instructions += _checked(SENDTO, [(LOAD, 0, 0, _arg(4)), (JEQ, 0, 3, 0), (LOAD, 0, 0, _arg(4, high=True)),
                                      (JEQ, 0, 1, 0), (RET, 0, 0, allow), (RET, 0, 0, deny)])
    instructions += _checked(CLONE, [(LOAD, 0, 0, _arg(0)), (JSET, 0, 1, NAMESPACE_FLAGS),
                                     (RET, 0, 0, deny), (RET, 0, 0, allow)])
    # The kernel reads fcntl's command, the rwf_t flags, prlimit64's pid_t and prctl's option as 32-bit
    # ints, so the low word is the whole argument.
    # F_SETFL may not turn O_DIRECT on; the other commands as listed.
    instructions += _checked(FCNTL, [(LOAD, 0, 0, _arg(1)), (JEQ, 0, 4, F_SETFL),
                                     *_without(_arg(2), O_DIRECT, allow, deny),
                                     *_one_of(_arg(1), FCNTL_COMMANDS, allow, deny)])
    instructions += _checked(IOCTL, _one_of(_arg(1), PTY_IOCTLS, deny, allow))
    for number in (PREADV2, PWRITEV2):
        instructions += _checked(number, _one_of(_arg(5), (0,), allow, deny))
    instructions += _checked(PRLIMIT64, _one_of(_arg(0), (0,), allow, deny))
    instructions += _checked(PRCTL, _one_of(_arg(0), (PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_KEEPCAPS),
                                            deny, allow))
    # A checked block loads arguments only when its call matched, and then returns: every fall-through
    # still has nr in the accumulator. What reaches the end is a call the allowlist does not know.
    return instructions + [(RET, 0, 0, missing)]


def supported() -> bool:
    return os.uname().machine == "x86_64"


def install() -> bool:
    """Apply the filter to this thread (and all it creates); needs no_new_privs set first. False if not."""
    if not supported():
        return False
    instructions = program()
    filters = b"".join(struct.pack("HBBI", *instruction) for instruction in instructions)
    buffer = ctypes.create_string_buffer(filters)
    fprog = struct.pack("HxxxxxxP", len(instructions), ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0) == 0
