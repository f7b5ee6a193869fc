"""The one kind of error a user of ``ms-train`` meets.

Every expected failure of a job (a bad config value, a missing or unwritable path, data
that is not there or is damaged, a run directory another run holds) is a ``JobError``:
its message is one line naming what was expected and what was found. The CLI prints it
once, as ``ms-train: error: ...``, and exits with status 2 (``EXIT_USAGE``); anything
else is a bug or a fault and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["EXIT_USAGE", "JobError"]

#: The exit status of a job that stopped on a ``JobError`` (argparse's status for usage).
EXIT_USAGE = 2


class JobError(Exception):
    """An expected failure of a run; the message is one line for the user."""
