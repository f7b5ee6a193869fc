"""ThroughputDrop: a lasting fall of the job's tokens/s below a fraction of its own
baseline, not a dip, not a checkpoint."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_health.detectors import ThroughputDrop
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord

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


def feed(
    det: ThroughputDrop,
    steps: range,
    tps: Callable[[int, int], float],
    *,
    ranks: int = 4,
    phase: Callable[[int], str] = lambda s: "train",
    pid: int = 100,
) -> dict[int, list[Finding]]:
    """Every rank reports every step; the driver checks after each step."""
    out = {}
    for step in steps:
        now = 0.5 * step
        for rank in range(ranks):
            rec = attrs.evolve(
                BASE,
                rank=rank,
                pid=pid + rank,
                step=step,
                phase=phase(step),
                tokens_per_s=tps(step, rank),
            )
            det.observe(rec, now)
        out[step] = det.check(now + 0.25)
    return out


def noisy(level: float) -> Callable[[int, int], float]:
    def tps(step: int, rank: int) -> float:
        return level * random.Random(step * 7 + rank).uniform(0.95, 1.05)

    return tps


def test_a_lasting_drop_is_reported_after_patience_steps() -> None:
    det = ThroughputDrop()  # 0.7 x baseline, 5 steps
    normal, slow = noisy(1000.0), noisy(500.0)
    found = feed(det, range(60), lambda s, r: slow(s, r) if s >= 30 else normal(s, r))
    # Steps 30..34 are slow; step 34 is complete once step 35 shows up.
    assert all(found[s] == [] for s in range(35))
    assert found[35], "the drop was not reported"
    f = found[35][0]
    assert (f.kind, f.ranks, f.step) == ("throughput", (), 34)
    assert f.at == 0.5 * 35
    assert f.evidence["ratio"] == pytest.approx(0.5, abs=0.05)
    assert f.evidence["baseline"] == pytest.approx(1000.0, rel=0.05)
    assert f.evidence["slow_steps"] == 5 and f.evidence["ranks_reporting"] == 4
    assert [s for s, _ in f.evidence["recent"]] == [30, 31, 32, 33, 34]
    json.dumps(f.to_json(), allow_nan=False)
    # It lasts: reported on every check; the baseline is not dragged down by it.
    assert all(len(found[s]) == 1 for s in range(35, 60))
    assert det.baseline == pytest.approx(1000.0, rel=0.05)
    # Back to normal speed: cleared.
    found = feed(det, range(60, 70), normal)
    assert found[61] == []


def test_a_brief_dip_and_checkpoints_are_not_a_drop() -> None:
    det = ThroughputDrop()
    normal = noisy(1000.0)

    def tps(step: int, rank: int) -> float:
        if 30 <= step < 34:  # four slow steps: one less than the patience
            return 300.0
        if step % 20 == 19:  # the heartbeats during a checkpoint
            return 10.0
        return normal(step, rank)

    found = feed(det, range(100), tps, phase=lambda s: "checkpoint" if s % 20 == 19 else "train")
    assert all(f == [] for f in found.values())


def test_a_drop_must_also_last_min_duration_s() -> None:
    """Steps every 0.5 s: 5 slow steps are 2.5 s, a busy neighbour's moment; with
    min_duration_s=10 the drop is reported once it has lasted 10 s (step 50), and
    a dip of 15 steps (7.5 s) is not."""
    det = ThroughputDrop(min_duration_s=10.0)
    normal, slow = noisy(1000.0), noisy(500.0)
    found = feed(det, range(80), lambda s, r: slow(s, r) if 10 <= s < 25 else normal(s, r))
    assert all(f == [] for f in found.values())
    found = feed(det, range(80, 120), lambda s, r: slow(s, r) if s >= 90 else normal(s, r))
    # step 90 judged at 0.5 * 91 s; step k at 0.5 * (k + 1): 10 s later is step 110
    assert all(found[s] == [] for s in range(80, 111))
    f = found[111][0]
    assert f.step == 110 and f.evidence["slow_s"] == 10.0 and f.evidence["slow_steps"] == 21


def test_no_judgement_during_warmup() -> None:
    det = ThroughputDrop(warmup=10)
    found = feed(det, range(15), lambda s, r: 100.0 if s < 5 else 1000.0 if s < 9 else 10.0)
    assert all(f == [] for f in found.values())


def test_the_baseline_survives_a_driver_restart() -> None:
    det = ThroughputDrop()
    feed(det, range(30), noisy(1000.0))
    saved = json.loads(json.dumps(det.state_dict()))
    restarted = ThroughputDrop()
    restarted.load_state_dict(saved)
    assert restarted.baseline == det.baseline
    found = feed(restarted, range(30, 40), noisy(400.0))
    assert found[35] and found[35][0].step == 34, "no warm-up again after the restart"


def test_a_rollback_restarts_the_count_and_keeps_the_baseline() -> None:
    det = ThroughputDrop()
    feed(det, range(40), noisy(1000.0))
    assert all(f == [] for f in feed(det, range(40, 44), noisy(400.0)).values())
    # The job restarts from step 20: the three slow steps seen do not carry over (with
    # two more after the restart they would make the five of the patience).
    det.reset()
    found = feed(det, range(20, 40), lambda s, r: 400.0 if s < 22 else 1000.0, pid=500)
    assert all(f == [] for f in found.values())
    assert det.baseline == pytest.approx(1000.0, rel=0.05)


@settings(max_examples=100, deadline=None)
@given(
    level=st.floats(1.0, 1e7),
    wobble=st.lists(st.floats(0.75, 1.0), min_size=20, max_size=80),
)
def test_a_job_that_stays_above_the_fraction_is_never_reported(
    level: float, wobble: list[float]
) -> None:
    # Any figure >= 0.75 x level stays above 0.7 x a median that is at most level.
    det = ThroughputDrop(warmup=3)
    found = feed(det, range(len(wobble)), lambda s, r: level * wobble[s], ranks=2)
    assert all(f == [] for f in found.values())


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"version": 0, "detector": "ThroughputDrop", "history": []}, r"state\['version'\]"),
        ({"version": 1, "detector": "ThroughputDrop", "history": [-5.0]}, r"\['history'\]\[0\]"),
        ({"version": 1, "detector": "ThroughputDrop", "history": "1,2"}, r"state\['history'\]"),
        ([1, 2], "state must be a mapping"),
    ],
)
def test_a_bad_throughput_state_is_refused_naming_the_field(state: Any, field: str) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        ThroughputDrop().load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fraction": 1.0}, "fraction"),
        ({"fraction": 0}, "fraction"),
        ({"patience": 0}, "patience"),
        ({"min_duration_s": -1.0}, "min_duration_s"),
        ({"window": 0}, "window"),
        ({"warmup": 51}, "warmup"),
    ],
)
def test_bad_throughput_arguments_are_refused_naming_them(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        ThroughputDrop(**kwargs)
