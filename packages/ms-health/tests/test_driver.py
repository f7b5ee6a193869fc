"""The driver: findings from detectors (on an injected clock), events, endpoints, the
job's shape, stack-dump bookkeeping, and its checkpointed state."""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ms_health.driver import STATE_FORMAT, Driver
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord

sys.path.insert(0, str(Path(__file__).parent))
from _driver_support import (
    TOKEN,
    BrokenDetector,
    Recorder,
    SilenceDetector,
    heartbeat_body,
    request,
    wait_until,
)


class FakeClock:
    """The driver's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class NanDetector:
    """A second real detector: a non-finite loss, reported for the step it came at."""

    name = "nan"

    def __init__(self) -> None:
        self.bad: dict[int, int | None] = {}

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        if record.loss is not None and not math.isfinite(record.loss):
            self.bad[record.rank] = record.step

    def check(self, now: float) -> list[Finding]:
        return [
            Finding("nan", "nonfinite", (r,), f"loss at step {s} not finite", {"step": s}, now, s)
            for r, s in sorted(self.bad.items())
        ]

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        self.bad.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1}

    def load_state_dict(self, state: Any) -> None:
        pass


def beat(driver: Driver, **fields: Any) -> tuple[int, Any]:
    return request(driver.url, "POST", "/heartbeat", body=heartbeat_body(**fields))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def acted() -> list[Finding]:
    return []


@pytest.fixture
def driver(clock: FakeClock, acted: list[Finding], tmp_path: Path) -> Iterator[Driver]:
    with Driver(
        TOKEN,
        detectors=[SilenceDetector(), NanDetector()],
        tick_s=None,
        clock=clock,
        on_finding=acted.append,
        events_path=tmp_path / "events.jsonl",
        state_path=tmp_path / "state.json",
    ) as d:
        yield d


def kinds(driver: Driver, kind: str) -> list[Any]:
    return [e for e in driver.events() if e.kind == kind]


def test_a_persisting_condition_is_one_finding_one_event_one_action(
    driver: Driver, clock: FakeClock, acted: list[Finding]
) -> None:
    assert beat(driver, rank=0)[0] == 200
    clock.now += 1.0
    assert beat(driver, rank=0)[0] == 200  # learns a 1 s gap: limit 3 s
    clock.now += 2.0
    assert driver.tick() == []
    clock.now += 2.0
    (finding,) = driver.tick()
    assert finding.kind == "crash" and finding.ranks == (0,) and finding.at == clock.now
    for _ in range(5):  # still silent: still open, nothing new
        clock.now += 1.0
        assert driver.tick() == []
    assert [f.kind for f in driver.open_findings()] == ["crash"]
    (event,) = kinds(driver, "finding")
    assert event.ranks == (0,) and event.evidence["action"] == "on_finding"
    assert event.evidence["finding"]["evidence"]["limit_s"] == 3.0
    wait_until(lambda: acted, "on_finding")
    assert acted == [finding]
    # the rank comes back: the finding clears; a new silence is a new finding
    assert beat(driver, rank=0)[0] == 200
    assert driver.tick() == [] and driver.open_findings() == []
    assert len(kinds(driver, "cleared")) == 1
    clock.now += 100.0
    assert len(driver.tick()) == 1 and len(kinds(driver, "finding")) == 2
    wait_until(lambda: len(acted) == 2, "the second on_finding")


def test_new_findings_come_most_urgent_kind_first(driver: Driver, clock: FakeClock) -> None:
    beat(driver, rank=0, step=3, loss="nan")
    beat(driver, rank=1)
    clock.now += 100.0
    found = driver.tick()
    assert [(f.kind, f.ranks) for f in found] == [
        ("crash", (0,)),
        ("crash", (1,)),
        ("nonfinite", (0,)),
    ]
    assert found[2].step == 3


def test_observe_only_records_would_act_and_never_calls_on_finding(tmp_path: Path) -> None:
    clock, acted = FakeClock(), []
    with Driver(
        TOKEN,
        detectors=[NanDetector()],
        tick_s=None,
        clock=clock,
        on_finding=acted.append,
        observe_only=True,
    ) as driver:
        beat(driver, loss="nan", step=7)
        (finding,) = driver.tick()
        assert finding.step == 7
        (event,) = kinds(driver, "finding")
        assert event.message.startswith("would act: nan: nonfinite")
        assert event.evidence["action"] == "would act (observe-only)"
        assert request(driver.url, "GET", "/status")[1]["observe_only"] is True
    assert acted == []


def test_a_detector_that_raises_is_reported_and_the_others_still_run(tmp_path: Path) -> None:
    clock = FakeClock()
    broken = BrokenDetector(in_observe=True)
    with Driver(TOKEN, detectors=[broken, NanDetector()], tick_s=None, clock=clock) as driver:
        assert beat(driver, loss="nan")[0] == 200
        assert [f.kind for f in driver.tick()] == ["nonfinite"]
        for _ in range(3):
            driver.tick()
        assert broken.checks == 4
        errors = kinds(driver, "detector_error")
        # one event per detector method per minute, not one per call
        assert sorted(e.evidence["method"] for e in errors) == ["check", "observe"]


def test_on_finding_that_raises_is_an_event(tmp_path: Path) -> None:
    def policy(f: Finding) -> None:
        raise RuntimeError("no recovery today")

    with Driver(TOKEN, detectors=[NanDetector()], tick_s=None, on_finding=policy) as driver:
        beat(driver, loss="nan")
        driver.tick()
        event = wait_until(lambda: kinds(driver, "action_error"), "the action error")[0]
        assert "no recovery today" in event.message and event.ranks == (0,)


def test_the_tick_thread_finds_without_being_called() -> None:
    acted: list[Finding] = []
    done = threading.Event()

    def policy(f: Finding) -> None:
        acted.append(f)
        done.set()

    with Driver(TOKEN, detectors=[NanDetector()], tick_s=0.02, on_finding=policy) as driver:
        beat(driver, loss="inf", step=2)
        assert done.wait(30)
    assert [f.kind for f in acted] == ["nonfinite"]


def test_status_ranks_and_metrics(driver: Driver, clock: FakeClock) -> None:
    beat(driver, rank=0, step=10, phase="train", loss=1.5, tokens_per_s=100.0, step_time_s=0.2)
    beat(driver, rank=1, step=8, phase="checkpoint", loss="nan", job="j")
    clock.now += 2.0
    status = request(driver.url, "GET", "/status")[1]
    assert status["job"] == "j" and status["world_size"] == 2
    assert status["ranks"] == {"known": 2, "alive": 2, "stale": 0, "stopping": 0, "never_heard": []}
    assert status["latest_step"] == 10 and status["slowest_step"] == 8
    assert status["phases"] == {"train": 1, "checkpoint": 1}
    clock.now += 10.0  # past stale_after_s
    beat(driver, rank=1, status="stopping", phase="shutdown")
    status = request(driver.url, "GET", "/status")[1]
    assert status["ranks"]["stale"] == 1 and status["ranks"]["stopping"] == 1
    assert status["ranks"]["alive"] == 0 and status["heartbeats"] == 3
    ranks = request(driver.url, "GET", "/ranks")[1]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["age_s"] == 12.0 and ranks[1]["age_s"] == 0.0
    assert ranks[0]["record"]["step"] == 10 and ranks[1]["record"]["status"] == "stopping"
    code, text = request(driver.url, "GET", "/metrics")
    assert code == 200
    lines = set(text.splitlines())
    assert 'ms_health_rank_step{job="j",rank="0"} 10' in lines
    assert 'ms_health_rank_loss{job="j",rank="0"} 1.5' in lines
    assert 'ms_health_rank_tokens_per_second{job="j",rank="0"} 100.0' in lines
    assert 'ms_health_rank_step_time_seconds{job="j",rank="0"} 0.2' in lines
    assert 'ms_health_rank_heartbeat_age_seconds{job="j",rank="0"} 12.0' in lines
    assert 'ms_health_rank_heartbeats_total{job="j",rank="1"} 2' in lines
    assert 'ms_health_heartbeats_total{job="j"} 3' in lines
    assert 'ms_health_findings_total{kind="crash"} 0' in lines
    assert "# TYPE ms_health_rejected_requests_total counter" in lines
    # every sample line is NAME{labels} VALUE with a parseable value
    for line in text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1].replace("+Inf", "inf"))
    driver.tick()
    assert 'ms_health_findings_total{kind="crash"} 1' in request(driver.url, "GET", "/metrics")[1]


def test_metrics_escape_a_hostile_job_name() -> None:
    with Driver(TOKEN, tick_s=None) as driver:
        beat(driver, job='a"b\\c\nd', loss="nan")
        text = request(driver.url, "GET", "/metrics")[1]
    assert 'ms_health_rank_loss{job="a\\"b\\\\c\\nd",rank="0"} NaN' in text.splitlines()


def test_events_endpoint_file_and_bound(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    with Driver(TOKEN, detectors=[NanDetector()], tick_s=None, events_path=path, max_events=3) as d:
        for rank in range(2):
            beat(d, rank=rank, loss="nan")
        d.request_dumps([0])
        d.tick()  # two findings
        body = request(d.url, "GET", "/events?since=0")[1]
        assert body["dropped"] is True and len(body["events"]) == 3
        last = body["last"]
        assert [e["seq"] for e in body["events"]] == [last - 2, last - 1, last]
        assert request(d.url, "GET", f"/events?since={last - 1}")[1]["events"][0]["seq"] == last
        assert request(d.url, "GET", "/events?since=x")[0] == 400
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["seq"] for e in lines] == list(range(1, len(lines) + 1))  # the file has all
    assert [e["kind"] for e in lines][:3] == ["start", "job", "dump_request"]
    assert lines[-1]["kind"] == "stop"
    finding = next(e for e in lines if e["kind"] == "finding")
    assert finding["evidence"]["finding"]["kind"] == "nonfinite"
    assert set(finding) == {"seq", "time", "at", "kind", "ranks", "message", "evidence"}


def test_job_and_world_size_are_adopted_and_enforced() -> None:
    with Driver(TOKEN, tick_s=None) as driver:
        assert beat(driver, job="a", world_size=4, rank=3)[0] == 200
        assert driver.job == "a" and driver.world_size == 4
        code, body = beat(driver, job="b", world_size=4)
        assert code == 409 and "heartbeat.job must be 'a', got 'b'" in body["error"]
        assert beat(driver, job="a", world_size=2, rank=1)[0] == 409
        # an elastic restart round may change the world size; it drops ranks beyond it
        assert beat(driver, job="a", world_size=2, rank=1, restart=1)[0] == 200
        assert driver.world_size == 2
        assert [r["rank"] for r in request(driver.url, "GET", "/ranks")[1]["ranks"]] == [1]
        assert beat(driver, job="a", world_size=4, rank=3, restart=1)[0] == 409
        assert len(kinds(driver, "world_size")) == 1


def test_a_given_world_size_is_fixed() -> None:
    with Driver(TOKEN, tick_s=None, world_size=2, job="j") as driver:
        code, body = beat(driver, world_size=4, rank=3, restart=9)
        assert code == 409 and "heartbeat.world_size must be 2" in body["error"]


def test_dump_bookkeeping(driver: Driver) -> None:
    reply = beat(driver, rank=0)[1]
    assert reply["ok"] is True and "dump" not in reply
    first = driver.request_dumps([0, 1])
    second = driver.request_dumps([0])
    assert second == first + 1
    assert beat(driver, rank=0)[1]["dump"] == first  # oldest first
    dump = {"format": 1, "type": "dump", "job": "j", "rank": 0, "pid": 5, "request": first,
            "sent_at": 1.0, "stacks": "Thread main\n"}  # fmt: skip
    assert request(driver.url, "POST", "/dump", body=dump)[0] == 200
    assert beat(driver, rank=0)[1]["dump"] == second
    assert list(driver.dumps(first)) == [0]
    # rank 1 never answers: the wait ends at its timeout with what came
    assert list(driver.wait_dumps(first, timeout_s=0.05)) == [0]
    # an answer to no request, or from a rank not asked, is refused
    assert request(driver.url, "POST", "/dump", body={**dump, "request": 999})[0] == 409
    assert (
        request(driver.url, "POST", "/dump", body={**dump, "rank": 1, "request": second})[0] == 409
    )
    assert request(driver.url, "POST", "/dump", body={**dump, "job": "other"})[0] == 409
    with pytest.raises(KeyError, match="no dump request 999"):
        driver.dumps(999)
    with pytest.raises(ValueError, match="ranks must be a non-empty set"):
        driver.request_dumps([])


def test_state_is_saved_when_it_changes_and_restored(tmp_path: Path, clock: FakeClock) -> None:
    state = tmp_path / "state.json"
    silence = SilenceDetector()
    with Driver(TOKEN, detectors=[silence], tick_s=None, clock=clock, state_path=state) as d:
        beat(d, rank=1)
        clock.now += 4.0
        beat(d, rank=1)
        d.tick()
        saved = json.loads(state.read_text())
        assert saved["detectors"]["silence"] == {"format": 1, "longest": {"1": 4.0}}
        assert saved["format"] == STATE_FORMAT and saved["job"] == "j" and saved["ranks"] == [1]
        seq = d.events()[-1].seq
    assert json.loads(state.read_text())["event_seq"] == seq + 1  # the stop event
    fresh = SilenceDetector()
    with Driver(TOKEN, detectors=[fresh, Recorder()], tick_s=None, state_path=state) as d2:
        assert fresh.longest == {1: 4.0}
        assert d2.job == "j" and d2.world_size == 2
        first = d2.events()[0]
        assert first.seq == seq + 2 and first.kind == "restored"  # numbering goes on
        assert first.evidence["detectors"] == ["silence"]
        status = request(d2.url, "GET", "/status")[1]
        assert status["ranks"]["never_heard"] == [0, 1]
    # a detector the next driver does not run keeps its learned state in the file
    with Driver(TOKEN, detectors=[Recorder()], tick_s=None, state_path=state):
        pass
    assert json.loads(state.read_text())["detectors"]["silence"]["longest"] == {"1": 4.0}


def test_a_changing_state_is_written_at_most_every_state_every_s(
    tmp_path: Path, clock: FakeClock
) -> None:
    # Detectors learn at every heartbeat; a synced write at every tick would cost the
    # training hosts' CPU. Learning waits for the next due write; a new finding does not.
    state = tmp_path / "state.json"
    silence = SilenceDetector()
    with Driver(
        TOKEN, detectors=[silence], tick_s=None, clock=clock, state_path=state, state_every_s=5.0
    ) as d:

        def learned() -> dict[str, float]:
            return json.loads(state.read_text())["detectors"]["silence"]["longest"]

        beat(d, rank=0)
        clock.now += 1.0
        beat(d, rank=0)
        d.tick()
        assert learned() == {"0": 1.0}  # the first change: written at once
        clock.now += 2.0
        beat(d, rank=0)  # a longer gap learned 2 s after the last write
        assert d.tick() == []
        assert learned() == {"0": 1.0}  # not due yet
        clock.now += 3.0
        d.tick()
        assert learned() == {"0": 2.0}  # 5 s after the last one
        clock.now += 0.5
        d.order("n0", "dump", rank=0, pid=7)  # an event: due at once, though 0.5 s later
        d.tick()
        assert json.loads(state.read_text())["event_seq"] == d.events()[-1].seq
        clock.now += 0.5
        beat(d, rank=1)
        clock.now += 1.0
        beat(d, rank=1)  # rank 1 learns 1 s, 1.5 s after that write: not due
        clock.now += 2.0  # rank 0 silent 7 s > 3 x 2 s: a crash, which is due at once
        assert [f.kind for f in d.tick()] == ["crash"]
        assert learned() == {"0": 2.0, "1": 1.0}
        clock.now += 1.0
        beat(d, rank=0)  # learns 8 s; the stop writes it
    assert learned() == {"0": 8.0, "1": 1.0}
    with pytest.raises(ValueError, match="state_every_s must be a finite number > 0, got 0"):
        Driver(TOKEN, state_every_s=0)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s.update(format=99), "state.format must be 1, got 99"),
        (lambda s: s.update(job="other"), "state.job is 'other', but this driver's job is 'j'"),
        (lambda s: s.update(ranks=[-1]), "state.ranks must be a list of ints >= 0"),
        (lambda s: s.update(world_size=0), "state.world_size must be an int >= 1"),
        (lambda s: s.update(event_seq="7"), "state.event_seq must be an int >= 0"),
        (
            lambda s: s["detectors"]["silence"].update(format=2),
            "state.detectors.silence: format must be 1, got 2",
        ),
    ],
)
def test_a_bad_state_is_refused_by_field(tmp_path: Path, mutate: Any, message: str) -> None:
    state = tmp_path / "state.json"
    with Driver(TOKEN, detectors=[SilenceDetector()], tick_s=None, state_path=state) as d:
        beat(d)
    saved = json.loads(state.read_text())
    mutate(saved)
    state.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Driver(TOKEN, detectors=[SilenceDetector()], job="j", state_path=state)


def test_an_unreadable_state_file_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text("{half")
    with pytest.raises(ValueError, match=r"state_path .* cannot be read"):
        Driver(TOKEN, state_path=state)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"detectors": [object()]}, TypeError, "detectors must implement findings.Detector"),
        ({"detectors": [Recorder(), Recorder()]}, ValueError, "detector names must be unique"),
        ({"world_size": 0}, ValueError, "world_size must be an int >= 1 or None, got 0"),
        ({"tick_s": 0}, ValueError, "tick_s must be a finite number > 0, got 0"),
        ({"job": ""}, ValueError, "job must be a non-empty string or None"),
        ({"on_finding": 3}, TypeError, "on_finding must be callable"),
        ({"max_events": 0}, ValueError, "max_events must be an int >= 1, got 0"),
        ({"max_connections": 1.5}, ValueError, "max_connections must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        Driver(TOKEN, **kwargs)
    for token in ("", "tok\u00e9n", "two words\n"):  # a client could not present these
        with pytest.raises(ValueError, match="token must be a non-empty string of printable"):
            Driver(token)
