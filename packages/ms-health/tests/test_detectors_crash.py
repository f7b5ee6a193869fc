"""MissingHeartbeat on a virtual clock: silence past the timeout is a crash, a rank that
said it stops is not, and a restarted rank is forgotten until it beats again."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from ms_health.detectors import MissingHeartbeat
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord, parse_heartbeat

BASE = HeartbeatRecord(
    job="job",
    rank=0,
    world_size=4,
    local_rank=0,
    node="n0",
    host="h0",
    pid=100,
    seq=0,
    sent_at=0.0,
    status="running",
    phase="train",
)


def beat(rank: int, **kw: Any) -> HeartbeatRecord:
    """A heartbeat of ``rank`` as the driver gets it: through the wire format."""
    rec = attrs.evolve(BASE, **{"rank": rank, "pid": 100 + rank, "node": f"n{rank // 2}", **kw})
    return parse_heartbeat(json.dumps(rec.to_json()))


def run(
    det: MissingHeartbeat,
    *,
    until: float,
    beats: dict[int, float],
    stopping_at: dict[int, float] | None = None,
    interval: float = 0.5,
    tick: float = 0.25,
    start: float = 0.0,
) -> list[Finding]:
    """Ranks beat every ``interval`` until ``beats[rank]`` (their last beat); the driver
    checks every ``tick``. Returns every finding of every check."""
    stopping_at = stopping_at or {}
    found: list[Finding] = []
    n = round((until - start) / tick)
    every = round(interval / tick)
    for i in range(n + 1):
        now = start + i * tick
        if i % every == 0:
            for rank, last in beats.items():
                if now <= last:
                    status = "stopping" if now >= stopping_at.get(rank, float("inf")) else "running"
                    det.observe(beat(rank, seq=i, status=status), now)
        found += det.check(now)
    return found


def test_a_silent_rank_is_reported_once_past_the_timeout_and_on_every_check_after() -> None:
    det = MissingHeartbeat.for_interval(0.5)
    assert det.timeout_s == 1.5
    # Rank 1's last beat arrives at 5.0 and it dies right after.
    found = run(det, until=8.0, beats={0: 99.0, 1: 5.0, 2: 99.0})
    assert found, "the crash was not reported"
    first = found[0]
    assert first.kind == "crash" and first.ranks == (1,)
    # First check where the age exceeds 1.5 s: 6.75 s; within 2 s of a crash at 5.0+.
    assert first.at == 6.75
    assert first.at - 5.0 <= 2.0
    assert first.evidence["ranks"]["1"]["age_s"] == 1.75
    assert first.evidence["ranks"]["1"]["node"] == "n0"
    assert first.evidence["timeout_s"] == 1.5
    # Reported again at each later check: 7.0 ... 8.0.
    assert [f.at for f in found] == [6.75, 7.0, 7.25, 7.5, 7.75, 8.0]
    assert all(f.ranks == (1,) for f in found)
    json.dumps(first.to_json(), allow_nan=False)


def test_a_beat_that_comes_back_clears_the_finding() -> None:
    det = MissingHeartbeat(timeout_s=1.5)
    det.observe(beat(0), 0.0)
    assert [f.ranks for f in det.check(2.0)] == [(0,)]
    det.observe(beat(0, seq=1), 2.1)
    assert det.check(2.2) == []


def test_a_rank_that_said_it_stops_is_not_a_crash() -> None:
    det = MissingHeartbeat(timeout_s=1.5)
    found = run(det, until=20.0, beats={0: 99.0, 1: 5.0}, stopping_at={1: 4.5})
    assert found == []
    # A new process of rank 1 that runs and then goes silent is a crash again.
    det.observe(beat(1, pid=555, seq=0), 20.0)
    assert run(det, start=20.0, until=21.5, beats={0: 99.0}) == []
    assert [f.ranks for f in det.check(21.6)] == [(1,)]


def test_a_never_seen_rank_is_missing_after_the_startup_grace() -> None:
    det = MissingHeartbeat(timeout_s=1.5, expected_ranks=3, startup_grace_s=10.0)
    # The grace runs from the first call: 100.0 on the driver's clock.
    found = run(det, start=100.0, until=112.0, beats={0: 999.0, 1: 999.0})
    assert found
    assert found[0].ranks == (2,) and found[0].at == 110.25
    assert found[0].evidence["ranks"]["2"] == {"never_seen": True, "waited_s": 10.25}
    assert "start-up grace" in found[0].message
    det.observe(beat(2), 112.1)
    assert det.check(112.2) == []


def test_a_restarted_rank_is_forgotten_until_it_beats_then_watched_again() -> None:
    det = MissingHeartbeat(timeout_s=1.5, expected_ranks=2, startup_grace_s=30.0)
    found = run(det, until=6.0, beats={0: 99.0, 1: 3.0})
    assert found and found[-1].ranks == (1,)
    det.reset((1,))  # the driver restarts rank 1; its new process takes 20 s to start
    found = run(det, start=6.25, until=26.0, beats={0: 99.0})
    assert found == []
    found = run(det, start=26.5, until=40.0, beats={0: 99.0, 1: 35.0})
    assert found and found[0].ranks == (1,) and found[0].at == 36.75


def test_a_rank_reset_and_never_back_is_missing_after_a_new_grace() -> None:
    det = MissingHeartbeat(timeout_s=1.5, expected_ranks=2, startup_grace_s=30.0)
    run(det, until=3.0, beats={0: 99.0, 1: 99.0})
    det.reset((1,))
    found = run(det, start=10.0, until=45.0, beats={0: 99.0})
    assert found and found[0].ranks == (1,) and found[0].at == 40.25


def test_reset_of_all_ranks_restarts_the_grace() -> None:
    det = MissingHeartbeat(timeout_s=1.5, expected_ranks=2, startup_grace_s=5.0)
    assert run(det, until=6.0, beats={})[0].ranks == (0, 1)
    det.reset()
    assert run(det, start=50.0, until=55.0, beats={}) == []
    assert run(det, start=55.25, until=55.25, beats={})[0].ranks == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"expected_ranks": 0}, "expected_ranks"),
        ({"expected_ranks": 2.0}, "expected_ranks"),
        ({"startup_grace_s": -1.0}, "startup_grace_s"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MissingHeartbeat(**kwargs)


@pytest.mark.parametrize("interval", [0.0, -0.5, float("inf"), "0.5"])
def test_for_interval_refuses_a_bad_interval(interval: Any) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        MissingHeartbeat.for_interval(interval)


def test_for_interval_scales_with_slow_senders() -> None:
    assert MissingHeartbeat.for_interval(0.1).timeout_s == 1.5
    assert MissingHeartbeat.for_interval(2.0).timeout_s == 6.0
