"""When the recovery policy takes a restart it caused to be over: every rank has reported
from a new process. Elastic agents count restarts differently (one whose own workers did
not fail restarts them for the new rendezvous without counting), so a new process may
report the restart round its predecessor had."""

from __future__ import annotations

import time

from ms_health.driver import Driver
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord
from ms_health.recovery import Recovery

CRASH = Finding(detector="missing_heartbeat", kind="crash", ranks=(1,), message="m", at=0.0)


def _beat(driver: Driver, rank: int, pid: int, restart: int) -> None:
    record = HeartbeatRecord(
        job="j",
        rank=rank,
        world_size=3,
        local_rank=rank,
        node="n0",
        host="h0",
        pid=pid,
        seq=0,
        sent_at=time.time(),
        status="running",
        phase="train",
        step=7,
        restart=restart,
    )
    assert driver._take_heartbeat(record, "test")[0] == 200


def test_a_restart_is_over_once_every_rank_reports_from_a_new_process() -> None:
    driver = Driver("t", job="j", tick_s=None)
    policy = Recovery(driver)
    for rank in range(3):
        _beat(driver, rank, 100 + rank, restart=0)
    assert not policy._restarting(CRASH)  # nothing done yet
    policy._mark_acted(driver.last_records())
    assert policy._restarting(CRASH)
    _beat(driver, 0, 200, restart=1)  # the failed node's agent counted a restart
    _beat(driver, 1, 201, restart=1)
    assert policy._restarting(CRASH)
    _beat(driver, 2, 102, restart=0)  # the old process of rank 2, late: still under way
    assert policy._restarting(CRASH)
    _beat(driver, 2, 202, restart=0)  # its agent restarted it without counting
    assert not policy._restarting(CRASH)


def test_a_finding_raised_before_the_restart_was_ordered_is_not_acted_on() -> None:
    # A hang of the crashed rank's old process, found while the crash was handled,
    # reaches the policy after the restart was ordered: acting on it would end (and
    # diagnose, and blocklist) a node for a fault the restart already dealt with.
    clock = [100.0]
    driver = Driver("t", job="j", tick_s=None, clock=lambda: clock[0])
    policy = Recovery(driver)
    for rank in range(3):
        _beat(driver, rank, 100 + rank, restart=0)
    policy._mark_acted(driver.last_records())  # at 100.0
    queued = Finding(detector="hang", kind="hang", ranks=(1,), message="m", at=99.0)
    policy(queued)
    stale = [e for e in driver.events() if e.kind == "recovery"]
    assert len(stale) == 1 and "raised before the restart already ordered" in stale[0].message
    assert not [e for e in driver.events() if e.kind in ("diagnosis", "order", "rollback")]
    nan = Finding(detector="nonfinite", kind="nonfinite", ranks=(2,), message="m", at=99.5, step=9)
    policy(nan)
    assert not [e for e in driver.events() if e.kind == "rollback"]
