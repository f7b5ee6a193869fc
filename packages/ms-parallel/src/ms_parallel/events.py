"""Per-rank event records: when each collective is issued and waited, when each chunk computes.

ms-parallel reports events through a plain callable, an :data:`EventHook`, that the
caller passes in; it imports nothing of ms-health. :class:`EventLog` is a small
thread-safe recorder that can serve as the hook (tests and benchmarks use it to check
the order issue -> compute -> wait).

The kinds ms-parallel emits (others are allowed):

========================  ==========================================================
``"issue"``               a collective or p2p op was issued (not yet complete)
``"wait_begin"``          the caller starts waiting for an op's result
``"wait_end"``            the wait returned: the result is usable
``"compute_begin"``       a chunk's forward or optimizer step (name ``"optimizer"``,
                          from ``ZeroDataParallel.step`` by chunk) starts
``"compute_end"``         it ends
``"complete"``            the latency backend completed an op (ms_parallel.latency)
========================  ==========================================================

``name`` says what the event is about (an op type, ``"allgather/block3"``, a chunk), ``t``
is seconds on one clock per process (``time.perf_counter`` unless said otherwise), and
the keyword attrs carry the rest (group, rank, bytes, chunk index, ...): plain JSON
values, so that a log can be written as JSON lines.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, TypeAlias

__all__ = ["EVENT_KINDS", "Event", "EventHook", "EventLog"]

#: ``hook(name, kind, t, **attrs)``, the first three passed by position; see the module
#: docstring for the kinds.
EventHook: TypeAlias = Callable[..., None]

#: The kinds ms-parallel emits; an :class:`EventLog` records any string.
EVENT_KINDS = ("issue", "wait_begin", "wait_end", "compute_begin", "compute_end", "complete")


@dataclass(frozen=True)
class Event:
    """One recorded event."""

    name: str
    kind: str
    #: Seconds on the recorder's clock.
    t: float
    #: The hook's keyword arguments.
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def matches(self, name: str | None = None, kind: str | None = None, **attrs: Any) -> bool:
        """Whether this event has the given name, kind and attr values (None: any)."""
        if name is not None and self.name != name:
            return False
        if kind is not None and self.kind != kind:
            return False
        return all(k in self.attrs and self.attrs[k] == v for k, v in attrs.items())

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "t": self.t, "attrs": dict(self.attrs)}


class EventLog:
    """A thread-safe, append-only event recorder; an instance is an :data:`EventHook`.

    ``clock`` is what :meth:`now` and :meth:`mark` read (``time.perf_counter`` by
    default); events passed in with their own ``t`` are kept as given, so every source
    of one log must use the same clock.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        self.clock = clock
        self._lock = threading.Lock()
        self._events: list[Event] = []

    def __call__(self, name: str, kind: str, t: float, /, **attrs: Any) -> None:
        # Positional-only: an attr may itself be called "name", "kind" or "t".
        if not isinstance(name, str) or not isinstance(kind, str):
            raise TypeError(f"name and kind must be str, got {name!r} and {kind!r}")
        event = Event(name, kind, float(t), attrs)
        with self._lock:
            self._events.append(event)

    def now(self) -> float:
        """The recorder's clock."""
        return self.clock()

    def mark(self, name: str, kind: str, /, **attrs: Any) -> float:
        """Record an event at the clock's current time; return that time."""
        t = self.clock()
        self(name, kind, t, **attrs)
        return t

    @property
    def events(self) -> list[Event]:
        """A copy of the events so far, in the order they were recorded."""
        with self._lock:
            return list(self._events)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def select(self, name: str | None = None, kind: str | None = None, **attrs: Any) -> list[Event]:
        """The events with this name, kind and attr values (None: any), in order."""
        return [e for e in self.events if e.matches(name, kind, **attrs)]

    def index(
        self, name: str | None = None, kind: str | None = None, *, start: int = 0, **attrs: Any
    ) -> int:
        """Position of the first event from ``start`` on that matches; ValueError if none."""
        for i, e in enumerate(self.events[start:], start):
            if e.matches(name, kind, **attrs):
                return i
        raise ValueError(
            f"no event with name={name!r}, kind={kind!r}, attrs={attrs!r} from index {start}"
        )

    def first(self, name: str | None = None, kind: str | None = None, **attrs: Any) -> Event:
        """The first matching event; ValueError if none."""
        return self.events[self.index(name, kind, **attrs)]

    def to_jsonl(self, path: str | PathLike[str]) -> None:
        """Write the events as JSON lines (one object per event); attrs must be JSON values."""
        lines = [json.dumps(e.to_json(), allow_nan=True) for e in self.events]
        Path(path).write_text("".join(line + "\n" for line in lines))

    @classmethod
    def from_jsonl(
        cls, path: str | PathLike[str], clock: Callable[[], float] = time.perf_counter
    ) -> EventLog:
        """A log holding the events of a file :meth:`to_jsonl` wrote."""
        log = cls(clock)
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                event = Event(
                    record["name"], record["kind"], float(record["t"]), dict(record["attrs"])
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: line {number} is not an event record: {e}") from e
            log._events.append(event)
        return log
