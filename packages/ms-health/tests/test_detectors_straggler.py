"""Straggler (Minder's rule) on synchronous steps: every rank's step lasts as long as the
slowest rank's, and the busy part (step minus collective wait) tells them apart."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_health.detectors import Straggler
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


def sync_steps(
    det: Straggler,
    steps: range,
    busy: Callable[[int, int], float],
    *,
    ranks: int = 4,
    comm_s: float = 0.01,
    report: Callable[[int, int], bool] = lambda s, r: True,
    wait: bool = True,
    pid: int = 100,
) -> dict[int, list[Finding]]:
    """Synchronous steps: each rank computes ``busy(step, rank)`` seconds, then waits in
    the collective for the slowest; the driver checks after each step."""
    out = {}
    now = 0.0
    for step in steps:
        times = {r: busy(step, r) for r in range(ranks)}
        step_time = max(times.values()) + comm_s
        now += step_time
        for r in range(ranks):
            if report(step, r):
                rec = attrs.evolve(
                    BASE,
                    rank=r,
                    pid=pid + r,
                    step=step,
                    step_time_s=step_time,
                    wait_s=step_time - times[r] if wait else None,
                )
                det.observe(rec, now)
        out[step] = det.check(now)
    return out


def slowed(rank: int, start: int, factor: float = 1.5, base: float = 0.1) -> Callable[..., float]:
    def busy(step: int, r: int) -> float:
        return base * factor if r == rank and step >= start else base

    return busy


def first_finding(found: dict[int, list[Finding]]) -> tuple[int, Finding] | None:
    return next(((s, fs[0]) for s, fs in sorted(found.items()) if fs), None)


@pytest.mark.parametrize("start", range(20, 26))
def test_a_rank_slowed_1_5x_is_flagged_within_10_steps(start: int) -> None:
    det = Straggler()
    found = sync_steps(det, range(60), slowed(2, start))
    hit = first_finding(found)
    assert hit is not None, "the straggler was not flagged"
    step, f = hit
    assert step - start < 10, f"flagged {step - start} steps after the slowdown began"
    assert (f.kind, f.ranks) == ("straggler", (2,))
    scores = f.evidence["scores"]
    assert scores["2"] == pytest.approx(1.5)
    assert all(scores[str(r)] == pytest.approx(1.0) for r in (0, 1, 3))
    assert next(iter(scores)) == "2", "the highest score comes first"
    assert f.evidence["busy_s"]["2"] == pytest.approx(0.15)
    assert f.evidence["peer_median_s"]["2"] == pytest.approx(0.1)
    # 50 ms more than its peers, of a 160 ms step (0.15 busy + 0.01 in the collective)
    assert f.evidence["step_s"]["2"] == pytest.approx(0.16)
    assert f.evidence["slowdown"]["2"] == pytest.approx(0.05 / 0.16, abs=1e-4)
    assert "2 (1.50x, +31% of the step)" in f.message
    assert f.evidence["strikes"]["2"] >= 2
    json.dumps(f.to_json(), allow_nan=False)
    assert det.scores[2] == pytest.approx(1.5)
    # Reported as long as it lasts.
    assert all(found[s] for s in range(step, 60))


def test_step_times_alone_cannot_tell_but_the_busy_time_can() -> None:
    # Without wait_s every synchronous rank has the same step time: nobody stands out.
    blind = sync_steps(Straggler(), range(40), slowed(1, 10), wait=False)
    assert all(f == [] for f in blind.values())
    assert sync_steps(Straggler(), range(40), slowed(1, 10))[20]


def test_without_wait_the_step_time_is_used() -> None:
    # Ranks that do not wait for each other (no collective): the slow one shows in its
    # own step time.
    det = Straggler()
    for step in range(30):
        for r in range(3):
            t = 0.15 if r == 0 and step >= 5 else 0.1
            det.observe(attrs.evolve(BASE, rank=r, pid=100 + r, step=step, step_time_s=t), step)
    assert [f.ranks for f in det.check(30.0)] == [(0,)]


@pytest.mark.parametrize("slow_steps", [1, 2, 3])
@pytest.mark.parametrize("start", range(20, 23))
def test_brief_jitter_on_one_rank_is_not_flagged(slow_steps: int, start: int) -> None:
    def busy(step: int, r: int) -> float:
        return 0.3 if r == 1 and start <= step < start + slow_steps else 0.1

    found = sync_steps(Straggler(), range(60), busy)
    assert all(f == [] for f in found.values())


def test_a_flagged_rank_that_recovers_is_cleared() -> None:
    det = Straggler()
    found = sync_steps(det, range(60), lambda s, r: 0.15 if r == 3 and 10 <= s < 30 else 0.1)
    assert found[25] and found[25][0].ranks == (3,)
    assert all(found[s] == [] for s in range(34, 60))


def test_two_ranks_the_slow_one_is_flagged() -> None:
    found = sync_steps(Straggler(), range(30), slowed(0, 5), ranks=2)
    hit = first_finding(found)
    assert hit is not None and hit[1].ranks == (0,)
    assert hit[1].evidence["scores"]["1"] == pytest.approx(1 / 1.5, abs=1e-4)


def test_sparse_and_repeated_heartbeats_still_flag_the_straggler() -> None:
    # Each rank reports two steps of three, and every heartbeat comes twice.
    det = Straggler()
    found = sync_steps(det, range(60), slowed(1, 10), report=lambda s, r: (s + r) % 3 != 0)
    hit = first_finding(found)
    assert hit is not None and hit[1].ranks == (1,)


def test_a_restarted_rank_starts_over() -> None:
    det = Straggler()
    sync_steps(det, range(40), slowed(2, 10))
    assert det.strikes.get(2, 0) >= 2
    det.reset((2,))  # evicted and replaced: the new node is healthy
    assert det.check(100.0) == []
    assert 2 not in det.strikes
    found = sync_steps(det, range(40, 80), lambda s, r: 0.1, pid=100)
    assert all(f == [] for f in found.values())


def test_the_strikes_survive_a_driver_restart() -> None:
    det = Straggler(windows=3)
    sync_steps(det, range(17), slowed(2, 10))
    saved = json.loads(json.dumps(det.state_dict()))
    assert saved == {"version": 1, "detector": "Straggler", "strikes": {"2": 2}}
    restarted = Straggler(windows=3)
    restarted.load_state_dict(saved)
    # One more slow window is the third strike.
    found = sync_steps(restarted, range(18, 26), slowed(2, 10))
    hit = first_finding(found)
    assert hit is not None and hit[0] <= 22 and hit[1].ranks == (2,)
    fresh = sync_steps(Straggler(windows=3), range(18, 26), slowed(2, 10))
    assert first_finding(fresh) is None or first_finding(fresh)[0] > 22  # type: ignore[index]


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"version": 1, "detector": "Straggler"}, r"state\['strikes'\] is missing"),
        ({"version": 1, "detector": "Straggler", "strikes": [1]}, r"state\['strikes'\]"),
        (
            {"version": 1, "detector": "Straggler", "strikes": {"x": 1}},
            r"state\['strikes'\]\['x'\]",
        ),
        ({"version": 1, "detector": "Straggler", "strikes": {"-1": 1}}, r"\['strikes'\]\['-1'\]"),
        ({"version": 1, "detector": "Straggler", "strikes": {"3": -1}}, r"\['strikes'\]\['3'\]"),
        ({"version": 1, "detector": "Straggler", "strikes": {"3": 1.0}}, r"\['strikes'\]\['3'\]"),
        ({"version": 1, "detector": "Hang", "strikes": {}}, r"state\['detector'\]"),
    ],
)
def test_a_bad_straggler_state_is_refused_naming_the_field(state: Any, field: str) -> None:
    det = Straggler()
    det.load_state_dict({"version": 1, "detector": "Straggler", "strikes": {"1": 1}})
    with pytest.raises(ValueError, match=field):
        det.load_state_dict(state)
    assert det.strikes == {1: 1}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window_steps": 0}, "window_steps"),
        ({"windows": 0}, "windows"),
        ({"threshold": 1.0}, "threshold"),
        ({"threshold": "1.3"}, "threshold"),
        ({"min_excess_s": -1.0}, "min_excess_s"),
        ({"min_slowdown": -0.1}, "min_slowdown"),
        ({"min_slowdown": 1.0}, "min_slowdown"),
        ({"min_cpu_slowdown": -0.1}, "min_cpu_slowdown"),
        ({"min_cpu_slowdown": 1.0}, "min_cpu_slowdown"),
    ],
)
def test_bad_straggler_arguments_are_refused_naming_them(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        Straggler(**kwargs)


@settings(max_examples=150, deadline=None)
@given(
    ranks=st.integers(2, 8),
    steps=st.integers(10, 80),
    base=st.floats(0.001, 10.0),
    # Busy times within +-10 % of one speed: any two differ by less than 1.1/0.9 < 1.25.
    jitter=st.floats(0.0, 0.1),
    seed=st.integers(0, 2**32 - 1),
    reported=st.floats(0.3, 1.0),
)
def test_equal_speed_ranks_with_jitter_below_the_threshold_are_never_flagged(
    ranks: int, steps: int, base: float, jitter: float, seed: int, reported: float
) -> None:
    rng = random.Random(seed)
    found = sync_steps(
        Straggler(),
        range(steps),
        lambda s, r: base * (1 + rng.uniform(-jitter, jitter)),
        ranks=ranks,
        report=lambda s, r: rng.random() < reported,
    )
    assert all(f == [] for f in found.values())


@settings(max_examples=100, deadline=None)
@given(
    ranks=st.integers(2, 8),
    start=st.integers(0, 30),
    factor=st.floats(1.5, 4.0),
    base=st.floats(0.01, 10.0),
    slow=st.integers(0, 7),
)
def test_a_rank_slowed_1_5x_or_more_is_flagged_within_10_steps(
    ranks: int, start: int, factor: float, base: float, slow: int
) -> None:
    slow %= ranks
    found = sync_steps(
        Straggler(), range(start + 12), slowed(slow, start, factor, base), ranks=ranks
    )
    hit = first_finding(found)
    assert hit is not None and hit[0] - start < 10 and hit[1].ranks == (slow,)


def _cpu_job(det: Straggler, hardware: dict[str, Any]) -> list[Finding]:
    """Rank 2 shares its core with another process: its busy time is 2x its peers',
    its CPU time per step the same as theirs."""
    found: list[Finding] = []
    for step in range(30):
        for r in range(4):
            busy = 0.2 if r == 2 else 0.1
            rec = attrs.evolve(
                BASE,
                rank=r,
                pid=100 + r,
                step=step,
                step_time_s=0.21,
                wait_s=0.21 - busy,
                step_cpu_s=0.1,
                hardware=hardware,
            )
            det.observe(parse_heartbeat(json.dumps(rec.to_json())), float(step))
        found += det.check(step + 0.5)
    return found


def test_on_a_cpu_the_cpu_time_decides_and_a_descheduled_rank_is_no_straggler() -> None:
    assert _cpu_job(Straggler(), {"cpu_model": "x"}) == []
    # busy time alone, as on a GPU, flags it; so does measure="busy" on a CPU
    gpu = _cpu_job(Straggler(), {"gpu_model": "H100"})
    assert gpu and gpu[0].ranks == (2,) and gpu[0].evidence["measure"] == "auto"
    assert _cpu_job(Straggler(measure="busy"), {"cpu_model": "x"})[0].ranks == (2,)
    with pytest.raises(ValueError, match="measure must be one of"):
        Straggler(measure="wall")


def _on_cpu(rank: int, step: int, step_time: float, cpu: float) -> HeartbeatRecord:
    """Rank ``rank``'s heartbeat after ``step`` on a CPU: the step's wall and CPU time."""
    return attrs.evolve(
        BASE,
        rank=rank,
        pid=100 + rank,
        step=step,
        step_time_s=step_time,
        step_cpu_s=cpu,
        hardware={"cpu_model": "x"},
    )


def _small_share_job(det: Straggler, extra: Callable[[int], float]) -> dict[int, list[Finding]]:
    """What 4 ranks sharing 2 cores with two busy processes showed: the loop thread runs
    6 ms of CPU per 50 ms step (the rest is the collectives and the wait for a core),
    and rank 1 runs ``extra(step)`` more."""
    out = {}
    for step in range(80):
        step_time = 0.05 + extra(step)
        for r in range(4):
            cpu = 0.006 + (extra(step) if r == 1 else 0.0)
            det.observe(_on_cpu(r, step, step_time, cpu), float(step))
        out[step] = det.check(step + 0.5)
    return out


def test_a_rank_busier_by_a_small_share_of_the_step_is_no_straggler() -> None:
    # Rank 1 at 1.4x its peers' CPU time for 60 steps, which is 2.4 ms of a 50 ms step:
    # the job loses under 5% to it, as a shared core gives and takes at random.
    def shared(s: int) -> float:
        return 0.0024 if 10 <= s < 70 else 0.0

    assert all(f == [] for f in _small_share_job(Straggler(), shared).values())
    # The share is what keeps it quiet: with no floor, it is flagged.
    loud = first_finding(_small_share_job(Straggler(min_cpu_slowdown=0.0), shared))
    assert loud is not None and loud[1].ranks == (1,)
    assert loud[1].evidence["slowdown"]["1"] == pytest.approx(0.0024 / 0.0524, abs=1e-4)


@pytest.mark.parametrize("start", range(20, 23))
def test_a_rank_that_slows_the_step_1_5x_is_flagged_however_small_its_busy_share(
    start: int,
) -> None:
    # The same job, rank 1 now 25 ms slower per step: the step takes 1.5x as long.
    hit = first_finding(_small_share_job(Straggler(), lambda s: 0.025 if s >= start else 0.0))
    assert hit is not None and hit[1].ranks == (1,) and hit[0] - start < 10
    assert hit[1].evidence["slowdown"]["1"] == pytest.approx(0.025 / 0.075, abs=1e-4)


def _one_window_pair(
    det: Straggler, busy: float, step_time: float, peer: float = 0.01, windows: int = 3
) -> list[Finding]:
    """Two ranks, rank 0 at ``busy`` CPU seconds per step and rank 1 at ``peer``, every
    step ``step_time`` long, for ``windows`` windows and one step into the next."""
    found = []
    for step in range(windows * det.window_steps + 2):
        for r, cpu in ((0, busy), (1, peer)):
            det.observe(_on_cpu(r, step, step_time, cpu), float(step))
        found += det.check(step + 0.5)
    return found


def test_an_excess_of_exactly_the_floor_is_a_strike_and_below_it_is_not() -> None:
    # 0.5 s over the peer in a 1 s step is half of it (binary fractions: no rounding).
    # CPU figures meet min_cpu_slowdown; min_slowdown is for wall-clock figures.
    def cpu(floor: float) -> Straggler:
        return Straggler(windows=2, min_slowdown=0.9, min_cpu_slowdown=floor)

    at = _one_window_pair(cpu(0.5), 0.75, 1.0, peer=0.25)
    assert at and at[0].ranks == (0,)
    assert "(threshold 1.25x and 50% of the step)" in at[0].message
    assert at[0].evidence["min_slowdown"] == 0.5 and at[0].evidence["cpu_rate"] == 1.0
    assert _one_window_pair(cpu(0.5001), 0.75, 1.0, peer=0.25) == []


def test_a_step_time_of_zero_or_no_floor_leaves_the_ratio_alone() -> None:
    for det in (Straggler(windows=2), Straggler(windows=2, min_cpu_slowdown=0.0)):
        zero = _one_window_pair(det, 0.03, 0.0)
        assert zero and zero[0].ranks == (0,)
        assert zero[0].evidence["slowdown"] == {}  # no share of a step of no time
        assert "0 (3.00x)" in zero[0].message
    off = _one_window_pair(Straggler(windows=2, min_cpu_slowdown=0.0), 0.03, 0.1)[0]
    assert off.message.endswith("(threshold 1.25x)"), off.message


def test_a_flagged_rank_that_misses_a_window_shows_no_report() -> None:
    det = Straggler(windows=2)
    _one_window_pair(det, 0.04, 0.1)  # 0.03 s over its peer: 30% of the step
    assert det.strikes == {0: 3}
    # Rank 0 goes quiet for a window; ranks 1 and 2 report it.
    for step in range(12, 17):  # the window of steps 12-14 closes at step 16
        for r in (1, 2):
            det.observe(_on_cpu(r, step, 0.1, 0.01), float(step))
    found = det.check(20.0)
    assert found and found[0].ranks == (0,) and "rank(s) 0 (no report) busier" in found[0].message


def _busy_host_job(det: Straggler, rate: float, waits: bool) -> dict[int, list[Finding]]:
    """4 ranks on a host whose other work leaves each loop ``rate`` CPU seconds per wall
    second: 5 ms of CPU per step (``5 / rate`` ms of wall time), then 10 ms in the
    collectives. From step 20 on rank 3 adds half the rest of the step in CPU work, as
    ms-testing's ``slow`` fault does, which takes ``1 / rate`` times as long in wall
    time: every rank's step becomes 1.5x as long at rate 1, 3.5x at rate 0.2; the
    others wait for it. ``waits``: whether heartbeats carry ``wait_s``."""
    out = {}
    own = 0.005 / rate  # wall time of a rank's own work
    for step in range(60):
        extra_cpu = 0.5 * (own + 0.01) if step >= 20 else 0.0
        step_time = own + 0.01 + extra_cpu / rate
        for r in range(4):
            cpu = 0.005 + (extra_cpu if r == 3 else 0.0)
            wait = step_time - (own + (extra_cpu / rate if r == 3 else 0.0))
            rec = attrs.evolve(_on_cpu(r, step, step_time, cpu), wait_s=wait if waits else None)
            det.observe(rec, float(step))
        out[step] = det.check(step + 0.5)
    return out


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.2, 0.1])
def test_a_cpu_straggler_is_judged_by_the_wall_time_its_excess_costs_however_busy_the_host(
    rate: float,
) -> None:
    # Its excess costs 0.5 / (rate + 0.5) of the step in wall time (a third at rate 1,
    # 71% at 0.2), but is only 0.5 rate / (rate + 0.5) of it in CPU time (14% at rate
    # 0.2, 8% at 0.1: under the floor of 25% unconverted).
    hit = first_finding(_busy_host_job(Straggler(windows=3), rate, waits=True))
    assert hit is not None and hit[1].ranks == (3,) and hit[0] - 20 <= 11, hit
    evidence = hit[1].evidence
    assert evidence["cpu_rate"] == pytest.approx(rate, rel=1e-3)
    cost = 0.5 / (rate + 0.5)
    assert evidence["slowdown"]["3"] == pytest.approx(cost, abs=1e-4)
    assert f"+{cost:.0%} of the step" in hit[1].message


def test_without_waits_cpu_time_is_taken_as_wall_time() -> None:
    # The same job at rate 0.2 without wait_s: no rate to convert with, so its CPU
    # excess counts as wall time, a seventh of the step, under the CPU floor of 25%
    # (the limit this conversion removes where waits are reported); at rate 1 it is a
    # third, and flagged.
    assert all(f == [] for f in _busy_host_job(Straggler(windows=3), 0.2, waits=False).values())
    hit = first_finding(_busy_host_job(Straggler(windows=3), 1.0, waits=False))
    assert hit is not None and hit[1].evidence["cpu_rate"] == 1.0


def test_wall_clock_figures_keep_their_own_floor() -> None:
    # Busy time (a GPU rank's figure) is wall time already: no conversion, and the
    # floor is min_slowdown. Rank 2 at 1.5x of a 0.1 s busy time in a step of 0.16 s:
    # its excess is 0.05 / 0.16 = 31% of the step.
    def job(det: Straggler) -> Finding | None:
        hit = first_finding(sync_steps(det, range(40), slowed(2, 10)))
        return None if hit is None else hit[1]

    found = job(Straggler(min_slowdown=0.3, min_cpu_slowdown=0.9))
    assert found is not None and found.ranks == (2,) and found.evidence["cpu_rate"] == 1.0
    assert job(Straggler(min_slowdown=0.32, min_cpu_slowdown=0.0)) is None
