"""A rank slower than its peers, flagged only when it stays the outlier (Minder's rule:
a machine is faulty when its metrics differ from its peers' over consecutive windows,
not at one sample)."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ms_health.detectors._common import (
    Outbox,
    StateReader,
    StepBins,
    detector_name,
    integer,
    listed,
    median,
    number,
    rank_set,
)
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord

__all__ = ["Straggler"]

_VERSION = 1
_KEY = "straggler"
_MAX_RANKS = 1_000_000
_MEASURES = ("auto", "busy", "cpu")


class Straggler:
    """Flags ranks whose busy time per step exceeds ``threshold`` x their peers' median
    in ``windows`` consecutive windows of ``window_steps`` steps (kind ``"straggler"``).

    Busy time is ``step_time_s - wait_s``: in synchronous training every rank's step
    lasts as long as the slowest rank's, because the others wait for it in the
    collectives, so only the part not spent waiting tells the straggler apart. Where a
    heartbeat has no ``wait_s``, its step time is used (which then only separates
    ranks that do not wait for each other). Only phase ``train`` counts.

    ``measure`` picks the figure: ``"busy"`` (the above), ``"cpu"`` (``step_cpu_s``,
    the CPU time of the loop's thread per step), or ``"auto"`` (the default): the CPU
    time for a rank that trains on the CPU (its heartbeat names no GPU and carries
    ``step_cpu_s``), else busy time. On a CPU, wall-clock busy time also counts the
    time the rank waited for a core that another process held, which moves from rank
    to rank as the scheduler places them; its CPU time does not, while a slower
    processor, or more work, shows in both. On a GPU the kernels' time is not the
    thread's CPU time, so busy time it is.

    Per window, a rank's figure is the median of the figures it reported in the
    window (of three, one slow step does not move it; heartbeats slower than the
    steps may bring only one or two, and then one decides); its score is that figure over
    the median of the other ranks' figures. A strike needs three things: a score above
    ``threshold``; an excess over the peers' median above ``min_excess_s`` (timer
    noise of sub-millisecond steps is no straggler); and an excess of at least a floor
    share of the rank's step time (the median of its ``step_time_s`` in the window).
    The floor is what the excess costs the job: its peers wait that long for the rank
    at every step. A ratio alone overstates a figure that is a small part of the step.

    Busy time is wall time, and its floor is ``min_slowdown``. CPU time is converted
    first: a second of CPU costs the job 1 / rate seconds of wall time, where the rate
    is the CPU time a rank's loop gets per wall second while not waiting for its peers
    (the median over the window's ranks, ``step_cpu_s / (step_time_s - wait_s)``, at
    most 1; 1 where no heartbeat carries ``wait_s``). Without it, the floor would
    depend on how busy the host is: on a host where other work leaves a rank a fifth
    of a core, a rank that makes the job's steps 1.5x as long spends 0.5 x the rest of
    the step in CPU work, which takes over two thirds of the step in wall time yet is
    only a seventh of it in CPU time. The floor for CPU figures is
    ``min_cpu_slowdown``, higher than ``min_slowdown`` because a shared CPU moves
    them more: on 4 ranks sharing 2 cores with two to six busy processes, which rank
    shared a core moved every second or so, lifting one rank's CPU time to 1.4-2.2x
    its peers' for 20 steps at a time, by up to 16.5-19.8% of the step in wall time
    over 3 windows in a row (recorded and replayed by
    ``tools/bench/health/straggler_trace.py``), where slowed ranks stood at 29-50%
    (the 5th percentile of their windows). A rank that makes the step 1.5x as long
    costs a third of it. A floor of 0 turns it off, as does a step time of 0.

    Any other window clears the rank's strikes; a window the rank did not report in
    leaves them as they are. With the defaults (3 steps, 2 windows, 1.25, 0.1, 0.25) a rank
    that makes the job's steps 1.5x as long from step s on is flagged once the job
    reports step s + 8 at the latest (when every step is reported), and a run of up to
    3 slow steps is never flagged. A flagged rank is reported on every check until a
    window clears it. The strikes are the state that checkpoints.
    """

    def __init__(
        self,
        *,
        window_steps: int = 3,
        windows: int = 2,
        threshold: float = 1.25,
        min_excess_s: float = 0.001,
        min_slowdown: float = 0.1,
        min_cpu_slowdown: float = 0.25,
        measure: str = "auto",
        name: str = "straggler",
    ) -> None:
        self.name = detector_name(name)
        if measure not in _MEASURES:
            raise ValueError(f"measure must be one of {_MEASURES}, got {measure!r}")
        self.measure = measure
        self.window_steps = integer("window_steps", window_steps, low=1)
        self.windows = integer("windows", windows, low=1)
        self.threshold = number("threshold", threshold, low=1.0)
        self.min_excess_s = number("min_excess_s", min_excess_s, low=0.0, strict=False)
        self.min_slowdown = _share("min_slowdown", min_slowdown)
        self.min_cpu_slowdown = _share("min_cpu_slowdown", min_cpu_slowdown)
        # A window is complete once some rank is one step into the one after the next
        # window's start: ranks of a synchronous job are within a step of each other.
        # (figure, step time, whether the figure is CPU time, the wall time not spent
        # waiting if the heartbeat says how long it waited) per rank and step
        self._bins: StepBins[tuple[float, float, bool, float | None]] = StepBins(
            width=self.window_steps, lag=1
        )
        self._strikes: dict[int, int] = {}
        self._scores: dict[int, float] = {}
        # Per rank, its last windows' verdicts, shown with a finding: why it came when it did.
        self._recent: dict[int, deque[list[Any]]] = {}
        self._outbox = Outbox()

    @property
    def scores(self) -> dict[int, float]:
        """Each rank's score in the last complete window (busy time over peers' median)."""
        return dict(self._scores)

    @property
    def strikes(self) -> dict[int, int]:
        """Consecutive windows each rank has been above the threshold."""
        return {r: n for r, n in self._strikes.items() if n}

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        if record.phase != "train" or record.step is None or record.step_time_s is None:
            return
        figure, on_cpu = self._figure(record)
        if figure is None:
            return
        wall = None if record.wait_s is None else max(0.0, record.step_time_s - record.wait_s)
        added = self._bins.add(
            record.rank, record.pid, record.step, (figure, record.step_time_s, on_cpu, wall)
        )
        if added.rewound:
            self._forget_live()
        for window, per_rank in added.closed:
            self._judge(window, per_rank, now)

    def _figure(self, record: HeartbeatRecord) -> tuple[float | None, bool]:
        """The rank's figure for its last step under :attr:`measure`, and whether it is
        CPU time."""
        on_cpu = record.step_cpu_s is not None and "gpu_model" not in record.hardware
        if self.measure == "cpu" or (self.measure == "auto" and on_cpu):
            return record.step_cpu_s, True
        assert record.step_time_s is not None
        return max(0.0, record.step_time_s - (record.wait_s or 0.0)), False

    def _judge(
        self,
        window: int,
        per_rank: Mapping[int, Sequence[tuple[float, float, bool, float | None]]],
        now: float,
    ) -> None:
        figures, steps, rates, cpu = {}, {}, [], True
        for rank, values in per_rank.items():
            if values:
                figures[rank] = median([v[0] for v in values])
                steps[rank] = median([v[1] for v in values])
                cpu = cpu and all(v[2] for v in values)
                walls = [v[3] for v in values if v[3] is not None]
                wall = median(walls) if len(walls) == len(values) else 0.0
                if wall > 0.0:
                    rates.append(figures[rank] / wall)
        if len(figures) < 2:
            return  # no peers to compare with
        # Figures in CPU time: the CPU seconds a rank's loop gets per wall second while
        # it does not wait for its peers (the median over the ranks that report their
        # waits; at most 1) turns an excess of CPU time into the wall time it costs.
        # Figures in wall time, or no waits reported: 1.
        rate = min(1.0, median(rates)) if cpu and rates else 1.0
        if rate <= 0.0:
            rate = 1.0
        floor = self.min_cpu_slowdown if cpu else self.min_slowdown
        ordered = sorted(figures.values())
        scores: dict[int, float] = {}
        peers: dict[int, float] = {}
        shares: dict[int, float] = {}  # excess in wall time over the step (a step > 0)
        for rank, busy in figures.items():
            peer = _median_without(ordered, busy)
            if peer <= 0.0:
                continue  # peers that do no work give no scale
            scores[rank], peers[rank] = busy / peer, peer
            excess = busy - peer
            slow = (
                busy / peer > self.threshold
                and excess > self.min_excess_s
                and excess / rate >= floor * steps[rank]
            )
            self._strikes[rank] = self._strikes.get(rank, 0) + 1 if slow else 0
            if steps[rank] > 0.0:
                shares[rank] = excess / rate / steps[rank]
            share = round(shares[rank], 4) if rank in shares else None
            recent = self._recent.setdefault(rank, deque(maxlen=self.windows + 3))
            recent.append([window * self.window_steps, round(busy / peer, 4), share,
                           len(per_rank[rank]), slow])  # fmt: skip
        self._scores = scores
        flagged = sorted(r for r, n in self._strikes.items() if n >= self.windows)
        if not flagged:
            self._outbox.clear(_KEY)
            return
        first, last = window * self.window_steps, (window + 1) * self.window_steps - 1
        by_score = sorted(scores, key=lambda r: -scores[r])
        shown = ", ".join(_shown(r, scores, figures, shares) for r in flagged)
        floor_text = f" and {floor * 100:g}% of the step" if floor else ""
        self._outbox.put(
            _KEY,
            Finding(
                detector=self.name,
                kind="straggler",
                ranks=tuple(flagged),
                message=(
                    f"rank(s) {shown} busier per step ({self.measure} time) than their "
                    "peers' median in "
                    f"{self.windows}+ consecutive windows of {self.window_steps} steps, "
                    f"last steps {first}-{last} (threshold {self.threshold:g}x{floor_text})"
                ),
                evidence={
                    "steps": [first, last],
                    "threshold": self.threshold,
                    "min_slowdown": floor,
                    "windows": self.windows,
                    "window_steps": self.window_steps,
                    "measure": self.measure,
                    "scores": listed({r: round(s, 4) for r, s in scores.items()}, by_score),
                    "busy_s": listed({r: round(figures[r], 6) for r in flagged if r in figures}),
                    "peer_median_s": listed({r: round(peers[r], 6) for r in flagged if r in peers}),
                    "step_s": listed({r: round(steps[r], 6) for r in flagged if r in steps}),
                    "cpu_rate": round(rate, 4),
                    "slowdown": listed({r: round(shares[r], 4) for r in flagged if r in shares}),
                    "strikes": listed({r: self._strikes[r] for r in flagged}),
                    # [first step, score, excess / step, heartbeats, strike] per window
                    "recent_windows": listed(
                        {
                            r: [list(w) for w in self._recent[r]]
                            for r in flagged
                            if r in self._recent
                        }
                    ),
                    "ranks_scored": len(scores),
                },
                at=now,
                step=last,
            ),
        )

    def check(self, now: float) -> list[Finding]:
        return self._outbox.collect()

    def _forget_live(self) -> None:
        self._strikes.clear()
        self._scores.clear()
        self._recent.clear()
        self._outbox.drop_all()

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        chosen = rank_set(ranks)
        self._bins.reset(chosen)
        if chosen is None:
            self._forget_live()
            return
        for rank in chosen:
            self._strikes.pop(rank, None)
            self._scores.pop(rank, None)
            self._recent.pop(rank, None)
        if self._outbox.keys():
            kept = tuple(r for r in self._outbox[_KEY].ranks if r not in chosen)
            if kept:
                self._outbox.put(_KEY, _with_ranks(self._outbox[_KEY], kept))
            else:
                self._outbox.drop_all()

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "detector", "strikes": {rank: consecutive windows}}``: a restarted
        driver keeps counting where the last one stopped."""
        return {
            "version": _VERSION,
            "detector": type(self).__name__,
            "strikes": {str(r): n for r, n in self._strikes.items() if n},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        reader = StateReader(state, type(self).__name__, _VERSION)
        raw = reader.mapping("strikes", limit=_MAX_RANKS)
        strikes = {}
        for key, n in raw.items():
            rank = reader.rank("strikes", key)
            strikes[rank] = reader.integer(f"'strikes'][{key!r}", n)
        self._strikes = strikes


def _share(name: str, value: float) -> float:
    checked = number(name, value, low=0.0, strict=False)
    if checked >= 1.0:
        raise ValueError(f"{name} must be below 1 (a share of the step time), got {value!r}")
    return checked


def _median_without(ordered: Sequence[float], value: float) -> float:
    """The median of sorted ``ordered`` without one occurrence of ``value`` (in
    O(log n) rather than a sort per rank: a window of 1,000 ranks scores each)."""
    i = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]

    mid = n // 2
    return at(mid) if n % 2 else 0.5 * (at(mid - 1) + at(mid))


def _shown(
    rank: int,
    scores: Mapping[int, float],
    figures: Mapping[int, float],
    shares: Mapping[int, float],
) -> str:
    """``"2 (1.50x, +33% of the step)"``; a flagged rank missing from this window
    (its strikes stand) shows ``(no report)``, one whose peers did no work
    ``(no peer time)``, one whose step took no time only its ratio."""
    if rank not in figures:
        return f"{rank} (no report)"
    if rank not in scores:
        return f"{rank} (no peer time)"
    if rank not in shares:
        return f"{rank} ({scores[rank]:.2f}x)"
    return f"{rank} ({scores[rank]:.2f}x, +{shares[rank]:.0%} of the step)"


def _with_ranks(finding: Finding, ranks: tuple[int, ...]) -> Finding:
    return attrs.evolve(finding, ranks=ranks)
