"""Where rank 0 keeps the record of each logged step: ``metrics.jsonl`` and, with
``train.tensorboard = true``, TensorBoard event files under ``tensorboard/``.

A resumed run keeps what an earlier run logged up to its checkpoint's step and drops
the rest (those steps are trained again), in both.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ms_train._tensorboard import TensorBoardLog
from ms_train.report import MetricsLog

__all__ = ["RunRecords"]


class RunRecords:
    """The records of a run under ``out_dir``, from step ``start`` on."""

    def __init__(self, out_dir: Path, *, start: int, tensorboard: bool) -> None:
        self.metrics = MetricsLog(out_dir / "metrics.jsonl", resume_at=start)
        self.tensorboard = (
            TensorBoardLog(out_dir / "tensorboard", purge_step=start) if tensorboard else None
        )

    def write(self, record: Mapping[str, Any]) -> None:
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
