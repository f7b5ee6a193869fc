"""The detector set as the driver runs it: default_detectors, the Detector protocol, the
state format shared by all, and whole simulated jobs (4 ranks, heartbeats every 0.5 s
that carry each rank's latest step, a check every 0.25 s) on a virtual clock."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import attrs
import pytest

from ms_health.detectors import (
    Hang,
    LossSpike,
    MissingHeartbeat,
    NonFiniteLoss,
    Straggler,
    ThroughputDrop,
    default_detectors,
)
from ms_health.findings import Detector, Finding
from ms_health.record import HeartbeatRecord, parse_heartbeat

ALL = [MissingHeartbeat, Hang, NonFiniteLoss, LossSpike, ThroughputDrop, Straggler]


def test_default_detectors_are_one_of_each_kind_tuned_to_the_interval() -> None:
    dets = default_detectors(0.5, world_size=4)
    assert [type(d) for d in dets] == ALL
    assert all(isinstance(d, Detector) for d in dets)
    assert len({d.name for d in dets}) == len(dets)
    missing, hang = dets[0], dets[1]
    assert isinstance(missing, MissingHeartbeat) and isinstance(hang, Hang)
    assert missing.timeout_s == 1.5 and missing.expected_ranks == 4
    assert hang.min_timeout_s == 2.0 and hang.safety_factor == 5.0
    slow = default_detectors(2.0)
    assert slow[0].timeout_s == 6.0 and slow[1].min_timeout_s == 8.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("interval", [0, -1.0, math.nan, True, None])
def test_default_detectors_refuse_a_bad_interval(interval: Any) -> None:
    with pytest.raises(ValueError, match="interval_s"):
        default_detectors(interval)


@pytest.mark.parametrize("cls", ALL)
def test_every_state_is_json_versioned_and_refused_when_foreign(cls: type) -> None:
    det = cls()
    state = det.state_dict()
    version = 2 if cls is LossSpike else 1  # LossSpike 2: a spread saved (empty now)
    assert state["version"] == version and state["detector"] == cls.__name__
    det.load_state_dict(json.loads(json.dumps(state)))
    with pytest.raises(ValueError, match=rf"state\['version'\] must be {version}"):
        det.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match=r"state\['detector'\]"):
        det.load_state_dict({**state, "detector": "Other"})
    with pytest.raises(TypeError, match="state must be a mapping"):
        det.load_state_dict([state])


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize(("ranks", "error"), [("01", TypeError), ((-1,), ValueError)])
def test_reset_refuses_bad_ranks(cls: type, ranks: Any, error: type) -> None:
    with pytest.raises(error, match="ranks"):
        cls().reset(ranks)


# --------------------------------------------------------------- whole simulated jobs


@attrs.define
class Job:
    """A synchronous job of ``ranks`` ranks on a virtual clock, in ticks of 50 ms.

    Each step every rank computes ``busy`` seconds (times the rank's slowdown) and
    waits in the collective for the slowest; every ``ckpt_every`` steps the job
    checkpoints for ``ckpt_steps`` step times. Each rank sends a heartbeat every
    0.5 s (staggered) with its latest step, through the wire format; the driver
    checks every 0.25 s.
    """

    dets: list[Detector]
    ranks: int = 4
    init_s: float = 30.0
    busy: float = 0.2
    ckpt_every: int = 20
    ckpt_steps: float = 10.0
    seed: int = 0
    #: rank -> (first step, factor) of a slowdown, or (first, last, factor) of jitter
    slow: dict[int, tuple[float, ...]] = attrs.field(factory=dict)
    nan_at: int | None = None
    freeze_at: int | None = None  # rank 0 stops computing at this step (a hang)
    kill: dict[int, float] = attrs.field(factory=dict)  # rank -> time it dies
    stop: dict[int, float] = attrs.field(factory=dict)  # rank -> time it stops on purpose
    found: list[Finding] = attrs.field(factory=list)
    tick: int = 0
    step: int | None = None
    phase: str = "init"
    next_at: float = 0.0
    last_step_at: float = 0.0
    ends: list[tuple[float, int]] = attrs.field(factory=list)  # (time, step) of each step

    def step_at(self, t: float) -> int | None:
        """The job's last completed step at time ``t``."""
        return max((s for end, s in self.ends if end <= t), default=None)

    metrics: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    # (step, loss) of each rank's steps since its last heartbeat, as the sender keeps
    unsent: dict[int, list[tuple[int, float]]] = attrs.field(factory=dict)

    @property
    def now(self) -> float:
        return self.tick * 0.05

    def run(self, seconds: float) -> list[Finding]:
        rng = random.Random(self.seed)
        if self.tick == 0:
            self.next_at = self.init_s
        found = []
        for _ in range(round(seconds / 0.05)):
            self.tick += 1
            while self.now >= self.next_at:
                self._advance(rng)
            for r in range(self.ranks):
                # Heartbeats every 10 ticks, rank r at offset 2r.
                if (self.tick - 2 * r) % 10 or self.now >= self.kill.get(r, math.inf):
                    continue
                if self.now >= self.stop.get(r, math.inf) + 0.5:
                    continue  # it said "stopping" once and exited
                self._beat(r)
            if self.tick % 5 == 0:
                for d in self.dets:
                    found += d.check(self.now)
        self.found += found
        return found

    def _advance(self, rng: random.Random) -> None:
        """The job completes its next step (or enters or leaves a checkpoint)."""
        if self.phase == "train" and self.step and self.step % self.ckpt_every == 0:
            self.phase = "checkpoint"
            self.next_at += self.ckpt_steps * self.busy
            return
        self.phase = "train"
        step = 0 if self.step is None else self.step + 1
        if self.freeze_at is not None and step >= self.freeze_at:
            self.next_at = math.inf
            return
        times = {}
        for r in range(self.ranks):
            f = 1.0
            s = self.slow.get(r)
            if s is not None and (
                (len(s) == 2 and step >= s[0]) or (len(s) == 3 and s[0] <= step <= s[1])
            ):
                f = s[-1]
            times[r] = self.busy * f * rng.uniform(0.97, 1.03)
        step_time = max(times.values()) + 0.005
        loss = 3.0 * math.exp(-step / 300)
        if self.nan_at is not None and step >= self.nan_at:
            loss = math.nan
        for r in range(self.ranks):
            self.unsent.setdefault(r, []).append((step, loss))
            self.metrics[r] = {
                "step": step,
                "loss": loss,
                "tokens_per_s": 4096 / step_time,
                "step_time_s": step_time,
                "wait_s": step_time - times[r],
            }
        self.step = step
        self.next_at += step_time
        self.last_step_at = self.next_at
        self.ends.append((self.next_at, step))

    def _beat(self, r: int) -> None:
        stopping = self.now >= self.stop.get(r, math.inf)
        rec = HeartbeatRecord(
            job="job",
            rank=r,
            world_size=self.ranks,
            local_rank=r % 2,
            node=f"n{r // 2}",
            host="h",
            pid=1000 + r,
            seq=self.tick,
            sent_at=1e9 + self.now,
            status="stopping" if stopping else "running",
            phase=self.phase,
            losses=tuple(self.unsent.pop(r, [])),
            nonfinite_step=None,
            **self.metrics.get(r, {}),
        )
        bad = [s for s, v in rec.losses if not math.isfinite(v)]
        rec = attrs.evolve(rec, nonfinite_step=bad[0] if bad else None)
        wire = parse_heartbeat(json.dumps(rec.to_json()))
        for d in self.dets:
            d.observe(wire, self.now)


def kinds(found: list[Finding]) -> set[str]:
    return {f.kind for f in found}


def test_a_healthy_job_raises_nothing() -> None:
    # Start-up of 30 s, checkpoints of 10x the step time every 20 steps, +-3 % noise,
    # jitter of 2x for two steps on rank 1, and rank 3 stopping on purpose at the end.
    job = Job(default_detectors(0.5, world_size=4), slow={1: (150, 151, 2.0)})
    job.run(170.0)
    assert job.step is not None and job.step > 400
    job.stop = {3: job.now}
    job.run(10.0)
    assert job.found == [], [f.message for f in job.found]


def test_a_killed_rank_is_a_crash_within_2_s() -> None:
    job = Job(default_detectors(0.5, world_size=4))
    job.run(60.0)
    job.kill = {2: job.now}
    found = job.run(5.0)
    crash = [f for f in found if f.kind == "crash"]
    assert crash and crash[0].ranks == (2,)
    assert crash[0].at - job.kill[2] <= 2.0


def test_a_frozen_job_is_a_hang_within_the_timeout_plus_2_s() -> None:
    job = Job(default_detectors(0.5, world_size=4), freeze_at=200)
    job.run(120.0)
    assert job.step == 199
    hang = [f for f in job.found if f.kind == "hang"]
    # All ranks are at step 199; the ones whose staggered beats saw it first pass their
    # timeout first, and within half a second (one beat) all are reported.
    assert hang and hang[0].step == 199
    assert any(f.ranks == (0, 1, 2, 3) and f.at <= hang[0].at + 0.5 for f in hang)
    hang_det = job.dets[1]
    assert isinstance(hang_det, Hang)
    # Steps of 0.2 s seen by beats of 0.5 s: the longest train interval is about 0.5 s,
    # so the learned timeout is the floor of 2 s or a little more.
    timeout = hang_det.timeout_for("train")
    assert 2.0 <= timeout <= 5 * 0.75
    assert hang[0].at - job.last_step_at <= timeout + 2.0
    assert kinds(job.found) == {"hang"}


def test_a_nan_is_reported_at_its_step() -> None:
    job = Job(default_detectors(0.5, world_size=4), nan_at=233)
    job.run(120.0)
    nan = [f for f in job.found if f.kind == "nonfinite"]
    # Steps of 0.2 s, beats of 0.5 s: a heartbeat carries the first non-finite step
    # since the previous one, not only its latest step.
    assert nan and {f.step for f in nan} == {233}
    assert kinds(job.found) == {"nonfinite"}
    # Within one beat every rank has reported it.
    later = [f for f in nan if f.at <= nan[0].at + 0.6]
    assert {r for f in later for r in f.ranks} == {0, 1, 2, 3}


def test_a_straggler_is_flagged_from_sampled_heartbeats() -> None:
    # Steps of 0.2 s and heartbeats of 0.5 s: each heartbeat sees every 2nd or 3rd step.
    job = Job(default_detectors(0.5, world_size=4), slow={2: (300, 1.5)})
    job.run(150.0)
    strag = [f for f in job.found if f.kind == "straggler"]
    assert strag and strag[0].ranks == (2,)
    # Found within 10 steps of the slowdown, counted in the job's steps at that time.
    at_step = job.step_at(strag[0].at)
    assert at_step is not None and at_step - 300 < 10
    assert kinds(job.found) <= {"straggler", "throughput"}
