"""What the sender and driver tests share: small real detectors, HTTP calls, polling.

``SilenceDetector`` is a real (if simple) detector: it learns, per rank, the longest
gap between heartbeats and reports a crash when a rank stays silent for ``factor``
times that. Its learned gaps are its checkpointed state, which is what the driver
restart tests look for. ``Recorder`` keeps every heartbeat it is shown.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ms_health.findings import Finding
from ms_health.record import FORMAT, HeartbeatRecord

TOKEN = "test-token-5f0b7a1c"
DEADLINE_S = 30.0  # how long a test waits for something that happens within a second

T = TypeVar("T")


class SilenceDetector:
    """Reports ``crash`` for a running rank silent > ``factor`` x its longest gap seen."""

    def __init__(self, name: str = "silence", *, factor: float = 3.0, floor_s: float = 0.5):
        self.name = name
        self.factor, self.floor_s = factor, floor_s
        self.longest: dict[int, float] = {}  # learned
        self._last: dict[int, float] = {}  # live
        self._stopping: set[int] = set()

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        last = self._last.get(record.rank)
        if last is not None:
            self.longest[record.rank] = max(self.longest.get(record.rank, 0.0), now - last)
        self._last[record.rank] = now
        if record.status == "stopping":
            self._stopping.add(record.rank)
        else:
            self._stopping.discard(record.rank)

    def limit(self, rank: int) -> float:
        return max(self.floor_s, self.factor * self.longest.get(rank, 0.0))

    def check(self, now: float) -> list[Finding]:
        found = []
        for rank, last in sorted(self._last.items()):
            silent = now - last
            if rank not in self._stopping and silent > self.limit(rank):
                found.append(
                    Finding(
                        detector=self.name,
                        kind="crash",
                        ranks=(rank,),
                        message=f"no heartbeat for {silent:.1f} s > {self.limit(rank):.1f} s",
                        evidence={"silent_s": silent, "limit_s": self.limit(rank)},
                        at=now,
                    )
                )
        return found

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        for rank in list(self._last) if ranks is None else ranks:
            self._last.pop(rank, None)
            self._stopping.discard(rank)

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "longest": {str(r): v for r, v in self.longest.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != 1:
            raise ValueError(f"format must be 1, got {state.get('format')!r}")
        longest = state.get("longest")
        if not isinstance(longest, Mapping):
            raise ValueError(f"longest must be a mapping, got {longest!r}")
        learned = {}
        for key, value in longest.items():
            if not str(key).isdigit() or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"longest must map ranks to seconds >= 0, got {key!r}: {value!r}")
            learned[int(key)] = float(value)
        self.longest = learned


class Recorder:
    """Keeps every heartbeat the driver accepts, with its receipt time; finds nothing."""

    name = "recorder"

    def __init__(self) -> None:
        self.records: list[tuple[HeartbeatRecord, float]] = []
        self._lock = threading.Lock()

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        with self._lock:
            self.records.append((record, now))

    def of(self, rank: int) -> list[HeartbeatRecord]:
        with self._lock:
            return [r for r, _ in self.records if r.rank == rank]

    def check(self, now: float) -> list[Finding]:
        return []

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != 1:
            raise ValueError(f"format must be 1, got {state.get('format')!r}")


class BrokenDetector:
    """Raises from ``check`` (and from ``observe`` when asked): the driver must survive."""

    name = "broken"

    def __init__(self, *, in_observe: bool = False) -> None:
        self.in_observe = in_observe
        self.checks = 0

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        if self.in_observe:
            raise RuntimeError("observe broke")

    def check(self, now: float) -> list[Finding]:
        self.checks += 1
        raise RuntimeError("check broke")

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def make_detectors() -> list[Any]:
    """For ``--detectors _driver_support:make_detectors`` in the CLI tests."""
    return [SilenceDetector()]


def heartbeat_body(**fields: Any) -> dict[str, Any]:
    """A valid heartbeat of rank 0 of 2 in job ``j``, with ``fields`` replaced."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "type": "heartbeat",
        "job": "j",
        "rank": 0,
        "world_size": 2,
        "local_rank": 0,
        "node": "n0",
        "host": "h0",
        "pid": 123,
        "seq": 0,
        "sent_at": 1.0,
        "status": "running",
        "phase": "train",
    }
    body.update(fields)
    return body


def request(
    url: str,
    method: str,
    path: str,
    *,
    body: bytes | Mapping[str, Any] | None = None,
    token: str | None = TOKEN,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, Any]:
    """One request on a fresh connection: (status, decoded JSON or text)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=DEADLINE_S)
    try:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if isinstance(body, Mapping) else body
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        raw = response.read()
        if response.getheader("Content-Type", "").startswith("application/json"):
            return response.status, json.loads(raw)
        return response.status, raw.decode()
    finally:
        conn.close()


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = DEADLINE_S) -> T:
    """Poll ``condition`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def same_float(a: float | None, b: float | None) -> bool:
    """Equal, NaN equal to NaN."""
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or a == b
