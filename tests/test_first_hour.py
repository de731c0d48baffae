"""A newcomer's first hour (issue 56): a moving line inside every phase, answers in a second, honest ETAs.

Behaviour only. A stalled phase is a phase whose count stops: the tests hold the clock (or wait on an
event with a generous limit that only a hang would reach) and assert that a line arrives while it is
stalled; nothing here asserts how fast anything runs.
"""

from __future__ import annotations

import io
import subprocess
import sys
import threading

import torch

from hasten import ticker
from hasten.rollout.decode import DecodeState, decode
from hasten.rollout.types import SamplingParams
from hasten.ticker import Ticker
from hasten.train import progress as progress_module
from hasten.train.progress import Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_stalled_step_gets_a_plain_line_naming_its_phase_and_count():
    clock, stream = Clock(), io.StringIO()
    view = Progress(3, "plain", stream, timer=False, clock=clock)
    view.begin_step(2)
    count = ticker.tally("generating", 256, "token", rows=16)
    try:
        count.done = 37
        clock.now += 5
        view.beat()
        assert stream.getvalue() == ""  # not yet silent for PLAIN_EVERY_S
        clock.now += ticker.PLAIN_EVERY_S
        view.beat()
        line = stream.getvalue()
        assert line.startswith(f"step 2/3 {5 + ticker.PLAIN_EVERY_S:.0f}s: generating 16 rows: token 37/256"), line
        count.done, count.live = 90, 12
        clock.now += ticker.PLAIN_EVERY_S
        view.beat()
        assert stream.getvalue().splitlines()[-1].endswith("token 90/256, 12 rows going")  # it moves, no repeat
    finally:
        count.finish()
    view.update(2, {"time/step": 25.0})
    clock.now += 100
    view.beat()  # between steps the heartbeat has nothing to say; the step line said it
    assert stream.getvalue().splitlines()[-1].startswith("step 2/3  25s/step")


def test_auto_off_a_terminal_beats_every_30_seconds():
    clock, stream = Clock(), io.StringIO()
    view = Progress(3, "auto", stream, timer=False, clock=clock)
    assert view.mode == "plain" and view.every_s == ticker.PIPED_EVERY_S
    view.begin_step(1)
    clock.now += ticker.PLAIN_EVERY_S + 1
    view.beat()
    assert stream.getvalue() == ""
    clock.now += ticker.PIPED_EVERY_S
    view.beat()
    assert stream.getvalue().startswith("step 1/3 ") and "running" in stream.getvalue()


def test_the_heartbeat_thread_prints_while_the_step_is_stalled(monkeypatch):
    monkeypatch.setattr(progress_module, "PLAIN_EVERY_S", 0.01)
    arrived = threading.Event()

    class Watched(io.StringIO):
        def write(self, text):
            arrived.set()
            return super().write(text)

    stream = Watched()
    view = Progress(2, "plain", stream)  # the real timer thread
    view.begin_step(1)
    count = ticker.tally("learning", 4, "micro-batch")
    count.done = 2
    try:
        assert arrived.wait(timeout=60), "no line while the step stood still"  # the main thread is 'stalled' here
    finally:
        count.finish()
        view.close()
    assert "learning: micro-batch 2/4" in stream.getvalue()


def test_the_live_block_keeps_redrawing_during_a_step():
    clock, terminal = Clock(), FakeTerminal()
    view = Progress(3, "live", terminal, timer=False, clock=clock)
    view.update(1, {"time/step": 2.0, "reward_mean": 0.5})
    view.begin_step(2)
    count = ticker.tally("learning", 4, "micro-batch")
    try:
        for done in (1, 2):
            count.done = done
            clock.now += 1
            view.beat()
            assert terminal.getvalue().endswith(f"now: step 2/3 {done}s: learning: micro-batch {done}/4")
    finally:
        count.finish()
    view.update(2, {"time/step": 2.0, "reward_mean": 0.6})
    assert not terminal.getvalue().endswith("4")  # the step's end replaces the heartbeat's line
    assert "now:" not in terminal.getvalue().split("\x1b[J")[-1]
    view.close()


def test_the_heartbeat_leaves_the_line_to_a_speaking_ticker():
    clock, stream = Clock(), io.StringIO()
    view = Progress(3, "plain", stream, timer=False, clock=clock)
    view.begin_step(1)
    with Ticker("evaluating", total=4, mode="plain", stream=io.StringIO(), timer=False):
        clock.now += 100
        view.beat()
    assert stream.getvalue() == ""


def test_an_eval_line_moves_inside_a_chunk_instead_of_repeating_its_count():
    clock, stream = Clock(), io.StringIO()
    count = ticker.tally("generating", 64, "token", rows=16)
    try:
        with Ticker("evaluating at step 0", total=64, unit="question", mode="plain", stream=stream, timer=False,
                    clock=clock) as tick:
            for done in (10, 40):
                count.done = done
                clock.now += ticker.PLAIN_EVERY_S
                tick.tick()
    finally:
        count.finish()
    lines = stream.getvalue().splitlines()
    assert [line.split("generating 16 rows: ")[-1] for line in lines[:2]] == ["token 10/64", "token 40/64"], lines


def test_a_piped_ticker_beats_only_when_slow():
    clock, stream = Clock(), io.StringIO()
    with Ticker("evaluating", total=8, unit="question", mode="auto", stream=stream, timer=False,
                clock=clock) as tick:
        assert tick.mode == "piped"
        tick.set(2)
        clock.now += ticker.PLAIN_EVERY_S
        tick.tick()
        assert stream.getvalue() == ""  # a move is not a line in a log; silence under 30 s is fine
        clock.now += ticker.PIPED_EVERY_S
        tick.tick()
        assert "2/8" in stream.getvalue()
        tick.set(8)
    assert stream.getvalue().splitlines()[-1].split("|")[-1].split()[0] == "8/8"  # and where it ended


def test_the_decode_loop_reports_tokens_and_rows_as_it_goes():
    seen = []
    state = DecodeState(4, 6, pad_token_id=0, eos_ids=torch.tensor([99]), seed=0)
    vocabulary = 8

    def forward(token):
        seen.append(ticker.activity())
        return torch.zeros(len(token), vocabulary)

    decode(state, torch.zeros(4, vocabulary), SamplingParams(max_new_tokens=6, temperature=1.0), lambda keep: None,
           forward)
    assert seen == [f"generating 4 rows: token {step}/6" for step in range(1, 6)]
    assert ticker.activity() == ""  # off the board when the loop ends


def test_the_learner_counts_its_micro_batches(tmp_path, monkeypatch):
    from hasten.config import load_config
    from hasten.train.trainer import train

    made = []
    original = ticker.tally

    def recording(label, total, unit, rows=0):
        made.append(original(label, total, unit, rows))
        return made[-1]

    monkeypatch.setattr(ticker, "tally", recording)
    pairs = {"model.name": "tiny", "task.name": "arithmetic", "train.steps": 1, "train.prompts_per_step": 2,
             "generation.num_generations": 2, "generation.max_new_tokens": 4, "eval.num_examples": 0,
             "output.dir": str(tmp_path / "runs"), "output.progress": "off", "output.plot": False,
             "train.num_threads": 1, "train.gradient_accumulation_steps": 2, "speed.skip_zero_advantage": False}
    train(load_config(overrides=list(pairs.items())), log=lambda text: None)
    learning = [count for count in made if count.label == "learning"]
    assert len(learning) == 1 and learning[0].total >= 2 and learning[0].done == learning[0].total
    assert any(count.label == "generating" and count.done > 0 for count in made)
    assert ticker.activity() == ""


def test_an_eta_is_shown_only_once_the_rate_settles():
    clock, stream = Clock(), io.StringIO()
    with Ticker("converting", total=100, unit="tensor", mode="plain", stream=stream, timer=False, every_s=0.0,
                clock=clock) as tick:
        for seconds in (1, 30, 2):  # a conversion's mix of small and huge tensors
            clock.now += seconds
            tick.update()
        assert tick.eta() is None and "eta" not in stream.getvalue()
        for _ in range(4):
            clock.now += 2
            tick.update()
        assert tick.eta() is None  # the first, uneven half still weighs in
        for _ in range(6):
            clock.now += 2
            tick.update()
        assert tick.eta() == 2 * (100 - 13)
        assert stream.getvalue().splitlines()[-1].endswith("eta 2m54s")


def test_the_step_eta_leaves_out_the_warm_up_and_waits_to_settle():
    stream = io.StringIO()
    view = Progress(10, "plain", stream, timer=False)
    view.update(1, {"time/step": 300.0})  # the first step: compile, caches, a cold page cache
    view.update(2, {"time/step": 10.0})
    assert "eta" not in stream.getvalue()
    view.update(3, {"time/step": 10.0})
    view.update(4, {"time/step": 11.0})
    assert stream.getvalue().splitlines()[-1].endswith("eta 1m03s")  # 10.5 s x 6 steps, not 82.75 s x 6
    view.update(5, {"time/step": 60.0})  # the box got busy: the rate moved, the ETA waits
    assert "eta" not in stream.getvalue().splitlines()[-1]


LISTINGS_WITHOUT_TORCH = """
import contextlib, io, sys
import hasten.cli
folder = sys.argv[1]
for argv in (["tasks"], ["models"], ["config", "train"], ["train", "--task", "arithmetc"],
             ["eval", "--model", "smolm"], ["eval", "--model", "runs/no-such-run/checkpoint"],
             ["train", "--task", "jsonl", f"--task.path={folder}/missing.jsonl"],
             ["train", "--reward", f"{folder}/broken.py:score"]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = hasten.cli.main(argv)
    print(argv[0], code, err.getvalue().strip())
heavy = [name for name in ("torch", "transformers") if name in sys.modules]
print("heavy:", heavy)
"""


def test_listings_and_input_errors_never_import_torch(tmp_path):
    (tmp_path / "broken.py").write_text("def score(completions, **kwargs)\n    return [0.0]\n")
    done = subprocess.run([sys.executable, "-c", LISTINGS_WITHOUT_TORCH, str(tmp_path)], capture_output=True,
                          text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[-1] == "heavy: []", done.stdout  # importing torch is what took `hasten tasks` 13 s on a busy box
    assert lines[0] == "tasks 0 " and lines[1] == "models 0 " and lines[2] == "config 0 "
    assert lines[3].startswith("train 2 config error: task.name must be one of") and "'arithmetc'" in lines[3]
    assert lines[4] == "eval 2 model error: unknown model 'smolm' (use smollm2-135m, tiny, a local model directory, or a hub id)"
    assert lines[5] == "eval 2 model error: no such directory: runs/no-such-run/checkpoint"
    assert lines[6] == f"train 2 data error: '{tmp_path}/missing.jsonl' does not exist"
    assert lines[7].startswith(f"train 2 reward error: importing {tmp_path}/broken.py failed: SyntaxError: ")


def test_the_api_says_it_is_loading_the_model_as_the_cli_does(tmp_path):
    from hasten import GRPOConfig, GRPOTrainer

    lines: list[str] = []
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, report_to="none")
    GRPOTrainer(model="tiny", reward_funcs=lambda completions, **kwargs: [0.0] * len(completions), args=args,
                train_dataset=[{"prompt": "a"}, {"prompt": "b"}], log=lines.append)
    assert lines[0] == "loading model tiny ..."


def test_hasten_eval_says_what_it_evaluates_with_an_eval_plan(capsys):
    from hasten.cli import main

    code = main(["eval", "--model", "tiny", "--task", "arithmetic", "--num-examples", "2", "--eval.max_new_tokens=2",
                 "--eval.batch_size=2", "--train.num_threads=1", "--output.progress=off"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0
    assert "evaluating tiny on 2 held-out arithmetic questions (greedy, up to 2 new tokens, 2 at a time) ..." in err
    plans = [line for line in err if "plan: " in line]
    assert len(plans) == 1 and plans[0].startswith("eval plan: ") and "micro-batch" not in plans[0], err


def tiny_train_argv(tmp_path, *more):
    return ["train", "--model", "tiny", "--task", "arithmetic", "--steps", "1", "--train.prompts_per_step=2",
            "--generation.num_generations=2", "--generation.max_new_tokens=4", "--eval.num_examples=2",
            "--eval.max_new_tokens=4", "--train.num_threads=1", f"--output.dir={tmp_path}", "--output.plot=false",
            *more]


def test_train_names_its_run_directory_once_and_prints_json_only_when_asked(tmp_path, capsys):
    import json

    from hasten.cli import main

    assert main(tiny_train_argv(tmp_path / "a", "--output.progress=plain")) == 0
    printed = capsys.readouterr()
    assert (printed.out + printed.err).count("run directory:") == 1
    assert not any(line.startswith("{") for line in printed.out.splitlines())  # summary.json holds it
    assert main(tiny_train_argv(tmp_path / "b", "--output.progress=off", "--json")) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("run directory:") for line in out) == 1  # the view was off: said at the end
    assert json.loads(out[-1])["status"] == "finished"


def test_rft_test_says_its_engine_choice_once(capsys):
    from hasten.cli import main

    assert main(["rft", "test", "--model", "tiny", "--num-examples", "2", "--eval.max_new_tokens=2",
                 "--train.num_threads=1", "--output.progress=off", "--speed.engine_weights=auto"]) == 0
    err = capsys.readouterr().err
    assert err.count("speed.engine_weights=auto:") == 1, err


def test_the_speculative_loop_reports_tokens_too(monkeypatch):
    from hasten.models.tiny import tiny_model, tiny_tokenizer
    from hasten.rollout.drafters import NgramDrafter
    from hasten.rollout.lean import LeanEngine
    from hasten.rollout.speculative import SpeculativeEngine

    made = []
    original = ticker.tally
    monkeypatch.setattr(ticker, "tally", lambda *args, **kwargs: made.append(original(*args, **kwargs)) or made[-1])
    tokenizer = tiny_tokenizer()
    engine = SpeculativeEngine(LeanEngine(tiny_model(len(tokenizer)), tokenizer.pad_token_id, [999]), NgramDrafter(2), 2)
    prompts = [tokenizer.encode("hello there hello"), tokenizer.encode("abcabc")]
    engine.generate(prompts, 2, SamplingParams(max_new_tokens=6, temperature=1.0), seed=0)
    generating = [count for count in made if count.label == "generating"]
    assert generating and generating[-1].rows == 4 and 0 < generating[-1].done <= 6
    assert ticker.activity() == ""


def test_a_ticker_does_not_repeat_its_last_line_when_it_closes():
    clock, stream = Clock(), io.StringIO()
    with Ticker("loading model tiny", unit="s", mode="plain", stream=stream, timer=False, clock=clock) as tick:
        clock.now += ticker.PLAIN_EVERY_S
        tick.tick()
    assert stream.getvalue().splitlines() == [f"loading model tiny: 00:{ticker.PLAIN_EVERY_S:02.0f} elapsed"]


def test_back_to_back_phases_never_add_their_silences(monkeypatch):
    """A save and an eval, each shorter than the piped interval, run one after the other: the second phase's
    ticker speaks once the log (not the phase) has been silent for every_s."""
    now = [1000.0]
    monkeypatch.setattr(ticker.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    ticker.wrote_line()  # the step line
    now[0] += 20  # the save: quiet, under every_s
    with Ticker("evaluating", total=64, mode="plain", stream=stream, timer=False, clock=ticker.time.monotonic,
                every_s=25) as tick:
        now[0] += 6  # 26 s since the step line, 6 s into the eval
        tick.tick()
        assert stream.getvalue().startswith("evaluating"), "the eval's ticker waited for its own 25 s"
