"""What the ``ms-train`` launcher tells the ranks it starts, through their environment:
its pid (a rank dies with it) and the report folder (the ranks' reports, its stop file).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LAUNCHER_PID", "REPORT_DIR", "launched"]

REPORT_DIR = "MS_TRAIN_REPORT_DIR"
LAUNCHER_PID = "MS_TRAIN_LAUNCHER_PID"


def launched() -> tuple[int, Path] | None:
    """(launcher pid, report folder) when the ``ms-train`` launcher started this rank."""
    folder, pid = os.environ.get(REPORT_DIR), os.environ.get(LAUNCHER_PID)
    if not folder or not pid:
        return None
    return int(pid), Path(folder)
