"""Expected, user-facing failures.

Anything raised as an `AdaFlashError` is a problem with the user's input or environment (an
unknown target, a corrupt checkpoint, a prompt that does not fit). The CLI prints its message on
one line and exits non-zero without a traceback; everything else is a bug and keeps its traceback.
"""


class AdaFlashError(Exception):
    """A problem the user can fix; the message names it."""


class CheckpointError(AdaFlashError):
    """A drafter checkpoint is missing, corrupt or was trained for a different target."""


class InputError(AdaFlashError):
    """A request cannot be served as given (prompt too long, invalid sampling parameters...)."""
