"""Tools cannot stall or end a run (issue 40): a turn waits one timeout, bounded results, crashes and exits
as error strings, both isolations (generation.tool_isolation), the calculator's bounds, and bad input
(an environment whose reset raises, two tools with one name) as one line.

Tests that would end the test process on a regression (os._exit, a segfault, a thread that never ends)
run their agent in a subprocess. Timings are behaviour checks with generous bounds: 8 calls that hang
past a 1 s timeout must cost about one timeout, not eight.
"""

from __future__ import annotations

import ast
import ctypes
import math
import operator
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from hasten.agent import Environments, make_agent as make_run_agent, make_tool
from hasten.agent.builtin_tools import calculator
from hasten.agent.forkserver import start_fork_server
from hasten.agent.tools import ToolCall, ToolError, ToolRunner
from hasten.errors import UserError
from hasten.rollout import SamplingParams
from test_agent import ScriptedEngine, call, last_content, make_agent, rows_for

ISOLATIONS = ["process", "forkserver", "thread"]  # process: a fork of the trainer per call; forkserver: of the
# small server make_agent starts before the model loads (agent/forkserver.py); thread: TRL's in-trainer tools
TESTS = Path(__file__).parent


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def huge(kind: str):
    """A 50 MB result.

    Args:
        kind: text or list.
    """
    return "x" * 50_000_000 if kind == "text" else list(range(10_000_000))


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text for you")

    __repr__ = __str__


def unprintable(x: int):
    """A result whose conversion to text raises.

    Args:
        x: Anything.
    """
    return {"value": Unprintable()}


def record(x: int) -> str:
    """Append to a list in this process.

    Args:
        x: What to append.
    """
    RECORDED.append(x)
    return "recorded"


RECORDED: list[int] = []


def run_calls(names_and_arguments, isolation, timeout, tools, limit=16384):
    """One turn's results."""
    server = start_fork_server([make_tool(tool) for tool in tools]) if isolation == "forkserver" else None
    runner = ToolRunner(timeout, "thread" if isolation == "thread" else "process", server)
    try:
        return runner.run([[ToolCall(name, arguments) for name, arguments in names_and_arguments]],
                             [{tool.__name__: make_tool(tool) for tool in tools}], limit)[0]
    finally:
        runner.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_turn_of_hanging_calls_waits_one_timeout_not_one_per_call(tmp_path, isolation):
    """Four calls that never return: each is in flight while the others start (each sees all four started
    before its own deadline, which one call after another would never allow), and each is timed out."""
    def hang(folder: str, x: int) -> str:
        """Say this call started, note when all four have, then never return.

        Args:
            folder: Where the calls meet.
            x: This call's number.
        """
        (Path(folder) / f"started-{x}").touch()
        while len(list(Path(folder).glob("started-*"))) < 4:
            time.sleep(0.01)
        (Path(folder) / f"met-{x}").touch()
        time.sleep(60)
        return "returned"

    results = run_calls([("hang", {"folder": str(tmp_path), "x": n}) for n in range(4)], isolation, 3.0, [hang])
    assert [r.content for r in results] == ["error: hang timed out after 3 s"] * 4
    assert sorted(path.name for path in tmp_path.glob("met-*")) == [f"met-{n}" for n in range(4)]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_call_that_ends_after_the_timeout_is_timed_out_always(isolation):
    """Calls that sleep just past the timeout: all failed (the old sequential join let most of them through)."""
    results = run_calls([("sleepy", {"seconds": 1.3})] * 8, isolation, 1.0, [sleepy])
    assert all(r.failed and "timed out" in r.content for r in results), [r.content for r in results]


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_huge_results_are_refused_before_they_reach_the_tokenizer(tokenizer, isolation):
    """A 50 MB result (a string, or a list whose JSON would be 90 MB) is an error string; the trainer's peak
    memory grows by far less than the 3 GB that tokenizing it took."""
    seen = []

    def script(text, sample):
        content = last_content(text)
        if content in ("text", "list"):
            return call("huge", f'{{"kind": "{content}"}}')
        seen.append(content)
        return "done"

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    batch = make_agent(tokenizer, [huge], timeout=20, isolation=isolation).generate(
        ScriptedEngine(tokenizer, script), rows_for("text", "list"), 2, SamplingParams(max_new_tokens=400), 0)
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert len(seen) == 4 and all(s.startswith("error: huge returned ") and "more than the 16384" in s for s in seen)
    assert batch.metrics["tools/failure_frequency"] == 1.0
    assert growth < 1.2e9, f"peak memory grew by {growth / 1e9:.2f} GB"


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_result_whose_text_conversion_raises_is_an_error(isolation):
    [result] = run_calls([("unprintable", {"x": 1})], isolation, 10.0, [unprintable])
    assert result.failed and result.content == "error: RuntimeError: no text for you"


@pytest.mark.parametrize("isolation", ["process", "forkserver"])
def test_process_isolation_runs_calls_at_once_and_keeps_state_in_the_child(tmp_path, isolation):
    """Four calls meet in the file system (shared memory would not reach across processes); a tool's write
    to the trainer's globals stays in its child: that is the contract process isolation changes."""
    rendezvous = tmp_path / "meet"
    rendezvous.mkdir()

    def meet(x: int) -> str:
        """Wait until all four calls are running.

        Args:
            x: This call's number.
        """
        (rendezvous / str(x)).touch()
        while len(list(rendezvous.iterdir())) < 4:
            time.sleep(0.01)
        return "met"

    results = run_calls([("meet", {"x": n}) for n in range(4)], isolation, 20.0, [meet])
    assert [r.content for r in results] == ["met"] * 4
    RECORDED.clear()
    assert run_calls([("record", {"x": 1})], isolation, 10.0, [record])[0].content == "recorded"
    assert RECORDED == []
    assert run_calls([("record", {"x": 1})], "thread", 10.0, [record])[0].content == "recorded"
    assert RECORDED == [1]


@pytest.mark.parametrize("isolation", ["process", "forkserver"])
def test_process_isolation_turns_a_crash_an_exit_and_the_gil_into_error_strings(tmp_path, isolation):
    def crash(x: int) -> str:
        """Segfault.

        Args:
            x: Anything.
        """
        ctypes.string_at(0)
        return "unreachable"

    def leave(x: int) -> str:
        """End the process.

        Args:
            x: Anything.
        """
        os._exit(0)

    def spin(x: int) -> str:
        """Hold the GIL in one C call for minutes.

        Args:
            x: Anything.
        """
        (tmp_path / "spin.pid").write_text(str(os.getpid()))
        text = str(9 ** 9 ** 8 % 7)
        (tmp_path / "spin.finished").touch()
        return text

    results = run_calls([("crash", {"x": 1}), ("leave", {"x": 1}), ("spin", {"x": 1})], isolation, 1.0,
                        [crash, leave, spin])
    assert [r.content for r in results] == ["error: crash crashed (SIGSEGV)",
                                            "error: leave ended its process (exit code 0) without returning a result",
                                            "error: spin timed out after 1 s"]
    # spin was cut off at its deadline, not waited for: it never finished, and its process is killed
    assert not (tmp_path / "spin.finished").exists()
    assert wait_until_ended(int((tmp_path / "spin.pid").read_text()))


def wait_until_ended(pid: int) -> bool:
    """Whether process `pid` is gone or a zombie (killed, not yet reaped), polling briefly for the fork
    server, which reaps its children after the trainer asks for the kill."""
    for _ in range(500):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False


def test_make_agent_starts_a_fork_server_that_the_agent_closes(tokenizer):
    """tool_isolation=process: the server is forked by make_agent (before the model loads) and ends with the
    agent; its children run the calls. Thread isolation, or only in-trainer tools: no server."""
    from hasten.config import Config

    task = type("Task", (), {"name": "t", "train_rows": [], "eval_rows": []})()
    parts = make_run_agent(Config(), task, [sleepy])
    assert parts.fork_server is not None and Path(f"/proc/{parts.fork_server.pid}").exists()
    agent = parts.build(tokenizer, 0)
    [[result]] = agent.runner.run([[ToolCall("sleepy", {"seconds": 0})]], [agent.tools])
    assert result.content == "slept 0"
    agent.close()
    assert not Path(f"/proc/{parts.fork_server.pid}").exists()
    thread_config = Config()
    thread_config.generation.tool_isolation = "thread"
    assert make_run_agent(thread_config, task, [sleepy]).fork_server is None
    builtin_only = Config()
    builtin_only.generation.tools = ["calculator"]  # bounded, it runs in the trainer: nothing to fork for
    assert make_run_agent(builtin_only, task).fork_server is None
    brought = make_run_agent(Config(), task, [calculator])  # as the calculator task (and B7) bring it
    assert brought.tools[0].in_trainer and brought.fork_server is None


def test_a_result_read_after_the_deadline_counts_when_the_tool_finished_in_time():
    """The trainer may read a child's pipe late (busy forking a turn's other calls): what decides is when the
    tool finished, which its message carries."""
    from hasten.agent.isolation import Children

    children = Children(timeout=0.5, limit=16384)
    quick = children.start(make_tool(sleepy), ToolCall("sleepy", {"seconds": 0}))
    slow = children.start(make_tool(sleepy), ToolCall("sleepy", {"seconds": 0.8}))
    time.sleep(1.2)  # both deadlines pass before the trainer looks; both children have written by now
    children.collect()
    assert quick().content == "slept 0"
    assert slow().content == "error: sleepy timed out after 0.5 s"


def test_a_dead_fork_server_leaves_the_trainer_forking_its_own_children():
    server = start_fork_server([make_tool(sleepy)])
    os.kill(server.pid, signal.SIGKILL)
    os.waitpid(server.pid, 0)
    runner = ToolRunner(5.0, "process", server)
    [[result]] = runner.run([[ToolCall("sleepy", {"seconds": 0})]], [{"sleepy": make_tool(sleepy)}])
    assert result.content == "slept 0" and server.broken
    runner.close()


AGENT_SCRIPT = '''
import os, sys, threading, time, ctypes
from hasten.agent.loop import Agent, AgentSettings
from hasten.agent.template import HERMES_TEMPLATE, ToolTemplate
from hasten.agent import make_tool
from hasten.models.tiny import tiny_tokenizer
from hasten.rollout import SamplingParams
from test_agent import ScriptedEngine, call, last_content, rows_for

def leave(x: int) -> str:
    """End the process.

    Args:
        x: Anything.
    """
    os._exit(0)

def crash(x: int) -> str:
    """Segfault.

    Args:
        x: Anything.
    """
    ctypes.string_at(0)

def linger(x: int) -> str:
    """Start a thread that never ends.

    Args:
        x: Anything.
    """
    threading.Thread(target=lambda: time.sleep(10 ** 6), daemon=False).start()
    return "started"

seen = []
def script(text, sample):
    content = last_content(text)
    if content in ("leave", "crash", "linger"):
        return call(content, '{"x": 1}')
    seen.append(content)
    return "done"

isolation, names = sys.argv[1], sys.argv[2].split(",")
tokenizer = tiny_tokenizer()
agent = Agent(tokenizer, ToolTemplate(tokenizer, HERMES_TEMPLATE), [make_tool(f) for f in (leave, crash, linger)],
              None, AgentSettings(2, 5.0, isolation=isolation), tokenizer.pad_token_id or 0)
agent.generate(ScriptedEngine(tokenizer, script), rows_for(*names), 2, SamplingParams(max_new_tokens=400), 0)
agent.close()
print("SEEN", seen, flush=True)
'''


def run_agent_script(tmp_path, isolation, names):
    (tmp_path / "agent_script.py").write_text(AGENT_SCRIPT)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    try:
        return subprocess.run([sys.executable, str(tmp_path / "agent_script.py"), isolation, ",".join(names)],
                              capture_output=True, text=True, timeout=120, env=environment, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the process never ended")


def test_exit_crash_and_endless_threads_cost_a_rollout_not_the_run(tmp_path):
    """The default isolation: os._exit(0) (was: exit 0, nothing said), a segfault (was: rc 139) and a
    non-daemon thread that never ends (was: a process that never exits) are each that call's error."""
    done = run_agent_script(tmp_path, "process", ["leave", "crash", "linger"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SEEN ['error: leave ended its process (exit code 0) without returning a result', " in done.stdout
    assert "'error: crash crashed (SIGSEGV)', 'error: crash crashed (SIGSEGV)', 'started', 'started']" in done.stdout


def test_thread_isolation_turns_os_exit_into_an_error(tmp_path):
    """In the trainer's process os._exit cannot be stopped by Python, except on hasten's tool threads."""
    done = run_agent_script(tmp_path, "thread", ["leave"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SEEN ['error: ToolExit: the tool called os._exit(0)" in done.stdout


@pytest.mark.parametrize("expression", ["(((9**99)**99)**99)**4", "9**9**9**9", "(10**1000)*(10**1000)*(10**1000)",
                                        "(2**4000)**2", "1" * 5000, "10.0**400", "(" * 300 + "1" + ")" * 300])
def test_calculator_refuses_work_it_cannot_bound(expression, monkeypatch):
    """Refused before the work is done: no operation whose integer result would pass MAX_BITS ever reaches
    Python (a spy in place of the operators sees every one; it declines one that would, instead of running it,
    so a missing bound fails here rather than holding the GIL; (((9**99)**99)**99)**4 once held it 4.6 s)."""
    from hasten.agent import builtin_tools

    unbounded = []

    def spy(real, size):
        def run(left, right):
            if isinstance(left, int) and isinstance(right, int) and size(left, right) > builtin_tools.MAX_BITS:
                unbounded.append((real.__name__, left.bit_length(), right.bit_length()))
                raise ValueError("the spy declined it")
            return real(left, right)
        return run

    spied = dict(builtin_tools.OPERATORS)  # the result's size in bits, estimated the generous way
    spied[ast.Pow] = spy(operator.pow, lambda a, b: b * math.log2(abs(a)) if b > 0 and abs(a) > 1 else 0)
    spied[ast.Mult] = spy(operator.mul, lambda a, b: a.bit_length() + b.bit_length() - 1)
    monkeypatch.setattr(builtin_tools, "OPERATORS", spied)
    assert calculator(expression).startswith("error: ")
    assert unbounded == []


def test_calculator_still_computes_large_exact_results():
    assert calculator("347 * 5821") == "2019887"
    assert calculator("2**4000 // 2**3990") == "1024"
    assert calculator("10**100") == "1" + "0" * 100


class BrokenReset:
    def reset(self, **row):
        raise KeyError("answer")

    def poke(self, x: int) -> str:
        """Poke.

        Args:
            x: Anything.
        """
        return "ok"


def test_environment_whose_reset_raises_is_one_line_naming_the_class(tokenizer):
    agent = make_agent(tokenizer, [], environments=Environments(BrokenReset))
    with pytest.raises(UserError, match=r"^environment error: BrokenReset\.reset raised KeyError: 'answer'$"):
        agent.generate(ScriptedEngine(tokenizer, lambda text, sample: "done"), rows_for("q"), 2,
                       SamplingParams(max_new_tokens=40), 0)


def guess(number: int) -> str:
    """Guess.

    Args:
        number: The guess.
    """
    return "higher"


def another_guess():
    def guess(number: int) -> str:
        """Guess again.

        Args:
            number: The guess.
        """
        return "lower"
    return guess


def test_two_tools_with_one_name_are_an_error_naming_both():
    """Was: the environment's method silently replaced the tool in every prompt."""
    from hasten.config import Config
    from hasten.tasks.guess import GuessingGame

    task = type("Task", (), {"name": "t", "train_rows": [], "eval_rows": []})()
    with pytest.raises(ToolError, match=r"^tool error: two tools are named 'guess': test_agent_tools\.guess and "
                                        r"the environment method GuessingGame\.guess; tool names must be unique$"):
        make_run_agent(Config(), task, [guess], GuessingGame)
    with pytest.raises(ToolError, match=r"^tool error: two tools are named 'guess': test_agent_tools\.guess and "
                                        r"test_agent_tools\.another_guess\.<locals>\.guess; tool names must"):
        make_run_agent(Config(), task, [guess, another_guess()])


def test_cli_environment_whose_reset_raises_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "env.py").write_text(textwrap.dedent('''
        class BrokenReset:
            def reset(self, **row):
                raise ValueError("no such level")

            def poke(self, x: int) -> str:
                """Poke.

                Args:
                    x: Anything.
                """
                return "ok"
        '''))
    from hasten.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", "--model.name=tiny", "--task.name=calculator", f"--output.dir={tmp_path / 'out'}",
                 "--task.environment=env.py:BrokenReset", "--train.steps=1", "--train.prompts_per_step=1",
                 "--generation.num_generations=2", "--eval.num_examples=0", "--generation.max_new_tokens=8",
                 "--output.progress=off"])
    error = capsys.readouterr().err
    assert code == 2, error[-2000:]
    assert error.strip().splitlines()[-1].endswith(
        "environment error: BrokenReset.reset raised ValueError: no such level")


@pytest.fixture(scope="module")
def tokenizer():
    from hasten.models.tiny import tiny_tokenizer

    return tiny_tokenizer()


def test_threads_left_by_thread_isolation_are_daemons():
    """A tool's own threads inherit daemon from hasten's tool thread (they cannot hold the process open),
    unless the tool says daemon=False; docs/agentic.md says so for tool_isolation=thread."""
    flags = []

    def spawn(x: int) -> str:
        """Start a thread.

        Args:
            x: Anything.
        """
        thread = threading.Thread(target=lambda: None)
        flags.append(thread.daemon)
        thread.start()
        return "ok"

    assert run_calls([("spawn", {"x": 1})], "thread", 10.0, [spawn])[0].content == "ok"
    assert flags == [True]
