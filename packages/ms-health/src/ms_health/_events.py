"""The driver's event log: every decision and rejection, numbered, with its evidence.

Events live in a bounded in-memory list (what ``GET /events`` serves) and, when a path
is given, are appended to a JSON-lines file as they happen, which keeps the whole
history. Evidence is made JSON-safe when recorded: non-finite floats become the strings
``"nan"``, ``"inf"`` and ``"-inf"`` (as in heartbeats) and unknown types their ``str``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import IO, Any

import attrs

__all__ = ["EventLog", "HealthEvent", "RateLimiter", "jsonable"]

_log = logging.getLogger("ms_health.driver")


@attrs.frozen
class HealthEvent:
    """One entry of the driver's event log."""

    #: Position in the driver's log, from 1, continued across a restart from its state.
    seq: int
    #: Wall clock (``time.time()``) of the driver when it was recorded.
    time: float
    #: The driver's monotonic clock at that moment (the clock of findings' ``at``).
    at: float
    #: What happened: ``finding``, ``cleared``, ``rejected``, ``dump_request``, ...
    kind: str
    ranks: tuple[int, ...]
    message: str
    evidence: Mapping[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "time": self.time,
            "at": self.at,
            "kind": self.kind,
            "ranks": list(self.ranks),
            "message": self.message,
            "evidence": dict(self.evidence),
        }


class EventLog:
    """Thread-safe, bounded, numbered; appends each event to ``path`` when given."""

    def __init__(self, path: str | os.PathLike[str] | None, *, capacity: int, seq: int = 0):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.path = None if path is None else os.fspath(path)
        self._events: deque[HealthEvent] = deque(maxlen=capacity)
        self._seq = seq
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._write_failed = False

    @property
    def seq(self) -> int:
        """The number of the last event recorded (0 before the first)."""
        return self._seq

    def add(
        self,
        kind: str,
        message: str,
        *,
        at: float,
        ranks: tuple[int, ...] = (),
        evidence: Mapping[str, Any] | None = None,
        level: int = logging.INFO,
    ) -> HealthEvent:
        safe = jsonable(dict(evidence or {}))
        with self._lock:
            self._seq += 1
            event = HealthEvent(self._seq, time.time(), at, kind, tuple(ranks), message, safe)
            self._events.append(event)
            self._write(event)
        _log.log(level, "event %d %s%s: %s", event.seq, kind, _ranks_note(ranks), message)
        return event

    def since(self, seq: int, limit: int) -> tuple[list[HealthEvent], bool]:
        """Events numbered after ``seq`` (at most ``limit``, oldest first), and whether
        some after ``seq`` were already dropped from memory (the file has them)."""
        with self._lock:
            events = [e for e in self._events if e.seq > seq]
            dropped = bool(self._events) and self._events[0].seq > seq + 1
            if not self._events and self._seq > seq:
                dropped = True
        return events[:limit], dropped

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, event: HealthEvent) -> None:
        if self.path is None:
            return
        try:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            self._file.write(json.dumps(event.to_json(), separators=(",", ":")) + "\n")
            self._file.flush()
            self._write_failed = False
        except OSError as e:
            # A full disk must not stop the driver; the event stays in memory.
            if not self._write_failed:
                _log.error("ms-health: cannot append events to %s: %s", self.path, e)
            self._write_failed = True


class RateLimiter:
    """At most one pass per key every ``every_s``; counts what it held back meanwhile.

    Keys must come from a small fixed set (reasons, not client addresses), so the
    table stays small whatever a flood of requests carries.
    """

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, now: float) -> int | None:
        """None if held back; else how many were held back since the last pass."""
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every_s:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)


def jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` as plain JSON types (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if depth > 8:
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [jsonable(v, depth + 1) for v in items]
    return str(value)


def _ranks_note(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return ""
    shown = ",".join(map(str, ranks[:8]))
    return f" [ranks {shown}{',...' if len(ranks) > 8 else ''}]"
