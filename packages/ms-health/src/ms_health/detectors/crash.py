"""A rank that stops sending heartbeats: its process died, or its host did."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ms_health.detectors._common import (
    StateReader,
    detector_name,
    integer,
    listed,
    number,
    rank_set,
)
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord

__all__ = ["MissingHeartbeat"]

_VERSION = 1


class MissingHeartbeat:
    """Reports the ranks whose last heartbeat, by the driver's clock, is older than
    ``timeout_s`` (kind ``"crash"``).

    A rank whose last heartbeat said ``status="stopping"`` is not reported: it ends on
    purpose. A rank is known once it has sent a heartbeat; with ``expected_ranks``
    (the world size), a rank that has sent none ``startup_grace_s`` after the
    detector's first call (or after :meth:`reset` of that rank) is reported as well.

    :meth:`for_interval` derives the timeout from the sender's interval.
    """

    #: The timeout :meth:`for_interval` gives is this many sender intervals...
    INTERVALS = 3
    #: ...and never shorter than this: at a 0.5 s interval and a 0.25 s check tick a
    #: crash is seen within 2 s, and one late heartbeat (a GC pause, a busy core) is
    #: not a crash.
    MIN_TIMEOUT_S = 1.5

    def __init__(
        self,
        timeout_s: float = MIN_TIMEOUT_S,
        *,
        expected_ranks: int | None = None,
        startup_grace_s: float = 60.0,
        name: str = "missing_heartbeat",
    ) -> None:
        self.name = detector_name(name)
        self.timeout_s = number("timeout_s", timeout_s, low=0.0)
        self.expected_ranks = (
            None if expected_ranks is None else integer("expected_ranks", expected_ranks, low=1)
        )
        self.startup_grace_s = number("startup_grace_s", startup_grace_s, low=0.0)
        # rank -> (driver time of its last heartbeat, that heartbeat)
        self._last: dict[int, tuple[float, HeartbeatRecord]] = {}
        # Expected ranks not heard from yet: since when the detector waits for them
        # (None: from its next call, since reset() gets no time).
        self._waiting: dict[int, float | None] = {}
        self._unstarted = False
        self.reset()

    @classmethod
    def for_interval(cls, interval_s: float, **kwargs: Any) -> MissingHeartbeat:
        """A detector whose timeout is :attr:`INTERVALS` sender intervals, at least
        :attr:`MIN_TIMEOUT_S`; other arguments as for the constructor."""
        interval = number("interval_s", interval_s, low=0.0)
        return cls(max(cls.MIN_TIMEOUT_S, cls.INTERVALS * interval), **kwargs)

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        self._start_waiting(now)
        self._last[record.rank] = (now, record)
        self._waiting.pop(record.rank, None)

    def check(self, now: float) -> list[Finding]:
        self._start_waiting(now)
        silent: dict[int, dict[str, Any]] = {}
        for rank, (at, rec) in self._last.items():
            age = now - at
            if rec.status != "stopping" and age > self.timeout_s:
                silent[rank] = {
                    "age_s": round(age, 3),
                    "seq": rec.seq,
                    "step": rec.step,
                    "phase": rec.phase,
                    "node": rec.node,
                    "host": rec.host,
                    "pid": rec.pid,
                }
        never: dict[int, dict[str, Any]] = {}
        for rank, since in self._waiting.items():
            if since is not None and now - since > self.startup_grace_s:
                never[rank] = {"never_seen": True, "waited_s": round(now - since, 3)}
        if not silent and not never:
            return []
        parts = []
        if silent:
            oldest = max(v["age_s"] for v in silent.values())
            parts.append(
                f"no heartbeat from rank(s) {sorted(silent)} for up to {oldest:.2f} s "
                f"(timeout {self.timeout_s:g} s)"
            )
        if never:
            parts.append(
                f"rank(s) {sorted(never)} sent no heartbeat in the start-up grace of "
                f"{self.startup_grace_s:g} s"
            )
        ranks = sorted(silent.keys() | never.keys())
        return [
            Finding(
                detector=self.name,
                kind="crash",
                ranks=tuple(ranks),
                message="; ".join(parts),
                evidence={
                    "timeout_s": self.timeout_s,
                    "startup_grace_s": self.startup_grace_s,
                    "missing": len(ranks),
                    "ranks": listed({**never, **silent}),
                },
                at=now,
            )
        ]

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        chosen = rank_set(ranks)
        expected = set(range(self.expected_ranks or 0))
        if chosen is None:
            self._last.clear()
            self._waiting = dict.fromkeys(sorted(expected))
            self._unstarted = bool(expected)
            return
        for rank in chosen:
            self._last.pop(rank, None)
            if rank in expected:
                self._waiting[rank] = None
                self._unstarted = True

    def state_dict(self) -> dict[str, Any]:
        """Nothing is learned: the live state is in driver-clock times, which mean
        nothing to another driver process."""
        return {"version": _VERSION, "detector": type(self).__name__}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        StateReader(state, type(self).__name__, _VERSION)

    def _start_waiting(self, now: float) -> None:
        if not self._unstarted:
            return  # the common case: one flag, not a walk over the world, per heartbeat
        for rank, since in self._waiting.items():
            if since is None:
                self._waiting[rank] = now
        self._unstarted = False
