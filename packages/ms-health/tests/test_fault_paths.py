"""The paths a fault takes: a driver restarted under running senders, and a stopped
rank (a real process, SIGSTOPped) that cannot answer a stack dump while a live one does."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ms_health.driver import Driver
from ms_health.executor import Heartbeat

sys.path.insert(0, str(Path(__file__).parent))
from _driver_support import DEADLINE_S, TOKEN, SilenceDetector, wait_until

HERE = Path(__file__).parent


def test_the_sender_survives_a_driver_restart_on_the_same_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ms_health.executor")
    state = tmp_path / "state.json"
    first = SilenceDetector()
    old = Driver(TOKEN, detectors=[first], state_path=state, tick_s=0.05).start()
    port = old.port
    with Heartbeat(old.url, TOKEN, job="j", interval_s=0.05) as hb:
        hb.set_phase("train")
        wait_until(lambda: first.longest.get(0), "a learned gap between heartbeats")
        old.stop()
        learned = json.loads(state.read_text())["detectors"]["silence"]["longest"]
        wait_until(lambda: hb.failures >= 3, "failed heartbeats while no driver runs")
        second = SilenceDetector()
        new = Driver(TOKEN, port=port, detectors=[second], state_path=state, tick_s=0.05)
        # the learned state is back before the first heartbeat reaches the new driver
        assert second.longest == {int(r): v for r, v in learned.items()}
        with new:
            assert new.port == port and new.job == "j"
            wait_until(
                lambda: (new.ranks() or [{}])[0].get("record"), "a heartbeat at the new driver"
            )
            failures = hb.failures
            seen = new.ranks()[0]["heartbeats"]
            wait_until(lambda: new.ranks()[0]["heartbeats"] >= seen + 3, "heartbeats going on")
            assert hb.failures == failures  # no failure since the reconnect
            record = new.ranks()[0]["record"]
            assert record["phase"] == "train" and record["seq"] > 3
            assert new.status()["ranks"]["alive"] == 1
            assert new.tick() == []  # no false alarm from the outage
            hb.stop()
            assert new.ranks()[0]["record"]["status"] == "stopping"
    logged = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ms_health.executor"]
    # one warning for the whole outage (a 503 while the old driver stopped, then refused
    # connections), and one note at its end
    assert [level for level, _ in logged] == [logging.WARNING, logging.INFO], logged
    assert "again" in logged[1][1]


def _sender(url: str, rank: int, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "MS_HEALTH_URL": url,
        "MS_HEALTH_TOKEN": TOKEN,
        "MS_HEALTH_JOB": "j",
        "RANK": str(rank),
        "WORLD_SIZE": "2",
    }
    return subprocess.Popen(
        [sys.executable, str(HERE / "_sender_proc.py"), *args],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


@pytest.fixture
def driver() -> Iterator[Driver]:
    with Driver(TOKEN, tick_s=None, world_size=2, job="j") as d:
        yield d


@pytest.mark.timeout(120)
def test_a_stopped_rank_does_not_answer_a_dump_and_a_live_one_does(driver: Driver) -> None:
    procs = [_sender(driver.url, rank) for rank in (0, 1)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

        def stepping() -> bool:
            ranks = driver.ranks()
            return len(ranks) == 2 and all((r["record"] or {}).get("step") for r in ranks)

        wait_until(stepping, "both ranks stepping")
        os.kill(procs[1].pid, signal.SIGSTOP)
        wait_until(lambda: _state(procs[1].pid) == "T", "rank 1 stopped")
        request = driver.request_dumps([0, 1])
        wait_until(lambda: 0 in driver.dumps(request), "rank 0's dump")
        # Time for several more heartbeats of rank 0, in which a live rank 1 would answer.
        seen = driver.ranks()[0]["heartbeats"]
        wait_until(lambda: driver.ranks()[0]["heartbeats"] >= seen + 5, "more heartbeats")
        dumps = driver.dumps(request)
        assert list(dumps) == [0]
        live = dumps[0]
        assert live.pid == procs[0].pid and live.step is not None
        assert "_step_loop_marker" in live.stacks and "MainThread" in live.stacks
        assert live.last_op is not None and live.last_op["name"] == "all_reduce"
        # Resumed, the same process answers the request it could not answer stopped.
        os.kill(procs[1].pid, signal.SIGCONT)
        dumps = driver.wait_dumps(request, timeout_s=DEADLINE_S)
        assert sorted(dumps) == [0, 1] and dumps[1].pid == procs[1].pid
    finally:
        for proc in procs:
            proc.kill()  # SIGKILL ends a stopped process too
            proc.wait(DEADLINE_S)
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.mark.timeout(120)
def test_a_rank_holding_the_gil_sends_nothing_and_answers_no_dump(driver: Driver) -> None:
    procs = [_sender(driver.url, 0), _sender(driver.url, 1, "hold-gil")]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert procs[1].stdout is not None and procs[1].stdout.readline().strip() == "holding"

        def beats(rank: int) -> int:
            return next((r["heartbeats"] for r in driver.ranks() if r["rank"] == rank), 0)

        # rank 1 falls silent while rank 0 goes on: its process is alive, its thread stuck
        def rank1_silent() -> bool:
            before, mine = beats(1), beats(0)
            wait_until(lambda: beats(0) >= mine + 5, "rank 0's heartbeats")
            return beats(1) == before

        wait_until(rank1_silent, "rank 1 silent")
        request = driver.request_dumps([0, 1])
        wait_until(lambda: 0 in driver.dumps(request), "rank 0's dump")
        seen = beats(0)
        wait_until(lambda: beats(0) >= seen + 5, "more heartbeats of rank 0")
        assert list(driver.dumps(request)) == [0]
        assert procs[1].poll() is None and _state(procs[1].pid) in "RS"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(DEADLINE_S)
            if proc.stdout is not None:
                proc.stdout.close()
