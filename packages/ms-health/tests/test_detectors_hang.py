"""Hang on a virtual clock: per-phase timeouts learned from the intervals between
progress marks, generous start values, and the rank furthest behind as the suspect."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_health.detectors import START_TIMEOUTS_S, Hang
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
    phase="init",
)


class Sim:
    """Ranks that beat every 0.5 s with what the test sets; the driver checks every
    0.25 s. Time is kept in ticks so that it stays exact."""

    def __init__(self, det: Hang, ranks: int = 2) -> None:
        self.det = det
        self.tick = 0
        self.ranks: dict[int, dict[str, Any]] = {
            r: {"step": None, "phase": "init", "pid": 100 + r, "status": "running"}
            for r in range(ranks)
        }
        self.silent: set[int] = set()
        self.found: list[Finding] = []

    @property
    def now(self) -> float:
        return self.tick * 0.25

    def set(self, ranks: Any = None, **kw: Any) -> None:
        for r in self.ranks if ranks is None else ranks:
            self.ranks[r].update(kw)

    def advance(self, seconds: float) -> list[Finding]:
        found = []
        for _ in range(round(seconds / 0.25)):
            self.tick += 1
            if self.tick % 2 == 0:
                for r, s in self.ranks.items():
                    if r not in self.silent:
                        rec = attrs.evolve(BASE, rank=r, seq=self.tick, **s)
                        self.det.observe(rec, self.now)
            found += self.det.check(self.now)
        self.found += found
        return found

    def train(self, steps: int, step_s: float = 1.0, ranks: Any = None) -> list[Finding]:
        """``steps`` steps of ``step_s`` each on ``ranks`` (all), in phase train."""
        found = []
        for _ in range(steps):
            for r in self.ranks if ranks is None else ranks:
                s = self.ranks[r]
                s["phase"] = "train"
                s["step"] = 0 if s["step"] is None else s["step"] + 1
            found += self.advance(step_s)
        return found


def started(det: Hang, ranks: int = 2, init_s: float = 5.0, steps: int = 10) -> Sim:
    sim = Sim(det, ranks)
    assert sim.advance(init_s) == []
    assert sim.train(steps) == []
    return sim


def test_a_frozen_step_with_live_heartbeats_is_a_hang_at_the_learned_timeout() -> None:
    sim = started(Hang())
    # Steps of 1 s seen by heartbeats of 0.5 s: the longest train interval is 1 s.
    assert sim.det.longest_s["train"] == 1.0
    assert sim.det.timeout_for("train") == 5.0
    # Rank 1 is stuck in step 10's compute; rank 0 finished step 10 and waits in the
    # collective of step 11. Both keep beating.
    sim.train(1, step_s=0.0, ranks=[0])
    frozen_at = sim.now
    found = sim.advance(8.0)
    assert found, "the hang was not reported"
    f = found[0]
    assert f.kind == "hang"
    assert f.ranks == (1,), "the rank furthest behind is the suspect"
    assert f.step == 9
    # Rank 1's last progress mark: the first beat of its step 9, half a second into
    # that step (frozen_at - 0.5); found at the first check with an age over 5 s.
    assert f.at == frozen_at - 0.5 + 5.25
    assert f.at <= frozen_at + 5.0 + 2.0  # the target: the timeout + 2 s
    ev = f.evidence["ranks"]["1"]
    assert ev["step"] == 9 and ev["phase"] == "train" and ev["hung"] is True
    assert ev["timeout_s"] == 5.0 and "5 x the longest 'train' interval" in ev["timeout_from"]
    assert f.evidence["suspects_are"] == "furthest behind"
    assert f.evidence["longest_s"]["train"] == 1.0
    json.dumps(f.to_json(), allow_nan=False)


def test_ranks_at_the_same_step_are_all_suspects_once_past_their_timeout() -> None:
    sim = started(Hang(), ranks=3)
    found = sim.advance(6.0)
    assert found and found[0].ranks == (0, 1, 2)
    assert found[0].evidence["suspects_are"] == "past their timeout, all at the same step"
    # Still frozen: reported on every later check.
    assert len(sim.advance(1.0)) == 4


def test_silence_with_frozen_progress_is_a_hang_too() -> None:
    sim = started(Hang())
    sim.silent = {0, 1}  # the processes are gone: no heartbeat, no progress
    t0 = sim.now
    found = sim.advance(6.0)
    assert found and found[0].ranks == (0, 1)
    assert found[0].at == t0 - 0.5 + 5.25


def test_a_long_startup_raises_no_alarm_and_a_stuck_one_does() -> None:
    det = Hang()
    sim = Sim(det)
    assert sim.advance(START_TIMEOUTS_S["init"] - 1.0) == []
    assert sim.advance(2.0), "a start-up stuck past the init start value is a hang"


def test_init_and_checkpoint_keep_their_start_value_as_the_least_timeout() -> None:
    det = Hang()
    sim = started(det, init_s=5.0)
    assert det.longest_s["init"] == 5.0
    assert det.timeout_for("init") == START_TIMEOUTS_S["init"]
    # A restart that loads a checkpoint takes 20x the first start-up: no alarm.
    det.reset()
    sim = Sim(det)
    assert sim.advance(100.0) == []
    assert sim.train(3) == []
    assert det.longest_s["init"] == 100.0
    # Where 5x the longest start-up is longer than the start value, that applies.
    det.load_state_dict({"version": 1, "detector": "Hang", "longest_s": {"init": 200.0}})
    assert det.timeout_for("init") == 1000.0
    # A phase not kept follows what was learned, below its start value.
    det.load_state_dict({"version": 1, "detector": "Hang", "longest_s": {"eval": 2.0}})
    assert det.timeout_for("eval") == 10.0 < START_TIMEOUTS_S["eval"]


def test_a_checkpoint_of_10x_the_step_time_raises_no_alarm() -> None:
    sim = started(Hang())
    assert sim.det.timeout_for("train") == 5.0
    sim.set(phase="checkpoint")
    assert sim.advance(10.0) == []  # twice the train timeout, but the phase is checkpoint
    assert sim.train(5) == []
    assert sim.det.longest_s["checkpoint"] == 10.0
    # The next checkpoint may take far longer (storage is shared) ...
    assert sim.det.timeout_for("checkpoint") == START_TIMEOUTS_S["checkpoint"]
    sim.set(phase="checkpoint")
    assert sim.advance(START_TIMEOUTS_S["checkpoint"] - 1.0) == []
    # ... but one stuck past the timeout is a hang.
    found = sim.advance(2.0)
    assert found and found[0].evidence["ranks"]["0"]["phase"] == "checkpoint"
    assert "kept" in found[0].evidence["ranks"]["0"]["timeout_from"]


def test_a_slow_first_step_is_judged_by_the_start_value_and_not_learned() -> None:
    det = Hang()
    sim = Sim(det)
    sim.advance(3.0)
    assert sim.train(1, step_s=60.0) == []  # compilation, say
    assert sim.train(10) == []
    assert det.longest_s["train"] == 1.0
    assert sim.advance(5.5)  # a hang now is seen at 5 x 1 s, not 5 x 60 s


def test_the_learned_timeout_never_falls_below_the_floor() -> None:
    sim = started(Hang(min_timeout_s=3.0), steps=20)
    assert sim.det.longest_s["train"] == 1.0
    assert sim.det.timeout_for("train") == 5.0
    fast = Hang(min_timeout_s=3.0)
    fast.load_state_dict({"version": 1, "detector": "Hang", "longest_s": {"train": 0.1}})
    assert fast.timeout_for("train") == 3.0


def test_a_rank_that_stops_on_purpose_is_no_hang() -> None:
    sim = started(Hang())
    sim.set([1], status="stopping")
    sim.train(20, ranks=[0])
    assert sim.found == []


def test_restarted_ranks_start_over_and_keep_what_was_learned() -> None:
    sim = started(Hang())
    sim.silent = {1}  # rank 1 dies; rank 0 waits for it in a collective
    found = sim.advance(6.0)
    assert found and found[0].ranks == (0, 1)
    # The driver restarts the workers: new processes that take 60 s to start.
    sim.det.reset((0, 1))
    sim.set(pid=999, phase="init", step=None)
    sim.silent = set()
    assert sim.advance(60.0) == []
    assert sim.train(10) == []
    assert sim.det.longest_s["train"] == 1.0
    assert sim.advance(5.5), "after the restart a hang is seen at the learned timeout"


def test_a_new_process_of_a_rank_is_progress_even_without_reset() -> None:
    sim = started(Hang())
    sim.advance(4.0)
    sim.set(pid=4242, phase="init", step=None)  # the launcher restarted every rank
    assert sim.advance(60.0) == []


def test_the_learned_intervals_survive_a_driver_restart() -> None:
    sim = started(Hang())
    saved = json.loads(json.dumps(sim.det.state_dict()))
    assert saved == {"version": 1, "detector": "Hang", "longest_s": {"init": 5.0, "train": 1.0}}
    restarted = Hang()
    restarted.load_state_dict(saved)
    assert restarted.timeout_for("train") == 5.0
    # The new driver meets the running job mid-train and does not relearn: a hang is
    # seen 5 s after the last progress, not after the 120 s train start value.
    sim.det = restarted
    sim.train(3)
    assert sim.advance(5.5)


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"version": 2, "detector": "Hang", "longest_s": {}}, r"state\['version'\]"),
        ({"version": 1, "detector": "Straggler", "longest_s": {}}, r"state\['detector'\]"),
        ({"version": 1, "detector": "Hang"}, r"state\['longest_s'\] is missing"),
        ({"version": 1, "detector": "Hang", "longest_s": [1.0]}, r"state\['longest_s'\]"),
        (
            {"version": 1, "detector": "Hang", "longest_s": {"train": -1.0}},
            r"state\['longest_s'\]\['train'\] must be a finite number >= 0",
        ),
        (
            {"version": 1, "detector": "Hang", "longest_s": {"train": "1"}},
            r"state\['longest_s'\]\['train'\]",
        ),
        ({"version": 1, "detector": "Hang", "longest_s": {"": 1.0}}, r"state\['longest_s'\]"),
    ],
)
def test_a_bad_state_is_refused_naming_the_field(state: dict[str, Any], field: str) -> None:
    det = Hang()
    det.load_state_dict({"version": 1, "detector": "Hang", "longest_s": {"train": 2.0}})
    with pytest.raises(ValueError, match=field):
        det.load_state_dict(state)
    assert det.longest_s == {"train": 2.0}, "a refused state must leave the detector as it was"


def test_an_unknown_phase_gets_the_default_start_value() -> None:
    det = Hang(default_start_s=42.0)
    assert det.timeout_for("warmup_data") == 42.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"safety_factor": 0.5}, "safety_factor"),
        ({"min_timeout_s": 0.0}, "min_timeout_s"),
        ({"default_start_s": float("inf")}, "default_start_s"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"start_timeouts_s": {"train": -3}}, r"start_timeouts_s\['train'\]"),
        ({"start_timeouts_s": {"": 3}}, "start_timeouts_s"),
        ({"keep_start": "init"}, "keep_start"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises((ValueError, TypeError), match=field):
        Hang(**kwargs)


PHASES = st.sampled_from(["init", "train", "checkpoint", "eval", "custom"])


@settings(max_examples=200, deadline=None)
@given(
    floor=st.floats(0.1, 30.0),
    factor=st.floats(1.0, 10.0),
    marks=st.lists(st.tuples(PHASES, st.floats(0.0, 100.0)), max_size=40),
)
def test_timeouts_are_never_below_the_floor_and_follow_the_longest_interval(
    floor: float, factor: float, marks: list[tuple[str, float]]
) -> None:
    det = Hang(min_timeout_s=floor, safety_factor=factor, warmup_steps=0, keep_start=())
    now = 0.0
    det.observe(attrs.evolve(BASE, phase="train", step=0), now)
    longest: dict[str, float] = {}
    phase = "train"
    for step, (next_phase, gap) in enumerate(marks, start=1):
        now += gap
        longest[phase] = max(longest.get(phase, 0.0), gap)
        det.observe(attrs.evolve(BASE, phase=next_phase, step=step), now)
        phase = next_phase
    for p in ["init", "train", "checkpoint", "eval", "custom", "never-seen"]:
        timeout = det.timeout_for(p)
        assert timeout >= floor
        if p in longest:
            assert timeout == pytest.approx(max(floor, factor * longest[p]))
        # A rank in that phase is a hang exactly past the timeout.
        det.reset()
        det.observe(attrs.evolve(BASE, phase=p, step=1), 0.0)
        assert det.check(timeout) == []
        assert [f.ranks for f in det.check(timeout + 0.01)] == [(0,)]


def test_a_restarted_process_first_seen_in_train_is_still_in_its_first_steps() -> None:
    # The launcher restarts the ranks before the driver resets them: the new processes
    # are past init by the first heartbeat it keeps, and their first step waits 30 s for
    # a peer that loads slower. That is no hang; a hang after it is.
    sim = started(Hang())
    sim.det.reset()
    sim.set(pid=999, phase="train", step=40)
    assert sim.advance(30.0) == []
    assert sim.train(10) == []
    assert sim.det.longest_s["train"] == 1.0
    assert sim.advance(5.5), "after the first steps a hang is seen at the learned timeout"


def test_a_new_process_replacing_a_known_one_mid_training_is_in_its_first_steps() -> None:
    sim = started(Hang())
    sim.advance(4.0)
    sim.set(pid=4242, step=50)  # restarted without a reset, already training
    assert sim.advance(30.0) == []
    assert sim.train(3) == []
    assert sim.advance(5.5)


def test_a_driver_restart_seeing_ranks_mid_training_gives_them_no_warm_up() -> None:
    sim = started(Hang())
    sim.det = Hang()  # a new driver: it learned nothing and reset nothing
    sim.det.load_state_dict({"version": 1, "detector": "Hang", "longest_s": {"train": 1.0}})
    assert sim.train(2) == []
    assert sim.advance(5.5), "a rank seen mid-training is judged at the learned timeout"
