"""The driver's state file: its layout, validation and atomic writes.

The file is one JSON object (:data:`STATE_FORMAT`). It is replaced, never rewritten in
place: a driver killed mid-write leaves the previous state, not half of the next.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["STATE_FORMAT", "DriverState", "check_state", "read_state", "write_atomic"]

#: Version of the driver's state layout.
STATE_FORMAT = 1


@attrs.frozen
class DriverState:
    """A validated state."""

    job: str | None
    world_size: int | None
    restart: int
    event_seq: int
    ranks: tuple[int, ...]
    #: Each detector's own state, by detector name (validated by the detector).
    detectors: Mapping[str, Any]


def check_state(state: Any) -> DriverState:
    """``state`` validated; ValueError names the field."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"state.format must be {STATE_FORMAT}, got {state.get('format')!r}")
    job, world, restart = state.get("job"), state.get("world_size"), state.get("restart", 0)
    if job is not None and (not isinstance(job, str) or not job):
        raise ValueError(f"state.job must be a non-empty string or null, got {job!r}")
    if world is not None and (not _is_int(world) or world < 1):
        raise ValueError(f"state.world_size must be an int >= 1 or null, got {world!r}")
    if not _is_int(restart) or restart < 0:
        raise ValueError(f"state.restart must be an int >= 0, got {restart!r}")
    ranks = state.get("ranks", [])
    if not isinstance(ranks, list) or not all(_is_int(r) and r >= 0 for r in ranks):
        raise ValueError(f"state.ranks must be a list of ints >= 0, got {ranks!r}")
    seq = state.get("event_seq", 0)
    if not _is_int(seq) or seq < 0:
        raise ValueError(f"state.event_seq must be an int >= 0, got {seq!r}")
    detectors = state.get("detectors", {})
    if not isinstance(detectors, Mapping):
        raise ValueError(f"state.detectors must be a mapping, got {detectors!r}")
    return DriverState(job, world, restart, seq, tuple(ranks), dict(detectors))


def read_state(path: Path) -> Any:
    """The decoded file, or None if there is none; ValueError if it cannot be read."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"state_path {str(path)!r} cannot be read: {e}") from e


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a synced temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
