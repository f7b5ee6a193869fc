"""The errors ms-ckpt raises. Every message names the checkpoint, file or key concerned."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointWriteError"]


class CheckpointError(Exception):
    """Base class: no committed checkpoint, a state that does not match the checkpoint, ..."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint fails verification: a checksum, a short file, a bad manifest."""


class CheckpointWriteError(CheckpointError):
    """Stage 2 failed (ENOSPC, EACCES, the writer process died).

    The checkpoint of ``step`` is partial; ``latest`` and older checkpoints are untouched.
    ``errno`` is the OS error number when the failure was an ``OSError``, else None.
    """

    def __init__(self, message: str, *, step: int, errno: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.errno = errno
