"""Live terminal view of a training run.

Modes (`output.progress`):
- "live": a compact status block redrawn in place with ANSI cursor moves
  (cursor up, clear to end of screen); for an interactive terminal.
- "plain": one line per step and per eval; for log files, CI and pipes, where
  cursor moves would turn into garbage.
- "off": prints nothing (metrics.jsonl still has everything).
- "auto": "live" when the stream is a TTY, else "plain" with a slower heartbeat.

A step can take minutes on a loaded CPU, so the view does not wait for its
end to show that it moves. A heartbeat thread (`beat`, every second) reads
the board the hot loops keep (ticker.py: the decode loop's token, the
learner's micro-batch) and, live, redraws the block's last line as
`now: step 3/10 12s: generating 16 rows: token 37/256`; plain, it prints that
line when nothing was printed for PLAIN_EVERY_S (auto off a terminal:
PIPED_EVERY_S). While a phase's own ticker (an eval's count) speaks, the
heartbeat leaves the line to it.

Besides reward, loss and the step's seconds per phase, the step line shows,
where the record has them, the threads each phase ran on (speed.adaptive_threads
drops to one thread beside a busy neighbour: `gen 20.3s on 1 thread` explains a
slow step) and the tool-call rate of agentic runs (`tool calls/completion`).
The phases between steps (evals, the model load) show their own count
(ticker.py); a live one stands in for the block's last line while it runs.

Choices: every number shows 3 significant digits (the learning rate in
`1e-6` style), keys missing from a record are simply left out, and the ETA
is the settled step time times the steps left. Block lines are cut to
the terminal width, because a wrapped line would make the cursor-up count
wrong and smear the redraw. This view only reads the step record; it never
computes metrics of its own, so what it shows matches metrics.jsonl. The
ETA is shown once the step time has settled (ticker.settled; the first
step, which carries the warm-up, is left out once there are others). A
stream that stops taking writes (a closed terminal, a closed pipe) turns the
view off rather than failing the run.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, TextIO

from .. import ticker
from ..ticker import PIPED_EVERY_S, PLAIN_EVERY_S, duration, settled

from ..console import view

MODES = ("auto", "live", "plain", "off")
BAR_WIDTH = 24
DEFAULT_WIDTH = 120  # when the stream cannot report a terminal size

# (record key, short label, threads key) of the per-phase timings, in loop order. The threads key is
# speed.adaptive_threads' choice for the phase (kernels/threads.py): a step that slowed because the governor
# dropped to one thread for a busy neighbour says so beside its time.
TIMINGS = (("time/generate", "gen", "threads/generate"), ("time/reward", "reward", None),
           ("time/learn", "learn", "threads/learn"))


class Progress:
    """timer False: no heartbeat thread (tests call `beat()`); clock: tests' controlled time."""

    def __init__(self, total_steps: int, mode: str = "auto", stream: TextIO | None = None, timer: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        # this call's stderr, not the one at import; a guarded one as a view (console.py): its failure turns us off
        stream = view(stream if stream is not None else sys.stderr)
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {', '.join(MODES)} (got {mode!r})")
        self.every_s = PLAIN_EVERY_S
        if mode == "auto":
            is_tty = getattr(stream, "isatty", None)
            mode = "live" if is_tty is not None and is_tty() else "plain"
            self.every_s = PIPED_EVERY_S  # a log file read later, or watched with tail -f
        self.total_steps = total_steps
        self.mode = mode
        self.stream = stream
        self.eval_step: int | None = None
        self.eval_metrics: dict[str, Any] = {}
        self._clock = clock
        self._step_seconds: list[float] = []
        self._lines: list[str] = []  # the live block as last built
        self._now = ""  # live: the heartbeat's line under the block while a step runs
        self._drawn = 0  # lines of the live block now on screen
        self._running: tuple[int, float] | None = None  # (step, its start) while a step runs
        self._printed = clock()  # when the last line was written
        self._lock = threading.RLock()  # the heartbeat thread draws too
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        if mode in ("live", "plain") and timer:
            self._timer = threading.Thread(target=self._run_timer, name="hasten-heartbeat", daemon=True)
            self._timer.start()

    # ------------------------------------------------------------ public API

    def begin_step(self, step: int) -> None:
        """Step `step` starts: the heartbeat counts its seconds and shows what the board says it does."""
        with self._lock:
            self._running = (step, self._clock())

    def update(self, step: int, record: dict[str, Any]) -> None:
        """Show the record of step `step` (counted from 1, so step == total at the end)."""
        with self._lock:
            self._running, self._now = None, ""
            seconds = _number(record.get("time/step"))
            if seconds is not None:
                self._step_seconds.append(seconds)
            if self.mode == "plain":
                self._write(self._plain_line(step, record) + "\n")
            elif self.mode == "live":
                self._lines = self._block(step, record)
                self._redraw()

    def set_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """Remember the latest held-out result; plain mode also prints it."""
        with self._lock:
            self.eval_step = step
            self.eval_metrics = dict(metrics)
            if self.mode == "plain":
                shown = "  ".join(
                    f"{key} {_format(value)}" for key, value in metrics.items() if _number(value) is not None
                )
                self._write(f"eval step {step}: {shown}\n")
            elif self.mode == "live" and self._lines:
                self._lines = [line for line in self._lines if not line.startswith("eval ")]
                self._lines.append(self._eval_line())
                self._redraw()

    def message(self, text: str) -> None:
        """Print a line (e.g. 'saved checkpoint-50') above the live block."""
        with self._lock:
            if self.mode == "off":
                return
            if self.mode == "live":
                self._clear()
                self._write(text + "\n")
                # Redraw at once: the block would otherwise vanish until the next
                # step ends, which can be minutes away on CPU.
                self._redraw()
            else:
                self._write(text + "\n")

    def beat(self) -> None:
        """The heartbeat (every second from the timer thread): a running step's phase and count, redrawn
        live, or printed plain when the log has been silent for `every_s`. Quiet while a ticker speaks."""
        with self._lock:
            if self._running is None or self.mode == "off" or ticker.speaking():
                return
            step, started = self._running
            now = self._clock()
            line = f"step {step}/{self.total_steps} {duration(now - started)}: {ticker.activity() or 'running'}"
            if self.mode == "live":
                self._now = "now: " + line
                self._redraw()
            elif ticker.silence(self._clock, self._printed) >= self.every_s:
                self._write(line + "\n")

    def close(self) -> None:
        """Stop the heartbeat; leave the last live block on screen and move below it."""
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=2.0)
        with self._lock:
            beating, self._running, self._now = self._now, None, ""
            if self.mode == "live" and self._drawn:
                if beating:
                    self._redraw()  # without the heartbeat's line
                self._write("\n")
                self._drawn = 0
                self._lines = []

    # ------------------------------------------------------------ formatting

    def _run_timer(self) -> None:
        while not self._stop.wait(1.0):
            self.beat()

    def _eta(self, step: int) -> str | None:
        left = self.total_steps - step
        if left <= 0 or step <= 0:
            return None
        times = self._step_seconds[1:] if len(self._step_seconds) > 1 else self._step_seconds  # less the warm-up
        mean = settled(times)
        return duration(mean * left) if mean is not None else None

    def _plain_line(self, step: int, record: dict[str, Any]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        reward = _reward_text(record)
        if reward:
            parts.append(reward)
        parts += _training_parts(record)
        timing = _timing_text(record)
        if timing:
            parts.append(timing)
        if _number(record.get("tokens_per_second")) is not None:
            parts.append(f"tok/s {_format(record['tokens_per_second'])}")
        if _number(self.eval_metrics.get("accuracy")) is not None:
            parts.append(f"eval acc {_format(self.eval_metrics['accuracy'])}")
        eta = self._eta(step)
        if eta:
            parts.append(f"eta {eta}")
        return "  ".join(parts)

    def _block(self, step: int, record: dict[str, Any]) -> list[str]:
        fraction = min(max(step / self.total_steps, 0.0), 1.0) if self.total_steps > 0 else 1.0
        filled = round(fraction * BAR_WIDTH)
        header = f"step {step}/{self.total_steps} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:4.0%}"
        eta = self._eta(step)
        if eta:
            header += f"  eta {eta}"
        lines = [header]
        reward = _reward_text(record)
        if reward:
            lines.append(reward)
        training = _training_parts(record)
        if training:
            lines.append("  ".join(training))
        timing = _timing_text(record)
        speed = [timing] if timing else []
        if _number(record.get("tokens_per_second")) is not None:
            speed.append(f"tok/s {_format(record['tokens_per_second'])}")
        if speed:
            lines.append("  ".join(speed))
        if self.eval_step is not None:
            lines.append(self._eval_line())
        return lines

    def _eval_line(self) -> str:
        shown = [
            f"{key.replace('_', ' ')} {_format(self.eval_metrics[key])}"
            for key in ("accuracy", "answer_rate")
            if _number(self.eval_metrics.get(key)) is not None
        ]
        return f"eval (step {self.eval_step}): " + ("  ".join(shown) or "no accuracy reported")

    # --------------------------------------------------------------- drawing

    def _redraw(self) -> None:
        self._clear()
        width = _terminal_width(self.stream)
        lines = self._lines + ([self._now] if self._now else [])
        # The last line gets no newline so the cursor stays on the block;
        # close() adds it.
        self._write("\n".join(line[: width - 1] for line in lines))
        self._drawn = len(lines)

    def _clear(self) -> None:
        """Erase the block on screen and leave the cursor where it began."""
        if not self._drawn:
            return
        up = f"\x1b[{self._drawn - 1}A" if self._drawn > 1 else ""
        self._write(f"\r{up}\x1b[J")
        self._drawn = 0

    def _write(self, text: str) -> None:
        if self.mode == "off":
            return
        try:
            self.stream.write(text)
            self.stream.flush()
            self._printed = self._clock()
            ticker.wrote_line()
        except OSError:
            # The terminal hung up (EIO; its SIGHUP stops the run in train/loop.py) or the reader of a
            # pipe went away: the view stops, the run goes on. metrics.jsonl has every step.
            self.mode = "off"


# ------------------------------------------------------------------ helpers


def _number(value: Any) -> float | None:
    """`value` as a float, or None when it is missing or not a number."""
    if value is None or isinstance(value, (bool, str)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _format(value: Any) -> str:
    """3 significant digits; whole numbers of 1000 and more as plain integers."""
    number = _number(value)
    if number is None:
        return str(value)
    if number != number:  # NaN
        return "nan"
    if abs(number) >= 1000 and abs(number) < 1e9:
        return f"{number:.0f}"
    return f"{number:.3g}"


def _format_lr(value: Any) -> str:
    """1e-06 -> '1e-6', 3.25e-07 -> '3.25e-7', 0 -> '0'."""
    number = _number(value)
    if number is None:
        return str(value)
    if number == 0:
        return "0"
    mantissa, exponent = f"{number:.2e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def _reward_text(record: dict[str, Any]) -> str:
    """'reward 0.512±0.301 (format 0.9, correct 0.41)' from whatever is present."""
    text = ""
    if _number(record.get("reward_mean")) is not None:
        text = f"reward {_format(record['reward_mean'])}"
        if _number(record.get("reward_std")) is not None:
            text += f"±{_format(record['reward_std'])}"
    per_function = [
        f"{key.removeprefix('rewards/').removesuffix('/mean')} {_format(value)}"
        for key, value in record.items()
        if key.startswith("rewards/") and not key.endswith("/std") and _number(value) is not None
    ]
    if per_function:
        joined = ", ".join(per_function)
        text = f"{text} ({joined})" if text else f"rewards ({joined})"
    return text


def _training_parts(record: dict[str, Any]) -> list[str]:
    parts = []
    for key, label in (("completion_length", "len"), ("loss", "loss"), ("kl", "kl"), ("entropy", "entropy"),
                       ("tools/call_frequency", "tool calls/completion")):  # agentic runs (agent/loop.py)
        if _number(record.get(key)) is not None:
            parts.append(f"{label} {_format(record[key])}")
    if _number(record.get("lr")) is not None:
        parts.append(f"lr {_format_lr(record['lr'])}")
    return parts


def _threads_text(value: Any) -> str:
    """' on 1 thread' where adaptive threads reported the phase's count, else ''."""
    count = _number(value)
    if count is None:
        return ""
    return f" on {count:.0f} thread{'s' if count != 1 else ''}"


def _timing_text(record: dict[str, Any]) -> str:
    """'3.6s/step (gen 1.23s, reward 0.01s, learn 2.34s)'; with adaptive threads 'gen 1.23s on 1 thread'."""
    phases = [
        f"{label} {_format(record[key])}s{_threads_text(record.get(threads))}"
        for key, label, threads in TIMINGS if _number(record.get(key)) is not None
    ]
    if _number(record.get("time/step")) is not None:
        text = f"{_format(record['time/step'])}s/step"
        return f"{text} ({', '.join(phases)})" if phases else text
    return f"time ({', '.join(phases)})" if phases else ""


def _terminal_width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or DEFAULT_WIDTH
    except (AttributeError, OSError, ValueError):
        return DEFAULT_WIDTH
