"""How the ``ms-train`` command reports an expected failure: one line, exit 2.

``--debug``, or ``MS_TRAIN_DEBUG=1`` in the environment (which reaches every rank
torchrun starts), adds the traceback above that line.
"""

from __future__ import annotations

import os
import sys
import traceback

from ms_train.errors import EXIT_USAGE

__all__ = ["DEBUG_ENV", "debug_wanted", "report_failure"]

#: Set to anything but ``""`` or ``"0"`` for the tracebacks of expected failures.
DEBUG_ENV = "MS_TRAIN_DEBUG"


def debug_wanted(flag: bool) -> bool:
    """``--debug`` given, or ``MS_TRAIN_DEBUG`` set."""
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report_failure(
    error: BaseException, *, debug: bool, prog: str = "ms-train", who: str = ""
) -> int:
    """Print ``error`` as ``<prog>: error: <who>...`` (after its traceback when ``debug``);
    ``who`` names the rank, e.g. ``"[rank 1] "``."""
    if debug:
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    message = " ".join(str(error).split())
    print(f"{prog}: error: {who}{message}", file=sys.stderr, flush=True)
    return EXIT_USAGE
