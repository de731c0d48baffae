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
- "auto": "live" on a terminal; off one (a log file, a pipe) a quiet "plain":
  no line while a phase moves along, but one every `PIPED_EVERY_S` seconds
  while it runs (and its last when one was printed), so a log watched with
  `tail -f` never sits silent for longer than that.

Inside a phase, the loops that do the work (an engine's decode loop, the
learner's micro-batches) keep a `Tally` on a process-wide board: what they
are doing and how far they are ("generating 16 rows: token 37/256",
"learning: micro-batch 2/4"). Keeping it is O(1) per decode step or
micro-batch (an int stored on an object; no lock, no host sync, no string
built); the views read the board when they draw, so a bar's line and the
run's heartbeat (train/progress.py) move while one chunk or step runs.

ETAs: a count's ETA comes from a settled rate (`settled`: the newer half of
its newest per-unit times within SETTLE_TOLERANCE of the older half) or is not
shown; a first conversion's tensors or an eval's chunks vary too much for
an early rate to mean anything.

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
PLAIN_EVERY_S = 8.0  # a plain-mode line at least this often: under 10 s of silence even when a busy box wakes the timer late
PIPED_EVERY_S = 25.0  # progress=auto off a terminal: a line at least this often while a phase runs (under 30 s late)
SETTLE_TOLERANCE = 0.3  # an ETA is shown when the newer half's mean time per unit is within 30% of the older's
SETTLE_SAMPLES = 3  # ... and at least this many times were measured
SETTLE_WINDOW = 6  # the newest times compared (halves of these)
ELAPSED_ONLY = "{desc}: {elapsed} elapsed{postfix}"  # the live bar of a phase without a count
LIVE_REFRESH_S = 1.0
FALLBACK_COLUMNS, FALLBACK_ROWS = 100, 24  # where the terminal reports 0 x 0 (tqdm would hide the bar)
LIVE_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"  # tqdm's, less its unsettled ETA

_mode = "auto"
# When a progress line (a ticker's, or the step view's: train/progress.py) was last written, on the real clock.
# Phases run back to back (a step, the final save, the final eval) each start their own timer; a plain or
# piped line is due when the log, not the phase, has been silent for every_s, so two short phases in a row
# never add up to more than that.
_last_line = [time.monotonic()]


def wrote_line() -> None:
    _last_line[0] = time.monotonic()


def silence(clock: Callable[[], float], own_last: float) -> float:
    """Seconds since the last progress line: anyone's on the real clock, this writer's own on a test's."""
    return clock() - (_last_line[0] if clock is time.monotonic else own_last)


def configure(mode: str) -> None:
    """Set the process's progress mode (`output.progress`); tickers made without a mode use it."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"progress mode must be one of {', '.join(MODES)} (got {mode!r})")
    _mode = mode


def current_mode() -> str:
    return _mode


def resolve(mode: str | None, stream: TextIO) -> str:
    """'live' | 'plain' | 'piped' | 'off' for `mode` (None: the process's) on `stream`; 'piped' is auto's
    quiet plain off a terminal (a heartbeat line every PIPED_EVERY_S, no line per move)."""
    mode = _mode if mode is None else mode
    if mode != "auto":
        return mode
    is_tty = getattr(stream, "isatty", None)
    try:
        return "live" if is_tty is not None and is_tty() else "piped"
    except ValueError:  # a closed stream
        return "off"


# ---------------------------------------------------------------- the board: what is running now


class Tally:
    """One loop's count on the board. The loop stores `done` (and `live`, rows still going) as it goes:
    plain attribute stores, so keeping it costs nothing beside a forward pass. `finish()` takes it off."""

    __slots__ = ("label", "done", "total", "unit", "rows", "live")

    def __init__(self, label: str, total: int, unit: str, rows: int = 0):
        self.label, self.total, self.unit, self.rows = label, total, unit, rows
        self.done = 0
        self.live = rows

    def text(self) -> str:
        """'learning: micro-batch 2/4'; a decode loop's 'generating 16 rows: token 37/256, 12 rows going'."""
        head = f"{self.label} {self.rows} rows" if self.rows else self.label
        text = f"{head}: {self.unit} {self.done}/{self.total}"
        return text + (f", {self.live} rows going" if self.rows and 0 < self.live < self.rows else "")

    def finish(self) -> None:
        if _board.get(self.label) is self:
            del _board[self.label]


_board: dict[str, Tally] = {}  # label -> the newest tally of that label (async generation and learning overlap)


def tally(label: str, total: int, unit: str, rows: int = 0) -> Tally:
    """Put a count on the board (replacing an older one of the same label) and return it."""
    count = Tally(label, total, unit, rows)
    _board[label] = count
    return count


def activity() -> str:
    """What the board says now: 'generating 16 rows: token 37/256; learning: micro-batch 1/4', or ''."""
    return "; ".join(count.text() for count in list(_board.values()))


def clear_board() -> None:
    """Take every count off (a step's end; tests)."""
    _board.clear()


_open: list["Ticker"] = []  # tickers drawing now: the run's heartbeat stays quiet while one speaks


def speaking() -> bool:
    """A ticker that prints (live, plain or piped) is open: it reports the phase, with the board."""
    return any(open_ticker.mode != "off" for open_ticker in list(_open))


def settled(seconds_per_unit: list[float]) -> float | None:
    """The mean seconds per unit once the rate has settled, else None (no ETA is better than a wrong one).

    Settled: of the newest SETTLE_WINDOW times (at least SETTLE_SAMPLES), the newer half's mean within
    SETTLE_TOLERANCE of the older half's (a first step's warm-up, or a conversion's mix of small and huge
    tensors, is not).
    """
    recent = seconds_per_unit[-SETTLE_WINDOW:]  # an old outlier stops counting once it is this far back
    if len(recent) < SETTLE_SAMPLES:
        return None
    half = len(recent) // 2
    older, newer = recent[:half], recent[half:]
    older_mean, newer_mean = sum(older) / len(older), sum(newer) / len(newer)
    if newer_mean <= 0 or abs(newer_mean - older_mean) > SETTLE_TOLERANCE * newer_mean:
        return None
    return newer_mean


class Ticker:
    """`with Ticker("evaluating", total=64, unit="question") as tick: ... tick.update(16)`.

    total None: a count without an end (elapsed and rate, no ETA). `update(n)` adds n done,
    `set(done)` sets the count; `note(text)` changes the text after the count (e.g. the tensor's name).
    Every line and redraw also shows the board (`activity()`): the tokens of the chunk now generating.
    every_s: the plain (piped) line interval, PLAIN_EVERY_S (PIPED_EVERY_S) unless given; clock: tests'.
    """

    def __init__(self, description: str, total: int | None = None, unit: str = "it", mode: str | None = None,
                 stream: TextIO | None = None, every_s: float | None = None, timer: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = view(stream if stream is not None else sys.stderr)  # a failed stream turns it off (console.py)
        self.mode = resolve(mode, self.stream)
        self.description, self.total, self.unit = description, total, unit
        self.every_s = every_s if every_s is not None else PIPED_EVERY_S if self.mode == "piped" else PLAIN_EVERY_S
        self.done = 0
        self.lines = 0  # plain lines written (tests read it)
        self._last_line = ""  # the last plain line: the closing line is not written twice
        self._note = ""
        self._clock = clock
        self._started = clock()
        self._printed = self._started  # when the last plain line was written
        self._moved = (self._started, 0)  # (time, count) of the last move: the per-unit times for the ETA
        self._unit_seconds: list[float] = []
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
                             bar_format=LIVE_FORMAT if total is not None else ELAPSED_ONLY)
        _open.append(self)
        if self.mode in ("live", "plain", "piped") and timer:  # timer False: only tick() beats (tests)
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
            self._time_units(done)
            if total is not None:
                self.total = total
            if self._bar is not None:
                try:
                    if total is not None and self._bar.total != total:
                        self._bar.total = total
                        self._bar.bar_format = LIVE_FORMAT  # a count with an end now: tqdm's bar
                    self._bar.set_postfix_str(self._postfix(), refresh=False)
                    self._bar.update(moved)
                except OSError:
                    self._turn_off()
            elif self.mode == "plain" and (self._finished() or self._clock() - self._printed >= self.every_s):
                self._print_line()

    def note(self, text: str) -> None:
        """Text shown after the count (tqdm's postfix)."""
        with self._lock:
            self._note = text
            if self._bar is not None:
                try:
                    self._bar.set_postfix_str(self._postfix(), refresh=False)
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
        """What the timer does each interval: redraw the live bar with the board's count; in plain (piped)
        mode, a line when none was written for `every_s`. Called by the timer thread; tests call it directly."""
        with self._lock:
            if self._bar is not None:
                try:
                    self._bar.set_postfix_str(self._postfix(), refresh=False)
                    self._bar.refresh()
                except OSError:
                    self._turn_off()
            elif self.mode in ("plain", "piped") and silence(self._clock, self._printed) >= self.every_s:
                self._print_line()

    def text(self) -> str:
        """'evaluating: 25%|##  | 16/64 [00:40, 2.5s/question] generating 16 rows: token 37/256 eta 1m40s'."""
        from tqdm import tqdm

        elapsed = self._clock() - self._started
        if self.total is None:  # a phase without a count: how long it has run
            return f"{self.description}: {tqdm.format_interval(elapsed)} elapsed {self._postfix()}".rstrip()
        line = tqdm.format_meter(self.done, self.total, elapsed, ncols=80, prefix=self.description, unit=self.unit,
                                 ascii=True, bar_format=LIVE_FORMAT)
        return f"{line} {self._postfix()}".rstrip()

    def eta(self) -> float | None:
        """Seconds left from a settled rate (`settled`), or None."""
        per_unit = settled(self._unit_seconds)
        if per_unit is None or self.total is None or self.done >= self.total:
            return None
        return per_unit * (self.total - self.done)

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
            elif self.mode in ("plain", "piped") and self.lines and (self.mode == "piped" or not self._finished()) \
                    and self.text() != self._last_line:
                self._print_line()  # where it stopped (an error, an interrupt), or a watched log's last count
            self.mode = "off"
        if self in _open:
            _open.remove(self)

    # ------------------------------------------------------------------ internals

    def _finished(self) -> bool:
        return self.total is not None and self.done >= self.total

    def _time_units(self, done: int) -> None:
        """Remember the seconds per unit of this move (for a settled ETA)."""
        now = self._clock()
        last_time, last_done = self._moved
        if done > last_done:
            self._unit_seconds.append((now - last_time) / (done - last_done))
            self._moved = (now, done)

    def _postfix(self) -> str:
        """The note, the board (what the chunk now running has done), and an ETA once the rate settled."""
        parts = [part for part in (self._note, activity()) if part]
        left = self.eta()
        if left is not None:
            parts.append(f"eta {duration(left)}")
        return "  ".join(parts)

    def _run_timer(self) -> None:
        interval = LIVE_REFRESH_S if self.mode == "live" else max(0.1, min(self.every_s, LIVE_REFRESH_S))
        while not self._stop.wait(interval):
            self.tick()

    def _print_line(self) -> None:
        self._last_line = self.text()
        try:
            self.stream.write(self._last_line + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            self._turn_off()
            return
        self.lines += 1
        self._printed = self._clock()
        wrote_line()

    def _turn_off(self) -> None:
        """The stream hung up: the ticker goes quiet, the work goes on."""
        self.mode = "off"
        self._bar = None
        self._stop.set()


def duration(seconds: float) -> str:
    """'45s', '3m05s', '1h02m'."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _has_width(stream: TextIO) -> bool:
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False
