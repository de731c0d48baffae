"""The one base class for errors a user can act on.

Config keys, task data rows, reward files and model names raise subclasses
of UserError with a one-line message naming the culprit; the CLI prints that
line and exits with code 2 (exit_code, which every command of the CLI runs
under). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Callable

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """A problem with the user's input; str() is a one-line message."""


class ConfigError(UserError):
    """A user-facing configuration problem; str() is the one-line message (hasten.config re-exports it)."""


USER_ERRORS = (UserError,)


class Interrupted(BaseException):
    """A second SIGINT/SIGTERM during training (train/loop.py): stop now.

    A BaseException, like KeyboardInterrupt, so no `except Exception` on the way up eats it.
    """

    def __init__(self, signum: int, saved: bool = False):
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.saved = saved  # True: a checkpoint and the summary were written (the first signal's way out)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def report_interrupted(stop: Interrupted, resume_command: str) -> None:
    """The line for a run stopped by a signal (the first signal's checkpoint line is already printed)."""
    if not stop.saved:  # a second SIGINT/SIGTERM: out at once, the last checkpoint is what remains
        import sys

        print(f"{stop}; stopped at once (resume from the last checkpoint with: {resume_command} RUN_DIR)",
              file=sys.stderr)


def exit_code(command: Callable[[], int], resume_command: str = "hasten train --resume") -> int:
    """Run one command of the CLI and return its exit code: a user error prints its one line and gives
    EXIT_USER_ERROR; a run stopped by a signal says how to resume and gives 128 + the signal."""
    import sys

    try:
        return command()
    except USER_ERRORS as exc:
        print(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, file=sys.stderr)
        return EXIT_USER_ERROR
    except Interrupted as stop:
        report_interrupted(stop, resume_command)
        return stop.exit_code
