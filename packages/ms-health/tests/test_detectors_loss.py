"""NonFiniteLoss and LossSpike on heartbeats that went through the wire format (where a
NaN travels as the string "nan")."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_health.detectors import LossSpike, NonFiniteLoss
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
    rec = attrs.evolve(BASE, **{"rank": rank, "pid": 100 + rank, **kw})
    return parse_heartbeat(json.dumps(rec.to_json()))


def feed(
    det: NonFiniteLoss | LossSpike,
    steps: range,
    loss: Callable[[int, int], float],
    *,
    ranks: int = 4,
    t0: float = 0.0,
    pid: int = 100,
) -> dict[int, list[Finding]]:
    """Every rank reports every step (time 0.1 s per step), then the driver checks;
    returns the findings of the check after each step."""
    out = {}
    for step in steps:
        now = t0 + 0.1 * step
        for rank in range(ranks):
            rec = beat(rank, step=step, loss=loss(step, rank), pid=pid + rank, world_size=ranks)
            det.observe(rec, now)
        out[step] = det.check(now + 0.05)
    return out


def curve(step: int, rank: int) -> float:
    """A decreasing loss with noise, different per rank (local losses)."""
    rng = random.Random(step * 31 + rank)
    return 4.0 * math.exp(-step / 200) + rng.uniform(-0.05, 0.05)


# ------------------------------------------------------------------------ NonFiniteLoss


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_loss_is_reported_at_its_step(bad: float) -> None:
    det = NonFiniteLoss()
    found = feed(det, range(30), lambda s, r: bad if s >= 17 and r == 2 else curve(s, r))
    assert all(found[s] == [] for s in range(17))
    assert found[17], "not reported at the check after the heartbeat that carries it"
    f = found[17][0]
    assert (f.kind, f.step, f.ranks) == ("nonfinite", 17, (2,))
    assert f.at == pytest.approx(1.7), "found at the heartbeat's receipt"
    spelled = {math.inf: "inf", -math.inf: "-inf"}.get(bad, "nan")
    assert f.evidence["losses"] == {"2": spelled}
    json.dumps(f.to_json(), allow_nan=False)
    # Later non-finite losses do not move it: step 17 is the step to roll back before.
    assert [(g.step, g.ranks) for g in found[29]] == [(17, (2,))]


def test_ranks_that_go_nan_at_one_step_share_a_finding() -> None:
    det = NonFiniteLoss()
    found = feed(det, range(10), lambda s, r: math.nan if s >= 5 and r < 3 else 1.0)
    assert [(f.step, f.ranks) for f in found[5]] == [(5, (0, 1, 2))]


def test_reset_and_a_new_process_start_over() -> None:
    det = NonFiniteLoss()
    feed(det, range(10), lambda s, r: math.nan if s >= 5 else 1.0)
    det.reset((0, 1))
    assert [f.ranks for f in det.check(5.0)] == [(2, 3)]
    det.reset()
    assert det.check(5.0) == []
    # The job rolled back to step 3 and runs new processes; the NaN comes back at 8.
    found = feed(det, range(4, 12), lambda s, r: math.nan if s >= 8 else 1.0, t0=10.0, pid=500)
    assert found[7] == []
    assert [(f.step, f.ranks) for f in found[8]] == [(8, (0, 1, 2, 3))]
    # Without reset: a new process of rank 0 (another pid) with finite losses clears it.
    det.observe(beat(0, step=4, loss=1.0, pid=900), 20.0)
    assert [f.ranks for f in det.check(20.0)] == [(1, 2, 3)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(-10.0, 10.0),
            st.sampled_from([math.nan, math.inf, -math.inf]),
            st.none(),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_the_nan_detector_fires_exactly_at_the_first_nonfinite_step(
    losses: list[float | None],
) -> None:
    det = NonFiniteLoss()
    first = next((s for s, x in enumerate(losses) if x is not None and not math.isfinite(x)), None)
    for step, loss in enumerate(losses):
        det.observe(beat(0, step=step, loss=loss), float(step))
        found = det.check(step + 0.5)
        if first is None or step < first:
            assert found == []
        else:
            assert [(f.step, f.at) for f in found] == [(first, float(first))]


def test_nonfinite_state_round_trips_and_refuses_another_detector() -> None:
    det = NonFiniteLoss()
    det.load_state_dict(json.loads(json.dumps(det.state_dict())))
    with pytest.raises(ValueError, match=r"state\['detector'\]"):
        det.load_state_dict({"version": 1, "detector": "LossSpike"})


# ---------------------------------------------------------------------------- LossSpike


def test_a_spike_of_the_job_is_reported_once_naming_every_rank() -> None:
    det = LossSpike()
    spike = 60

    def loss(s: int, r: int) -> float:
        return 3 * curve(s, r) if s == spike else curve(s, r)

    found = feed(det, range(100), loss)
    assert all(found[s] == [] for s in range(spike))
    assert len(found[spike]) == 1, "one finding per step, not one per rank"
    f = found[spike][0]
    assert (f.kind, f.step, f.ranks) == ("loss_spike", spike, (0, 1, 2, 3))
    # scored at the check after the step (every rank reports it at 0.1 * step here)
    assert f.at == pytest.approx(0.1 * spike)
    assert set(f.evidence["losses"]) == {"0", "1", "2", "3"}
    assert min(f.evidence["scores"].values()) > f.evidence["threshold"] == 6.0
    assert f.evidence["history_steps"] == 50
    json.dumps(f.to_json(), allow_nan=False)
    # The next step is normal: the spike is over and not reported again.
    assert all(found[s] == [] for s in range(spike + 1, 100))


def test_one_ranks_hard_batch_is_no_spike_of_the_job() -> None:
    """Each rank's loss is its own micro-batch's, heavy-tailed: one rank at 3x or 10x
    its peers for a step (the false alarms of the contention soak) does not move the
    median over ranks that the job is judged by."""
    det = LossSpike()
    hard = {(30, 1): 10.0, (45, 3): 3 * curve(45, 3), (70, 0): 4 * curve(70, 0)}
    found = feed(det, range(100), lambda s, r: hard.get((s, r), curve(s, r)))
    assert all(not f for f in found.values()), [f for f in found.values() if f]


def test_a_spike_on_most_ranks_names_those_ranks() -> None:
    det = LossSpike()
    found = feed(det, range(40), lambda s, r: 10.0 if s == 30 and r != 2 else curve(s, r))
    assert [(f.step, f.ranks) for f in found[30]] == [(30, (0, 1, 3))]
    assert list(found[30][0].evidence["losses"])[:3] == ["0", "1", "3"]  # suspects first


def test_a_spike_that_clears_before_the_check_is_still_reported_once() -> None:
    det = LossSpike()
    feed(det, range(30), curve, ranks=1)
    det.observe(beat(0, step=30, loss=50.0, world_size=1), 3.0)
    det.observe(beat(0, step=31, loss=curve(31, 0), world_size=1), 3.1)  # normal again
    assert [f.step for f in det.check(3.2)] == [30]
    assert det.check(3.3) == []


def test_a_loss_that_stays_high_is_reported_until_it_comes_back() -> None:
    det = LossSpike()
    found = feed(det, range(40), lambda s, r: 2.0 + 0.001 * r + (3.0 if 25 <= s < 28 else 0.0))
    assert [f.step for f in found[25]] == [25]
    assert [f.step for f in found[27]] == [25, 26, 27]
    assert found[28] == []


def test_no_spike_during_warmup() -> None:
    det = LossSpike(warmup=20)
    found = feed(det, range(25), lambda s, r: 100.0 if s == 15 else curve(s, r))
    assert all(not f for f in found.values())


@settings(max_examples=100, deadline=None)
@given(
    level=st.floats(0.01, 100.0),
    noise=st.lists(st.floats(-0.02, 0.02), min_size=30, max_size=120),
)
def test_a_loss_within_2_percent_of_a_level_never_spikes(level: float, noise: list[float]) -> None:
    det = LossSpike(warmup=5)
    for step, e in enumerate(noise):
        det.observe(beat(0, step=step, loss=level * (1 + e)), float(step))
        assert det.check(step + 0.5) == []


def losses_beat(
    rank: int, steps: range, loss: Callable[[int, int], float], pid: int | None = None
) -> HeartbeatRecord:
    return beat(
        rank,
        pid=100 + rank if pid is None else pid,
        step=steps[-1],
        loss=loss(steps[-1], rank),
        losses=[(s, loss(s, rank)) for s in steps],
    )


def test_heartbeats_carrying_several_steps_are_scored_once_every_rank_has_each() -> None:
    """Ranks beat at their own moments (every 5 steps, rank r at steps 5k + r), each
    carrying its losses since its last beat: a step is scored when the last rank's
    heartbeat brings it, with all four ranks' losses."""
    det = LossSpike()
    spike = 42

    def loss(s: int, r: int) -> float:
        return 3 * curve(s, r) if s == spike else curve(s, r)

    last = [-1] * 4
    seen: list[tuple[int, int, float]] = []  # (step, reporting rank, time) of findings
    for now_step in range(100):
        for rank in range(4):
            if now_step % 5 == rank:
                det.observe(losses_beat(rank, range(last[rank] + 1, now_step + 1), loss), now_step)
                last[rank] = now_step
                seen += [(f.step, rank, f.at) for f in det.check(now_step + 0.5)]
    # step 42's last report: rank 1's beat at step 46 (it beat at 41 before)
    assert [(step, rank) for step, rank, _ in seen] == [(spike, 1)]
    assert seen[0][2] == 46


def test_a_rank_that_went_quiet_holds_scoring_back_lag_steps_only() -> None:
    det = LossSpike(lag=5)

    def loss(s: int, r: int) -> float:
        return 30.0 if s == 40 else curve(s, r)

    found = feed(det, range(30), loss)  # 4 ranks
    found = feed(det, range(30, 50), loss, ranks=3)  # rank 3 is gone
    assert all(not found[s] for s in range(30, 46))
    assert [(f.step, f.ranks) for f in found[46]] == [(40, (0, 1, 2))]
    found = feed(det, range(50, 60), curve)  # back (the same process): no wait again
    assert all(not f for f in found.values())
    found = feed(det, range(60, 62), lambda s, r: 30.0 if s == 60 else curve(s, r))
    assert [f.step for f in found[60]] == [60]


@pytest.mark.parametrize("how", ["reset", "driver restart", "rollback"])
def test_after_a_restart_the_first_rank_back_is_not_scored_alone(how: str) -> None:
    """The detector keeps its history through a reset, a driver restart (its state)
    and a rollback it sees; the first rank to report afterwards, with a hard batch,
    is not the step's loss: the step waits for the job's other ranks."""
    det = LossSpike()
    feed(det, range(60), curve)
    pid = 100
    if how == "reset":
        det.reset()
    elif how == "driver restart":
        restarted = LossSpike()
        restarted.load_state_dict(json.loads(json.dumps(det.state_dict())))
        det = restarted
    else:
        pid = 700  # new processes, behind the job's front
    steps = range(50, 55)
    det.observe(losses_beat(0, steps, lambda s, r: 10.0 if s == 52 else curve(s, r), pid), 10.0)
    assert det.check(10.1) == []
    for rank in (1, 2, 3):
        det.observe(losses_beat(rank, steps, curve, pid + rank), 10.2)
    assert det.check(10.3) == []


def test_the_history_survives_a_driver_restart_and_a_job_rollback() -> None:
    det = LossSpike()
    feed(det, range(60), curve)
    saved = json.loads(json.dumps(det.state_dict()))
    # 0.2's format, which a 0.2 driver reads: its spread is no longer used
    assert saved == {
        "version": 2,
        "detector": "LossSpike",
        "history": saved["history"],
        "spread": [],
    }
    assert len(saved["history"]) == 50
    restarted = LossSpike()
    restarted.load_state_dict(saved)
    # No warm-up again: the first spike after the restart is seen.
    found = feed(restarted, range(60, 63), lambda s, r: 20.0 if s == 61 else curve(s, r))
    assert [f.step for f in found[61]] == [61]
    # The job rolls back to step 40 in new processes and replays: no false alarm.
    restarted.reset()
    found = feed(restarted, range(40, 70), curve, t0=100.0, pid=700)
    assert all(not f for f in found.values())


def test_a_rollback_seen_without_reset_starts_counting_over() -> None:
    det = LossSpike()
    feed(det, range(60), curve)
    found = feed(det, range(30, 45), lambda s, r: 20.0 if s == 40 else curve(s, r), pid=300)
    assert [f.step for f in found[40]] == [40]


def test_batch_to_batch_noise_between_ranks_is_no_spike_and_a_spike_still_is() -> None:
    """Each rank's batch is easier or harder than its peers' (sigma 0.1 around a flat
    3.0), with a heavy tail (one step in 5, one rank's batch at 2x): the medians over
    ranks move far less, and a rise of every rank's loss is still a spike."""

    def noisy(step: int, rank: int) -> float:
        rng = random.Random(step * 131 + rank)
        hard = step % 5 == 0 and rank == (step // 5) % 4
        return 3.0 * (2.0 if hard else 1.0) + rng.gauss(0.0, 0.1)

    det = LossSpike()
    found = feed(det, range(300), noisy)
    assert all(not f for f in found.values()), [f for f in found.values() if f]
    found = feed(det, range(300, 303), lambda s, r: 6.0 + noisy(s, r) if s == 301 else noisy(s, r))
    assert [(f.step, f.ranks) for f in found[301]] == [(301, (0, 1, 2, 3))]


@pytest.mark.parametrize("version", [1, 2])
def test_older_states_load_their_history(version: int) -> None:
    det = LossSpike(warmup=5)
    state: dict[str, Any] = {"version": version, "detector": "LossSpike", "history": [3.0] * 10}
    if version == 2:
        state["spread"] = [[0.1, 0.2]] * 10  # no longer used
    det.load_state_dict(state)
    assert det.state_dict()["history"] == [3.0] * 10


def test_a_longer_saved_history_keeps_its_latest_steps() -> None:
    det = LossSpike(window=10, warmup=5)
    det.load_state_dict({"version": 1, "detector": "LossSpike", "history": list(range(100))})
    assert det.state_dict()["history"] == list(range(90, 100))


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"version": "1", "detector": "LossSpike", "history": []}, r"state\['version'\]"),
        ({"version": 1, "detector": "LossSpike"}, r"state\['history'\] is missing"),
        ({"version": 1, "detector": "LossSpike", "history": {}}, r"state\['history'\]"),
        (
            {"version": 1, "detector": "LossSpike", "history": [1.0, 2.0, None]},
            r"state\['history'\]\[2\]",
        ),
        (
            {"version": 1, "detector": "LossSpike", "history": [float("nan")]},
            r"state\['history'\]\[0\] must be a finite number",
        ),
        ({"version": 3, "detector": "LossSpike", "history": []}, r"state\['version'\] must be 2"),
        ({"version": 2, "detector": "Hang", "history": []}, r"state\['detector'\]"),
    ],
)
def test_a_bad_spike_state_is_refused_naming_the_field(state: Any, field: str) -> None:
    det = LossSpike()
    with pytest.raises(ValueError, match=field):
        det.load_state_dict(state)
    assert det.state_dict()["history"] == []


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"threshold": 0}, "threshold"),
        ({"window": 2}, "window"),
        ({"warmup": 2}, "warmup"),
        ({"warmup": 60, "window": 50}, "warmup"),
        ({"rel_floor": -0.1}, "rel_floor"),
        ({"lag": -1}, "lag"),
    ],
)
def test_bad_spike_arguments_are_refused_naming_them(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LossSpike(**kwargs)
