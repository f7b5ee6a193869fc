"""The job's tokens/s against its own past: a slow network, a throttled GPU, a noisy
neighbour show there first."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from ms_health.detectors._common import (
    Outbox,
    StateReader,
    StepBins,
    detector_name,
    integer,
    median,
    number,
    rank_set,
)
from ms_health.detectors._common import fraction as check_fraction
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord

__all__ = ["ThroughputDrop"]

_VERSION = 1
_MAX_SAVED = 100_000
_KEY = "drop"


class ThroughputDrop:
    """Reports when the job's tokens/s stays below ``fraction`` of its baseline for
    ``patience`` consecutive steps and at least ``min_duration_s`` seconds (kind
    ``"throughput"``, job-wide: no ranks). The time is the driver's, from when it
    judged the first slow step: with fast steps, a few steps are a moment (a busy
    neighbour process taking a larger share of the cores for a few seconds).

    The job's figure for a step is the mean ``tokens_per_s`` of the ranks that
    reported it (a mean per rank, so that a rank that reports less often weighs
    nothing). Only heartbeats in phase ``train`` count: a checkpoint or an
    evaluation is not slow training. The baseline is the median of the last
    ``window`` steps at normal speed; it is first used once ``warmup`` steps are in
    it. Slow steps do not enter it, so a lasting drop stays reported instead of
    becoming the new normal. The baseline history is the state that checkpoints.
    """

    def __init__(
        self,
        *,
        fraction: float = 0.7,
        patience: int = 5,
        window: int = 50,
        warmup: int = 10,
        min_duration_s: float = 0.0,
        name: str = "throughput_drop",
    ) -> None:
        self.name = detector_name(name)
        self.fraction = check_fraction("fraction", fraction)
        self.patience = integer("patience", patience, low=1)
        self.window = integer("window", window, low=1)
        self.warmup = integer("warmup", warmup, low=1)
        self.min_duration_s = number("min_duration_s", min_duration_s, low=0.0, strict=False)
        if self.warmup > self.window:
            raise ValueError(f"warmup must be <= window ({self.window}), got {warmup!r}")
        self._history: deque[float] = deque(maxlen=self.window)
        self._bins: StepBins[float] = StepBins()
        # The current run of slow steps: how many, and the last few.
        self._slow_steps = 0
        self._slow_since = 0.0  # driver time the first slow step of the run was judged
        self._slow: deque[tuple[int, float]] = deque(maxlen=self.patience)
        self._outbox = Outbox()

    @property
    def baseline(self) -> float | None:
        """Tokens/s per rank the job is judged against, once warmed up."""
        return median(self._history) if len(self._history) >= self.warmup else None

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        if record.phase != "train" or record.tokens_per_s is None or record.step is None:
            return
        added = self._bins.add(record.rank, record.pid, record.step, record.tokens_per_s)
        if added.rewound:
            self._slow_steps = 0
            self._slow.clear()
        for step, per_rank in added.closed:
            values = [v for vs in per_rank.values() for v in vs]
            if values:
                self._judge(step, sum(values) / len(values), len(values), now)

    def _judge(self, step: int, value: float, ranks: int, now: float) -> None:
        base = self.baseline
        if base is None or value >= self.fraction * base:
            self._slow_steps = 0
            self._slow.clear()
            self._history.append(value)
            self._outbox.clear(_KEY)
            return
        if self._slow_steps == 0:
            self._slow_since = now
        self._slow_steps += 1
        self._slow.append((step, value))
        lasted = now - self._slow_since
        if self._slow_steps < self.patience or lasted < self.min_duration_s:
            return
        self._outbox.put(
            _KEY,
            Finding(
                detector=self.name,
                kind="throughput",
                ranks=(),
                message=(
                    f"tokens/s per rank {value:.4g} at step {step} is {value / base:.2f} x "
                    f"the baseline {base:.4g}, below {self.fraction:g} for "
                    f"{self._slow_steps} consecutive steps ({lasted:.0f} s)"
                ),
                evidence={
                    "tokens_per_s": value,
                    "ranks_reporting": ranks,
                    "baseline": base,
                    "ratio": round(value / base, 4) if base > 0 else None,
                    "fraction": self.fraction,
                    "slow_steps": self._slow_steps,
                    "slow_s": round(lasted, 3),
                    "recent": [[s, v] for s, v in self._slow],
                },
                at=now,
                step=step,
            ),
        )

    def check(self, now: float) -> list[Finding]:
        return self._outbox.collect()

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        chosen = rank_set(ranks)
        self._bins.reset(chosen)
        if chosen is None:
            self._slow_steps = 0
            self._slow.clear()
            self._outbox.drop_all()

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "detector", "history": [tokens/s per rank of normal steps]}``."""
        return {
            "version": _VERSION,
            "detector": type(self).__name__,
            "history": list(self._history),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        reader = StateReader(state, type(self).__name__, _VERSION)
        history = reader.numbers("history", low=0.0, limit=_MAX_SAVED)
        self._history = deque(history[-self.window :], maxlen=self.window)
