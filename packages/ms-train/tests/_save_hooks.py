"""A stage-2 hook that holds ms-ckpt saves, for the stop tests (``Checkpointer(hook=...)``).

The writer process unpickles it by module name (the tests put this folder on
``PYTHONPATH``); it imports no torch, so the writer does not import it either.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


class HoldSaves:
    """Hold stage 2 of every save from step ``first`` on for up to ``seconds``, after
    writing ``marker`` (so that a test knows a save is in flight); ends early once the
    trainer that built the hook is gone."""

    def __init__(self, first: int, seconds: float, marker: str) -> None:
        self.first, self.seconds, self.marker = first, seconds, marker
        self.trainer = os.getpid()

    def __call__(self, point: str, step: int) -> None:
        if point != "stage2" or step < self.first:
            return
        Path(self.marker).write_text(str(step))
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline and os.getppid() == self.trainer:
            time.sleep(0.05)
