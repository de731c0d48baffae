"""stdout and stderr as a side channel: one guarded writer, so output can never end a run.

A run's record is its directory (metrics.jsonl, summary.json, checkpoints); the terminal is only a
view of it (docs/operations.md, "Output"). A stdout or stderr closed at the start (`>&-`, `2>&-`),
full (`2>/dev/full`), hung up, or a pipe whose reader left (`| head -3`) must therefore never stop
the training, and never cost a trained step. So the CLI calls `guard()` once, before anything else:

- descriptors 0, 1 and 2 that are not open are opened on /dev/null first. Otherwise the next file the
  run opens (metrics.jsonl, a checkpoint) would get descriptor 1 or 2, and text printed "to stdout"
  would land in it, or in a child's inherited stderr;
- `sys.stdout` and `sys.stderr` become `GuardedStream`s: every write is flushed at once, and the
  first write that fails (EPIPE, ENOSPC, EIO, a closed file) turns that stream off for good. Its
  descriptor is then pointed at /dev/null, so nothing buffered fails again at exit (Python would
  print "Exception ignored" and exit 120), and child processes inherit a harmless descriptor;
- what a turned-off stream is given after that is not lost: the last lines are kept in memory and,
  once a run directory is known (`record_to`, called by train/loop.py), appended to its
  `output.log`. A run started with `>&-` finds there what it would have printed;
- views (the step display, tickers: `view(stream)`) see a failed stream as an OSError, as before,
  and turn themselves off: a progress bar's redraws are never copied into output.log.

SIGPIPE stays ignored (Python's default), so a gone reader is an EPIPE on a write, which the guard
takes, never a death by signal. `lost_stdout()` tells the CLI that stdout's reader went away: for a
command whose product is its output (`hasten config | head`) that is exit 141; for a run, whose
product is on disk, the run's own exit code stands.

Written once here rather than as a try/except around every print; Python code that imports hasten
(the API, tests) keeps its own streams unless it calls `guard()`.
"""

from __future__ import annotations

import collections
import errno
import io
import os
import sys
import threading
from pathlib import Path

RECORD_NAME = "output.log"  # in a run directory: what a closed or failed stdout/stderr was given
KEPT_LINES = 200  # lines a failed stream keeps before a run directory is known to take them

_lock = threading.Lock()
_kept: collections.deque[str] = collections.deque(maxlen=KEPT_LINES)
_record: Path | None = None  # where a failed stream's text goes (the run directory's output.log)


class GuardedStream(io.TextIOBase):
    """A text stream whose writes never raise: the first failure turns it off and later text goes to
    the run directory's output.log (`record_to`)."""

    def __init__(self, stream, descriptor: int | None):
        super().__init__()
        self.stream = stream  # the original sys.stdout / sys.stderr; None when the descriptor was closed
        self.original = stream  # what unguard() puts back
        self.descriptor = descriptor  # its file descriptor, pointed at /dev/null when the stream fails
        self.failure: int | None = None if stream is not None else errno.EBADF  # errno of the first failure

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str:
        return getattr(self.stream, "errors", None) or "strict"

    def isatty(self) -> bool:
        try:
            return not self.failed and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        if self.descriptor is None:
            raise io.UnsupportedOperation("fileno")
        return self.descriptor

    def write(self, text: str) -> int:
        """Show `text`; where the stream has failed, keep it for the run's output.log instead."""
        if not self.failed:
            try:
                self._show(text)
                return len(text)
            except OSError:
                pass  # failed now: the text goes to the record below
        _keep(text)
        return len(text)

    def show(self, text: str) -> None:
        """A view's write (progress, tickers): OSError once the stream has failed, and nothing kept."""
        if self.failed:
            raise OSError(self.failure, f"{os.strerror(self.failure)} (this stream was turned off)")
        self._show(text)

    def flush(self) -> None:
        if not self.failed:
            try:
                self.stream.flush()
            except (OSError, ValueError) as error:
                self._fail(error)

    def _show(self, text: str) -> None:
        try:
            try:
                self.stream.write(text)
            except UnicodeEncodeError:  # a path with undecodable bytes, on a strict encoding: shown escaped
                self.stream.write(text.encode(self.encoding, "backslashreplace").decode(self.encoding))
            self.stream.flush()
        except (OSError, ValueError) as error:  # ValueError: a file closed under us
            self._fail(error)
            raise OSError(self.failure, os.strerror(self.failure)) from None

    def _fail(self, error: BaseException) -> None:
        self.failure = getattr(error, "errno", None) or errno.EBADF
        if self.descriptor is not None:
            _to_devnull(self.descriptor)
        try:
            self.stream.flush()  # whatever the stream still buffers now goes to /dev/null, not at exit
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):  # `buffer`, `reconfigure`, ...: the original stream's
        if name in ("stream", "original"):  # not set yet: no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.original, name)


CLOSED = "HASTEN_CLOSED_STDIO"  # "<pid>:1,2": descriptors this process found closed, across the allocator's exec


def guard() -> None:
    """Make this process's stdout and stderr guarded streams (idempotent; the CLI calls it first)."""
    pid, _, numbers = os.environ.get(CLOSED, "").partition(":")
    closed = {int(number) for number in numbers.split(",") if number.isdigit()} if pid == str(os.getpid()) else set()
    for descriptor in (0, 1, 2):
        try:
            os.fstat(descriptor)
        except OSError:  # closed at start (`>&-`): hold the number, so no file the run opens takes it
            _to_devnull(descriptor)
            closed.add(descriptor)
    if closed:  # kernels/allocator.py may re-execute this process (same pid): it must know them too
        os.environ[CLOSED] = f"{os.getpid()}:{','.join(map(str, sorted(closed)))}"
    for name, descriptor in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if not isinstance(stream, GuardedStream):
            guarded = GuardedStream(None if descriptor in closed else stream, _descriptor(stream))
            guarded.original = stream
            setattr(sys, name, guarded)


def _descriptor(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without one (pytest's capture, a StringIO)
        return None


def unguard() -> None:
    """Put the original streams back (the CLI's main(), called from Python, leaves them as it found them)."""
    for name in ("stdout", "stderr"):
        current = getattr(sys, name)
        if isinstance(current, GuardedStream):
            setattr(sys, name, current.original)


def view(stream):
    """What a view (progress, a ticker) writes to: for a guarded stream its `show`, which raises OSError
    once the stream failed; any other stream as it is."""
    return _View(stream) if isinstance(stream, GuardedStream) else stream


class _View:
    """A guarded stream seen by a view: writes that fail raise OSError (the view turns itself off)."""

    def __init__(self, guarded: GuardedStream):
        self.guarded = guarded

    def write(self, text: str) -> int:
        self.guarded.show(text)
        return len(text)

    def flush(self) -> None:
        if self.guarded.failed:
            raise OSError(self.guarded.failure, os.strerror(self.guarded.failure))

    @property
    def encoding(self) -> str:
        return self.guarded.encoding

    def isatty(self) -> bool:
        return self.guarded.isatty()

    def fileno(self) -> int:
        return self.guarded.fileno()


def lost_stdout() -> bool:
    """stdout's reader went away (EPIPE) or stdout failed: what `hasten config | head` reports as 141."""
    return isinstance(sys.stdout, GuardedStream) and sys.stdout.failed


def record_to(run_directory: Path) -> None:
    """From now on, text a failed stream is given goes to `run_directory`/output.log, with the lines it
    kept before (a run started with `>&-` records its start there too)."""
    global _record
    with _lock:
        _record = Path(run_directory) / RECORD_NAME
        if _kept:
            _append(_record, "".join(_kept))
            _kept.clear()


def _keep(text: str) -> None:
    with _lock:
        if _record is None:
            _kept.append(text)
        else:
            _append(_record, text)


def _append(path: Path, text: str) -> None:
    try:
        with open(path, "a", encoding="utf-8", errors="backslashreplace") as handle:
            handle.write(text)
    except OSError:  # a full or vanished disk: the run's own writes report that, in their own line
        pass


def _to_devnull(descriptor: int) -> None:
    """Point `descriptor` at /dev/null (a failed terminal or pipe; or a number closed at start)."""
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:
        return
    try:
        if null != descriptor:
            os.dup2(null, descriptor)
            os.close(null)
    except OSError:
        os.close(null)
