"""The one base class for errors a user can act on.

Config keys, task data rows, reward files and model names raise subclasses
of UserError with a one-line message naming the culprit; the CLI prints that
line and exits with code 2. Anything else is a bug and keeps its traceback.
"""


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
