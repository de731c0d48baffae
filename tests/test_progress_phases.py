"""No silent minute: every long phase reports a count (ticker.py), the conversion counts its tensors, the
held-out eval moves per chunk of questions, the plan names the threads, and the step line shows adaptive
threads and the tool-call rate. Behaviour only: nothing here asserts a time."""

from __future__ import annotations

import io
import sys

from hasten import ticker
from hasten.config import load_config
from hasten.models import smollm2
from hasten.ticker import Ticker
from hasten.train.evaluate import evaluate
from hasten.train.progress import Progress
from hasten.train.trainer import prepare


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def tiny_config(tmp_path, **overrides):
    pairs = {"model.name": "tiny", "task.name": "arithmetic", "train.steps": 1, "train.prompts_per_step": 2,
             "generation.num_generations": 2, "generation.max_new_tokens": 4, "eval.num_examples": 6,
             "eval.batch_size": 2, "eval.max_new_tokens": 4, "output.dir": str(tmp_path / "runs"),
             "output.progress": "off", "output.plot": False, "train.num_threads": 1, **overrides}
    return load_config(overrides=list(pairs.items()))


def test_the_eval_reports_each_chunk_of_questions(tmp_path):
    cfg = tiny_config(tmp_path)
    session = prepare(cfg, log=lambda text: None)
    calls = []
    evaluate(session.task, session.engine, session.policy.tokenizer, session.rewards, 6, 4, 2,
             progress=lambda done, total: calls.append((done, total)))
    assert calls == [(2, 6), (4, 6), (6, 6)]


def test_plain_ticker_prints_counts_and_never_sits_silent():
    stream = io.StringIO()
    with Ticker("eval step 0", total=4, unit="question", mode="plain", stream=stream, every_s=0.0,
                timer=False) as tick:
        tick.set(2, 4)
        tick.tick()  # the timer's beat with nothing done since: still a line (every_s has passed)
        tick.set(4, 4)
    lines = stream.getvalue().splitlines()
    assert [line.split("|")[-1].split()[0] for line in lines] == ["2/4", "2/4", "4/4"]
    assert all(line.startswith("eval step 0:") for line in lines)
    assert "eta" not in lines[0]  # one move is no settled rate: no ETA (tests/test_first_hour.py)


def test_plain_ticker_waits_its_interval_but_always_prints_the_end():
    stream = io.StringIO()
    with Ticker("datagen", total=10, unit="question", mode="plain", stream=stream, every_s=3600,
                timer=False) as tick:
        for _ in range(10):
            tick.update()
        tick.tick()
    assert stream.getvalue().splitlines() == [stream.getvalue().splitlines()[-1]]
    assert "10/10" in stream.getvalue()


def test_auto_is_quiet_off_a_terminal_and_live_on_one():
    piped = io.StringIO()
    with Ticker("loading", total=3, mode="auto", stream=piped) as tick:
        tick.update(3)
    assert piped.getvalue() == ""  # a quick phase adds nothing to a log (a slow one: tests/test_first_hour.py)
    terminal = FakeTerminal()
    with Ticker("loading", total=3, mode="auto", stream=terminal) as tick:
        tick.update(2)
        tick.tick()
        assert "2/3" in terminal.getvalue()
    assert terminal.getvalue().endswith("\r") or terminal.getvalue().endswith("\x1b[A")  # cleared, not left


def test_a_log_line_prints_above_a_live_bar():
    terminal = FakeTerminal()
    with Ticker("loading model", mode="live", stream=terminal) as tick:
        say = tick.wrap(lambda text: terminal.write(text + "\n"))
        say("converting ...")
    assert "converting ...\n" in terminal.getvalue()


def test_the_process_mode_comes_from_output_progress():
    before = ticker.current_mode()
    try:
        ticker.configure("off")
        with Ticker("x", total=1, stream=FakeTerminal()) as tick:
            assert tick.mode == "off"
        ticker.configure("plain")
        with Ticker("x", total=1, stream=io.StringIO()) as tick:  # closed: an open one mutes the step heartbeat
            assert tick.mode == "plain"
    finally:
        ticker.configure(before)


def test_the_conversion_reports_its_count_from_the_child(tmp_path):
    script = ("import sys\n"
              f"print('{smollm2.PROGRESS}0/3', flush=True)\n"
              "print('some other output')\n"
              f"print('{smollm2.PROGRESS}2/3', flush=True)\n"
              f"print('{smollm2.PROGRESS}3/3', flush=True)\n"
              "print('the last error line', file=sys.stderr)\n")
    calls = []
    done = smollm2._run_converter(tmp_path, lambda count, total: calls.append((count, total)),
                                  command=[sys.executable, "-c", script])
    assert calls == [(0, 3), (2, 3), (3, 3)]
    assert done.returncode == 0 and done.stdout == "some other output\n"
    assert done.stderr.strip() == "the last error line"


def test_the_child_counts_every_tensor_and_step(capsys):
    counter = smollm2._Counter(4)
    counted = list(counter.count_tensors()(["a", "b"], desc="transformers' own label"))
    counter.step()
    assert counted == ["a", "b"]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"{smollm2.PROGRESS}{n}/4" for n in (0, 1, 2, 3)]


def test_the_plan_names_the_thread_choice(tmp_path):
    adaptive = prepare(tiny_config(tmp_path, **{"train.num_threads": 0, "speed.adaptive_threads": True}),
                       log=lambda text: None)
    text = adaptive.plan.describe()
    assert f"{adaptive.plan.threads} thread" in text and "core" in text
    if adaptive.plan.adaptive_threads:
        assert "adaptive" in text and "step line" in text
    pinned = prepare(tiny_config(tmp_path), log=lambda text: None)
    assert "1 thread on " in pinned.plan.describe() and "adaptive" not in pinned.plan.describe()


def test_the_step_line_shows_threads_and_the_tool_call_rate():
    stream = io.StringIO()
    view = Progress(3, "plain", stream)
    view.update(1, {"time/step": 23.0, "time/generate": 20.0, "time/learn": 3.0, "threads/generate": 1,
                    "threads/learn": 2, "tools/call_frequency": 0.75})
    line = stream.getvalue()
    assert "gen 20s on 1 thread," in line and "learn 3s on 2 threads" in line
    assert "tool calls/completion 0.75" in line
    stream = io.StringIO()
    Progress(3, "plain", stream).update(1, {"time/step": 2.0, "time/generate": 1.0})
    assert "thread" not in stream.getvalue() and "tool" not in stream.getvalue()
