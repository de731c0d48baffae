"""The one base class for errors a user can act on.

Config keys, task data rows, reward files and model names raise subclasses
of UserError with a one-line message naming the culprit; the CLI prints that
line and exits with code 2. Anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A problem with the user's input; str() is a one-line message."""


USER_ERRORS = (UserError,)
