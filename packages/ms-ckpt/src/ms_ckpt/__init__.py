"""Two-stage checkpointing with atomic commit.

``Checkpointer.save`` copies the state to a host buffer and returns; a background
process compresses and writes it, then commits a manifest and moves ``latest``.
``Checkpointer.load`` restores the newest committed checkpoint in place, every checksum
verified; ``Checkpointer.latest_step`` says which step that is, or None. The on-storage
layout is docs/format.md.

The public names below are imported on first use: the stage-2 writer process imports
``ms_ckpt._worker``, which runs this file, and must not pay for importing torch
(about a second per writer start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ms_ckpt._version import __version__

if TYPE_CHECKING:
    from ms_ckpt.checkpointer import Checkpointer, SaveHandle, committed_steps
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
    "committed_steps",
    "per_rank",
    "rng_state",
]

# Where each public name lives.
_MODULES = {
    "CheckpointCorruptError": "ms_ckpt.errors",
    "CheckpointError": "ms_ckpt.errors",
    "CheckpointWriteError": "ms_ckpt.errors",
    "Checkpointer": "ms_ckpt.checkpointer",
    "PerRank": "ms_ckpt.placement",
    "RNGState": "ms_ckpt.stateful",
    "SaveHandle": "ms_ckpt.checkpointer",
    "committed_steps": "ms_ckpt.checkpointer",
    "Sharded": "ms_ckpt.placement",
    "Stateful": "ms_ckpt.stateful",
    "per_rank": "ms_ckpt.placement",
    "rng_state": "ms_ckpt.stateful",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'ms_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
