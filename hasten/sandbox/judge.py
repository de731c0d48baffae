"""The judge (J): runs the test program and decides every verdict, outside the candidate's process.

The worker forks J per execution next to the sandboxed tree; J never runs
model code and holds the only copy of the tests. Names the tests use that the
test program (and the row's trusted preamble) does not define are fetched
from the candidate process (candidate.py) as plain data or as a `Remote`
handle; calling a handle ships the arguments in and a plain-data result out
(wire.py). So `assert add(1, 2) == 3` compares an int J rebuilt itself with
J's own 3: an always-true `__eq__`, a patched `json.dumps`, a forged line on
the pipe or ctypes rewriting `int.__eq__` in the candidate's process change
nothing here. Anything that is not plain data is a failed call.

J reports to the worker as JSON lines: loaded (whether the code ran), one
line per test as it finishes, then tests_aborted or done; lost when the
candidate died or stopped answering. Standard library only.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import os
import select
import signal
import sys
import time
from typing import Any

import wire

GRACE = 1.0  # seconds the judge waits past a deadline for the candidate's own timer to answer
_MAPPED = {name: value for name, value in vars(builtins).items()
           if isinstance(value, type) and issubclass(value, Exception)
           and value not in (StopIteration, StopAsyncIteration)}
_ATTRIBUTES = {"__name__", "__qualname__", "__doc__", "__module__"}  # dunders a test may read


class TestTimeout(BaseException):
    """Raised by the judge's per-test timer (or for a call the candidate's timer ended)."""


class CandidateError(Exception):
    """A call raised an exception that is not a builtin one; its name and message, as text."""


class CandidateLost(Exception):
    """The candidate process died, stopped answering, or broke the framing: no further calls."""


class Remote:
    """An object that stays in the candidate's process. Callable; no truth value; equal only to itself."""

    __slots__ = ("_channel", "_number", "_type")

    def __init__(self, channel: Channel, number: int, type_name: str) -> None:
        self._channel, self._number, self._type = channel, number, type_name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        send = lambda value: wire.encode(value, _only_remote)  # noqa: E731
        return self._channel.request({"op": "call", "target": self._number, "args": [send(a) for a in args],
                                      "kwargs": [[str(k), send(v)] for k, v in kwargs.items()]})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name not in _ATTRIBUTES:
            raise AttributeError(name)  # protocol probes (copy, pickle, ...) stay local
        return self._channel.request({"op": "attr", "target": self._number, "name": name})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remote) and other._number == self._number

    def __hash__(self) -> int:
        return hash(("remote", self._number))

    def __bool__(self) -> bool:
        raise TypeError(f"a {self._type} from the candidate has no truth value here (only plain data leaves it)")

    def __repr__(self) -> str:
        return f"<candidate's {self._type}>"


def _only_remote(value: Any) -> list:
    if isinstance(value, Remote):
        return ["h", value._number, value._type]
    raise TypeError(f"cannot send a {type(value).__name__} to the candidate (plain data only)")


class Channel:
    """Requests to the candidate, one at a time, each answered in time or counted as failed."""

    def __init__(self, requests: int, replies: int, per_test: float) -> None:
        self.requests, self.reader, self.per_test = requests, wire.LineReader(replies), per_test
        self.next_id = 0
        self.outstanding: int | None = None  # a request whose answer the timer cut short
        self.lost = ""  # why no further call can work

    def receive(self, seconds: float) -> dict | None:
        """The next message within `seconds`, None on timeout; WireError on garbage; sets lost at EOF."""
        deadline = time.monotonic() + seconds
        while True:
            line = self.reader.pop()
            if line is not None:
                return wire.loads(line)
            if self.reader.closed:
                self.lost = self.lost or "the candidate process ended"
                raise CandidateLost(self.lost)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.reader.fd], [], [], remaining)[0]:
                return None
            self.reader.fill()

    def _answer(self, number: int, seconds: float) -> dict | None:
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                message = self.receive(remaining)
            except wire.WireError as error:
                raise CandidateError(f"malformed answer from the candidate: {error}") from None
            if message is None:
                return None
            if message.get("id") == number:
                return message
        return None

    def request(self, message: dict) -> Any:
        if self.lost:
            raise CandidateLost(self.lost)
        if self.outstanding is not None:  # the last call outlived its test: its answer must come first
            stale, self.outstanding = self.outstanding, None
            if self._answer(stale, GRACE) is None:
                self.lost = "the candidate stopped answering after a timeout"
                raise CandidateLost(self.lost)
        self.next_id += 1
        remaining = signal.getitimer(signal.ITIMER_REAL)[0] or self.per_test
        message.update(id=self.next_id, seconds=remaining)
        try:
            os.write(self.requests, wire.dumps(message))  # small, under PIPE_BUF-sized chunks in practice
        except OSError:
            self.lost = "the candidate process ended"
            raise CandidateLost(self.lost) from None
        self.outstanding = self.next_id
        reply = self._answer(self.next_id, remaining + GRACE)
        if reply is None:
            raise TestTimeout()
        self.outstanding = None
        if reply.get("ok") is True:
            try:
                return wire.decode(reply.get("value"), lambda number, name: Remote(self, number, name))
            except wire.WireError as error:
                raise CandidateError(f"the candidate returned something that is not plain data: {error}") from None
        if reply.get("timeout") is True:
            raise TestTimeout()
        name, text = str(reply.get("error", "error"))[:100], str(reply.get("message", ""))[:200]
        if name in _MAPPED:
            raise _MAPPED[name](text)  # `except ValueError` in a test still sees a ValueError
        raise CandidateError(f"{name}: {text}")

    def get(self, name: str) -> Any:
        try:
            return self.request({"op": "get", "name": name})
        except KeyError:
            raise KeyError(name) from None


class Namespace(dict):
    """The tests' globals: builtins and stdlib modules are the judge's own; other names come from the candidate.

    The entry point is always the candidate's, even when it shadows a builtin (`divmod`): the tests
    then call what the code defined, and a code that defines no such name fails them (NameError),
    never passing on the builtin. Any other builtin name stays the judge's, so a code that
    redefines `len` cannot change how the tests check its answer. A stdlib module name the tests
    call directly (`chunk(...)`: a function of the code that shares a module's name) is the
    candidate's; one they only take attributes of (`math.isclose` where the code imported math) is
    the judge's own import, so a fake `math` cannot judge.
    """

    def __init__(self, channel: Channel, called: set[str], entry_point: str = "") -> None:
        super().__init__(__name__="__tests__", __builtins__=builtins)
        self.channel, self.called, self.entry_point = channel, called, entry_point

    def __missing__(self, name: str) -> Any:
        if name and name == self.entry_point:
            try:
                value = self.channel.get(name)
            except KeyError:
                raise NameError(f"name {name!r} is not defined by the code") from None  # no builtin fallback
            self[name] = value
            return value
        if name.startswith("__") or hasattr(builtins, name):
            raise KeyError(name)
        if name in sys.stdlib_module_names and name not in self.called:
            value = importlib.import_module(name)
        else:
            value = self.channel.get(name)
        self[name] = value
        return value


def _called_names(sources: list[str]) -> set[str]:
    called = set()
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue  # reported when it runs
        called.update(node.func.id for node in ast.walk(tree)
                      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name))
    return called


def _verdict(error: BaseException | None) -> tuple[str, str]:
    if error is None:
        return "pass", ""
    if isinstance(error, TestTimeout):
        return "timeout", "test exceeded its time limit"
    text = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__
    return ("fail" if isinstance(error, AssertionError) else "error"), reason


def judge(job: dict, requests: int, replies: int, report: int) -> None:
    """Body of J: wait for the code to load, run the tests, report each verdict."""

    def send(record: dict) -> None:
        os.write(report, wire.dumps(record))

    def on_alarm(signum, frame):
        raise TestTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    program, per_test = job["program"], float(job["limits"]["test_seconds"])
    channel = Channel(requests, replies, per_test)
    try:
        loaded = channel.receive(per_test * 2 + GRACE)  # the code, then the setup, each under its timer
        if loaded is None:
            loaded = {"ok": False, "status": "timeout", "reason": "loading did not finish in time"}
    except CandidateLost:
        loaded = {"ok": False, "status": "died", "reason": "the process ended while loading"}
    except wire.WireError as error:
        loaded = {"ok": False, "status": "error", "reason": f"malformed report from the code: {error}"}
    send({"event": "loaded", "ok": loaded.get("ok") is True,  # no layers: those come from B's checks, not C
          "status": loaded.get("status") if loaded.get("status") in ("timeout", "error", "died") else "error",
          "reason": str(loaded.get("reason", ""))[:300]})
    if loaded.get("ok") is not True:
        if channel.lost:
            send({"event": "lost", "reason": channel.lost})
        return
    sources = [job.get("preamble", ""), program.get("setup", ""), program.get("source", ""), *program["tests"]]
    namespace = Namespace(channel, _called_names(sources), program.get("entry_point", ""))

    def begin(index: int) -> None:
        signal.setitimer(signal.ITIMER_REAL, per_test)

    def end(index: int, error: BaseException | None) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(error, CandidateLost):
            return  # not run: the candidate is gone
        status, reason = _verdict(error)
        send({"event": "test", "index": index, "status": status, "reason": reason})

    namespace["__hasten_begin__"], namespace["__hasten_end__"] = begin, end
    try:
        for label, source in (("<preamble>", job.get("preamble", "")), ("<test setup>", program.get("setup", ""))):
            if source:
                exec(compile(source, label, "exec"), namespace)
        if program["mode"] == "check":
            # check()'s test statements are wrapped in begin/end (programs.py).
            exec(compile(program["source"], "<tests>", "exec"), namespace)
            namespace["check"](channel.get(program["entry_point"]))
        else:
            for index, snippet in enumerate(program["tests"]):
                begin(index)
                try:
                    exec(compile(snippet, f"<test {index}>", "exec"), namespace)
                except BaseException as error:  # noqa: BLE001 - the verdict
                    end(index, error)
                else:
                    end(index, None)
    except BaseException as error:  # noqa: BLE001 - setup, a helper or check() itself failed
        signal.setitimer(signal.ITIMER_REAL, 0)
        if not channel.lost:
            status, reason = _verdict(error)
            send({"event": "tests_aborted", "status": status, "reason": reason})
    if channel.lost:
        send({"event": "lost", "reason": channel.lost})
    else:
        send({"event": "done"})
