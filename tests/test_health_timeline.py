"""The arithmetic behind the health benchmarks' figures (ETTR, time to regained
progress, detection times), on records written by hand."""

from __future__ import annotations

import importlib.util
import math
import sys
from types import ModuleType
from typing import Any

import pytest
from _workspace import ROOT


def _load() -> ModuleType:
    path = ROOT / "tools" / "bench" / "health" / "_timeline.py"
    spec = importlib.util.spec_from_file_location("_health_timeline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


timeline = _load()


def rec(step: int, t: float, loss: float = 1.0) -> tuple[int, float, dict[str, Any]]:
    return step, t, {"step": step, "loss": loss}


def steady(first: int, last: int, t0: float, dt: float = 1.0) -> list[Any]:
    return [rec(s, t0 + (s - first) * dt) for s in range(first, last + 1)]


# Steps 1..10 at t = 1..10; a crash; the restart rewrites metrics.jsonl up to its resume
# step 8 (read again at t = 15), redoes 9 and 10 (t = 16, 17), then trains 11, 12.
RESTARTED = [
    *steady(1, 10, 1.0),
    *[rec(s, 15.0 + s * 1e-3) for s in range(1, 9)],
    rec(9, 16.0),
    rec(10, 17.0),
    rec(11, 18.0),
    rec(12, 19.0),
]


def test_steady_training_is_productive_from_the_first_record_on() -> None:
    assert timeline.productive_seconds(steady(1, 10, 1.0), 0.0, 100.0) == pytest.approx(9.0)


def test_redone_steps_and_the_restart_count_nothing() -> None:
    # 9 s before the crash, then one new step per second from step 11 on.
    assert timeline.productive_seconds(RESTARTED, 0.0, 100.0) == pytest.approx(11.0)


def test_only_the_window_counts() -> None:
    assert timeline.productive_seconds(steady(1, 10, 1.0), 2.5, 4.5) == pytest.approx(2.0)
    assert timeline.productive_seconds(RESTARTED, 17.5, 100.0) == pytest.approx(1.5)


def test_nan_steps_count_nothing_and_do_not_raise_the_bar() -> None:
    # Steps 6..8 log NaN; the rollback resumes from 5 and trains 6..8 again, as new.
    seen = [
        *steady(1, 5, 1.0),
        rec(6, 6.0, math.nan),
        rec(7, 7.0, math.nan),
        rec(8, 8.0, math.inf),
        *[rec(s, 10.0 + s * 1e-3) for s in range(1, 6)],
        rec(6, 11.0),
        rec(7, 12.0),
        rec(8, 13.0),
    ]
    assert timeline.furthest_good(seen, before=9.0) == 5
    assert timeline.productive_seconds(seen, 0.0, 100.0) == pytest.approx(4.0 + 0.995 + 2.0)
    # Step 6 follows the rewind's record of step 5 (read at 10.005): its whole span is new.
    got = timeline.regained(seen, t_fault=6.5)
    assert got is not None
    assert (got["regained_step"], got["regained_t"]) == (6, 11.0)


def test_an_empty_or_reversed_window_is_refused() -> None:
    with pytest.raises(ValueError, match="t1 must be after t0"):
        timeline.productive_seconds(RESTARTED, 5.0, 5.0)


def test_progress_is_regained_at_the_first_step_above_everything_read_before() -> None:
    got = timeline.regained(RESTARTED, t_fault=10.5)
    assert got is not None
    assert got["rewind_t"] == pytest.approx(15.001)
    assert (got["first_step"], got["first_step_t"]) == (2, pytest.approx(15.002))
    assert (got["regained_step"], got["regained_t"]) == (11, 18.0)


def test_no_rewind_after_the_fault_is_no_restart() -> None:
    assert timeline.regained(steady(1, 10, 1.0), t_fault=3.0) is None
    # Rewound but not yet past the furthest step: the restart is seen, progress is not.
    got = timeline.regained(RESTARTED[:-2], t_fault=10.5)
    assert got is not None and got["rewind_t"] is not None
    assert got["regained_t"] is None and got["regained_step"] is None


def test_first_finding_matches_kind_rank_and_time() -> None:
    def finding(t: float, kind: str, ranks: list[int]) -> dict[str, Any]:
        return {
            "kind": "finding",
            "time": t,
            "ranks": ranks,
            "evidence": {"finding": {"kind": kind}},
        }

    events = [
        {"kind": "start", "time": 0.0},
        finding(1.0, "crash", [1]),
        finding(5.0, "straggler", [2]),
        finding(6.0, "hang", [0, 1]),
        finding(7.0, "crash", [1]),
    ]
    assert timeline.first_finding(events, 2.0, ("crash", "hang"), rank=1)["time"] == 6.0
    assert timeline.first_finding(events, 2.0, ("crash",), rank=1)["time"] == 7.0
    assert timeline.first_finding(events, 2.0, ("crash",), rank=1, until=7.0) is None
    assert timeline.first_finding(events, 0.0, ("straggler",), rank=1) is None
    assert timeline.first_finding(events, 0.0, ("straggler",))["ranks"] == [2]
    assert timeline.first_event(events, "start", 0.0)["time"] == 0.0
    assert timeline.first_event(events, "start", 0.5) is None
