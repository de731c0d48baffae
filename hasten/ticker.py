"""Live progress of one long phase: a count, its rate and an ETA, on stderr.

A run's steps have their own view (train/progress.py). This is for the phases
between them that take from seconds to minutes: the one-time GGUF conversion
(tensors dequantized / total), the model load, every held-out eval (questions
answered / total, moved after each chunk), SFT evals, data generation and the
phases of `hasten bench`. The bar and its numbers are tqdm's (the library
transformers and datasets already draw theirs with), not counters of our own.

Modes, the values of `output.progress`:
- "live": tqdm's bar, redrawn in place. A timer thread redraws it every
  second, so the elapsed time moves even while one chunk (a generate call
  over 16 questions, a tensor) runs for longer.
- "plain": for log files: one line (tqdm's text) when the count moves, at most
  every `PLAIN_EVERY_S` seconds, the last one always, and one line per
  `PLAIN_EVERY_S` while the count stands still; so a log never sits silent for
  longer than that.
- "off": nothing.
- "auto": "live" on a terminal, else "off": a log file keeps its one line per
  step and per eval (train/progress.py) unless `plain` is asked for.

A live bar is never left on screen (tqdm's leave=False): it is drawn over the
line the cursor is on (the last line of a run's live block, train/progress.py)
and cleared when the phase ends, so the block is then redrawn intact; the
caller logs the phase's one-line result. The mode is the process's (`configure`, from `output.progress`), so
the layers below the loop (models, rollout) need no argument for it. A stream
that stops taking writes turns the ticker off, never fails the run.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

from .console import view

MODES = ("auto", "live", "plain", "off")
PLAIN_EVERY_S = 10.0  # a plain-mode line at most, and at least, this often: the longest silence in a log
ELAPSED_ONLY = "{desc}: {elapsed} elapsed{postfix}"  # the live bar of a phase without a count
LIVE_REFRESH_S = 1.0
FALLBACK_COLUMNS, FALLBACK_ROWS = 100, 24  # where the terminal reports 0 x 0 (tqdm would hide the bar)  # the live bar's redraw interval while its count stands still

_mode = "auto"


def configure(mode: str) -> None:
    """Set the process's progress mode (`output.progress`); tickers made without a mode use it."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"progress mode must be one of {', '.join(MODES)} (got {mode!r})")
    _mode = mode


def current_mode() -> str:
    return _mode


def resolve(mode: str | None, stream: TextIO) -> str:
    """'live' | 'plain' | 'off' for `mode` (None: the process's) on `stream`."""
    mode = _mode if mode is None else mode
    if mode != "auto":
        return mode
    is_tty = getattr(stream, "isatty", None)
    try:
        return "live" if is_tty is not None and is_tty() else "off"
    except ValueError:  # a closed stream
        return "off"


class Ticker:
    """`with Ticker("evaluating", total=64, unit="question") as tick: ... tick.update(16)`.

    total None: a count without an end (elapsed and rate, no ETA). `update(n)` adds n done,
    `set(done)` sets the count; `note(text)` changes the text after the count (e.g. the tensor's name).
    """

    def __init__(self, description: str, total: int | None = None, unit: str = "it", mode: str | None = None,
                 stream: TextIO | None = None, every_s: float = PLAIN_EVERY_S, timer: bool = True):
        self.stream = view(stream if stream is not None else sys.stderr)  # a failed stream turns it off (console.py)
        self.mode = resolve(mode, self.stream)
        self.description, self.total, self.unit, self.every_s = description, total, unit, every_s
        self.done = 0
        self.lines = 0  # plain lines written (tests read it)
        self._note = ""
        self._started = time.monotonic()
        self._printed = self._started  # when the last plain line was written
        self._lock = threading.Lock()
        self._bar = None
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if self.mode == "live":
            from tqdm import tqdm

            sized = _has_width(self.stream)  # a terminal that reports 0 columns would get an empty bar
            self._bar = tqdm(total=total, desc=description, unit=unit, file=self.stream, leave=False,
                             dynamic_ncols=sized, ncols=None if sized else FALLBACK_COLUMNS,
                             nrows=None if sized else FALLBACK_ROWS, mininterval=0.2,
                             bar_format=None if total is not None else ELAPSED_ONLY)
        if self.mode in ("live", "plain") and timer:  # timer False: only tick() beats (tests)
            self._timer = threading.Thread(target=self._run_timer, name="hasten-ticker", daemon=True)
            self._timer.start()

    def __enter__(self) -> Ticker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, count: int = 1) -> None:
        self.set(self.done + count)

    def set(self, done: int, total: int | None = None) -> None:
        with self._lock:
            moved = done - self.done
            self.done = done
            if total is not None:
                self.total = total
            if self._bar is not None:
                try:
                    if total is not None and self._bar.total != total:
                        self._bar.total = total
                        self._bar.bar_format = None  # a count with an end now: tqdm's bar and ETA
                    self._bar.update(moved)
                except OSError:
                    self._turn_off()
            elif self.mode == "plain" and (self._finished() or time.monotonic() - self._printed >= self.every_s):
                self._print_line()

    def note(self, text: str) -> None:
        """Text shown after the count (tqdm's postfix)."""
        with self._lock:
            self._note = text
            if self._bar is not None:
                try:
                    self._bar.set_postfix_str(text, refresh=False)
                except OSError:
                    self._turn_off()

    def wrap(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """`log` made to print above the live bar (cleared first, redrawn after), not through it."""
        def say(text: str) -> None:
            with self._lock:
                bar = self._bar
                if bar is not None:
                    try:
                        bar.clear()
                    except OSError:
                        self._turn_off()
                        bar = None
                log(text)
                if bar is not None:
                    try:
                        bar.refresh()
                    except OSError:
                        self._turn_off()
        return say

    def tick(self) -> None:
        """What the timer does each interval: redraw the live bar; in plain mode, a line when none was
        written for `every_s`. Called by the timer thread; tests call it directly."""
        with self._lock:
            if self._bar is not None:
                try:
                    self._bar.refresh()
                except OSError:
                    self._turn_off()
            elif self.mode == "plain" and time.monotonic() - self._printed >= self.every_s:
                self._print_line()

    def text(self) -> str:
        """The count, rate and ETA as tqdm formats them: 'evaluating: 25%|##  | 16/64 [00:40<02:00, ...]'."""
        from tqdm import tqdm

        elapsed = time.monotonic() - self._started
        if self.total is None:  # a phase without a count: how long it has run
            return f"{self.description}: {tqdm.format_interval(elapsed)} elapsed {self._note}".rstrip()
        line = tqdm.format_meter(self.done, self.total, elapsed, ncols=80, prefix=self.description, unit=self.unit,
                                 ascii=True)
        return f"{line} {self._note}".rstrip()

    def close(self) -> None:
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=2 * LIVE_REFRESH_S)
        with self._lock:
            if self._bar is not None:
                try:
                    self._bar.close()
                except OSError:
                    pass
                self._bar = None
            elif self.mode == "plain" and not self._finished() and self.lines:
                self._print_line()  # where it stopped (an error, an interrupt): the log says so
            self.mode = "off"

    # ------------------------------------------------------------------ internals

    def _finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def _run_timer(self) -> None:
        interval = LIVE_REFRESH_S if self.mode == "live" else max(0.1, min(self.every_s, LIVE_REFRESH_S))
        while not self._stop.wait(interval):
            self.tick()

    def _print_line(self) -> None:
        try:
            self.stream.write(self.text() + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            self._turn_off()
            return
        self.lines += 1
        self._printed = time.monotonic()

    def _turn_off(self) -> None:
        """The stream hung up: the ticker goes quiet, the work goes on."""
        self.mode = "off"
        self._bar = None
        self._stop.set()


def _has_width(stream: TextIO) -> bool:
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False
