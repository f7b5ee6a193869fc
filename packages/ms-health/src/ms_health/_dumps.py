"""The driver's stack-dump requests and the dumps that answer them.

A request names ranks; each of them learns of it from the reply to its next heartbeat
and answers with a :class:`~ms_health.record.StackDump`. A rank that never answers is
the finding: stopped, or holding the GIL. Only the latest requests are kept.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import attrs

from ms_health.record import StackDump

__all__ = ["DumpBook"]


@attrs.define
class _Request:
    ranks: frozenset[int]
    at: float
    dumps: dict[int, StackDump] = attrs.field(factory=dict)


class DumpBook:
    """Thread-safe; request ids count from 1."""

    def __init__(self, keep: int = 64) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._answered = threading.Condition(self._lock)
        self._requests: dict[int, _Request] = {}
        self._next = 1

    def open(self, ranks: Iterable[int], at: float) -> tuple[int, tuple[int, ...]]:
        """A new request to ``ranks``: its id and the ranks, sorted."""
        wanted = frozenset(ranks)
        if not wanted or not all(isinstance(r, int) and r >= 0 for r in wanted):
            raise ValueError(f"ranks must be a non-empty set of ints >= 0, got {sorted(wanted)}")
        with self._lock:
            request, self._next = self._next, self._next + 1
            self._requests[request] = _Request(wanted, at)
            while len(self._requests) > self._keep:
                del self._requests[min(self._requests)]
        return request, tuple(sorted(wanted))

    def pending(self, rank: int) -> int | None:
        """The oldest request ``rank`` has not answered yet."""
        with self._lock:
            for request in sorted(self._requests):
                req = self._requests[request]
                if rank in req.ranks and rank not in req.dumps:
                    return request
        return None

    def answer(self, dump: StackDump) -> str | None:
        """Take ``dump``; or why it answers no open request."""
        with self._lock:
            req = self._requests.get(dump.request)
            if req is None or dump.rank not in req.ranks:
                return f"no open dump request {dump.request} for rank {dump.rank}"
            req.dumps[dump.rank] = dump
            self._answered.notify_all()
        return None

    def answers(self, request: int) -> dict[int, StackDump]:
        with self._lock:
            return dict(self._get(request).dumps)

    def wait(self, request: int, timeout_s: float) -> dict[int, StackDump]:
        with self._lock:
            req = self._get(request)
            self._answered.wait_for(lambda: req.ranks <= req.dumps.keys(), timeout=timeout_s)
            return dict(req.dumps)

    def _get(self, request: int) -> _Request:
        try:
            return self._requests[request]
        except KeyError:
            known = sorted(self._requests)
            raise KeyError(f"no dump request {request}; known: {known}") from None
