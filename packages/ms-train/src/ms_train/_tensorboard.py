"""TensorBoard event files of a run's metrics (``train.tensorboard = true``), rank 0 only.

``tensorboard`` is an optional dependency (the ``ms-train[tensorboard]`` extra):
:func:`require_tensorboard` is called by the preflight checks, so a run asked to
log to TensorBoard without it stops before any training with an install hint, not
at its first logged step.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from ms_train.errors import JobError

__all__ = ["TAGS", "TensorBoardLog", "require_tensorboard"]

#: metrics.jsonl key -> TensorBoard tag. Both losses share a section, so TensorBoard
#: draws them side by side.
TAGS: dict[str, str] = {
    "loss": "loss/train",
    "eval_loss": "loss/eval",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu",
}


def require_tensorboard() -> None:
    """JobError with an install hint when the ``tensorboard`` package is missing."""
    try:
        importlib.import_module("tensorboard")
    except ImportError:
        raise JobError(
            "train.tensorboard = true needs the 'tensorboard' package, which is not "
            "installed: pip install 'ms-train[tensorboard]' (or set train.tensorboard=false)"
        ) from None


class TensorBoardLog:
    """Scalars of each metrics record, written to event files under ``log_dir``.

    ``purge_step``: a resumed run's step; events an interrupted run wrote after its
    checkpoint are hidden by TensorBoard, as ``metrics.jsonl`` drops those lines.
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, purge_step: int | None = None) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.fspath(log_dir)
        self._writer = SummaryWriter(self.log_dir, purge_step=purge_step or None)

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for key, tag in TAGS.items():
            if key in record:
                self._writer.add_scalar(tag, float(record[key]), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
