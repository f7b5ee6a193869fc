"""Two-stage checkpointing with atomic commit.

``Checkpointer.save`` copies the state to a host buffer and returns; a background
process compresses and writes it, then commits a manifest and moves ``latest``.
``Checkpointer.load`` restores the newest committed checkpoint in place, every checksum
verified. The on-storage layout is docs/format.md.
"""

from ms_ckpt._version import __version__
from ms_ckpt.checkpointer import Checkpointer, SaveHandle
from ms_ckpt.errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError
from ms_ckpt.placement import PerRank, Sharded, per_rank
from ms_ckpt.stateful import RNGState, Stateful, rng_state

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointWriteError",
    "Checkpointer",
    "PerRank",
    "RNGState",
    "SaveHandle",
    "Sharded",
    "Stateful",
    "__version__",
    "per_rank",
    "rng_state",
]
