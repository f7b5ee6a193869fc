"""The loss: not finite (the run is lost from that step), or far above its recent past."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from ms_health.detectors._common import (
    MAD_TO_SIGMA,
    Outbox,
    StateReader,
    StepBins,
    detector_name,
    integer,
    listed,
    loss_json,
    median,
    median_mad,
    number,
    rank_set,
)
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord

__all__ = ["LossSpike", "NonFiniteLoss"]

_VERSION = 1
_SPIKE_VERSION = 2
#: Spikes kept open at most; a loss that diverges spikes at every step and the oldest
#: give way (each is still returned by one check).
_MAX_SPIKES = 16
#: The longest saved history read.
_MAX_SAVED = 100_000


class NonFiniteLoss:
    """Reports a NaN or infinite loss at the heartbeat that carries it (kind
    ``"nonfinite"``), with its step as the finding's ``step``.

    The first non-finite loss of a rank's process is kept and reported on every
    check, with the driver time it arrived as the finding's ``at``, until
    :meth:`reset` of that rank or a new process of it (another pid): later losses of a
    model that went NaN are NaN too, and the step to roll back before is the first.
    Ranks that went non-finite at the same step share one finding.
    """

    def __init__(self, *, name: str = "nonfinite_loss") -> None:
        self.name = detector_name(name)
        # rank -> (pid, step, loss, driver time) of its first non-finite loss
        self._first: dict[int, tuple[int, int | None, float, float]] = {}

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        seen = self._first.get(record.rank)
        if seen is not None and seen[0] != record.pid:
            del self._first[record.rank]  # a new process starts over
            seen = None
        if seen is not None:
            return
        if record.nonfinite_step is not None:  # the first bad step since the last beat
            loss = record.loss if record.loss is not None else math.nan
            self._first[record.rank] = (record.pid, record.nonfinite_step, loss, now)
        elif record.loss is not None and not math.isfinite(record.loss):
            self._first[record.rank] = (record.pid, record.step, record.loss, now)

    def check(self, now: float) -> list[Finding]:
        by_step: dict[int | None, dict[int, tuple[float, float]]] = {}
        for rank, (_, step, loss, at) in self._first.items():
            by_step.setdefault(step, {})[rank] = (loss, at)
        findings = []
        for step, ranks in sorted(by_step.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            losses = {r: loss_json(loss) for r, (loss, _) in ranks.items()}
            shown = sorted({str(v) for v in losses.values()})
            findings.append(
                Finding(
                    detector=self.name,
                    kind="nonfinite",
                    ranks=tuple(sorted(ranks)),
                    message=(f"loss {'/'.join(shown)} at step {step} on rank(s) {sorted(ranks)}"),
                    evidence={"losses": listed(losses)},
                    at=min(at for _, at in ranks.values()),
                    step=step,
                )
            )
        return findings

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        chosen = rank_set(ranks)
        if chosen is None:
            self._first.clear()
        for rank in chosen or ():
            self._first.pop(rank, None)

    def state_dict(self) -> dict[str, Any]:
        """Nothing is learned: a restarted driver sees a NaN again in the next heartbeat."""
        return {"version": _VERSION, "detector": type(self).__name__}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        StateReader(state, type(self).__name__, _VERSION)


class LossSpike:
    """Reports a step whose loss is far above the job's recent losses (kind
    ``"loss_spike"``), once per step whatever the number of ranks.

    The history is the median over ranks of each of the last ``window`` steps. Once it
    holds ``warmup`` steps, each rank's loss at a new step is scored against it:
    ``(loss - median) / scale``. One rank's loss strays from the job's curve in two
    ways, both noise: the curve moves from step to step, and each rank's batch is
    easier or harder than the others' of the same step. So ``scale`` combines the
    history's median absolute deviation with that of the ranks' losses around their
    step's median over the same steps (each scaled to a standard deviation, added in
    quadrature), and is at least ``rel_floor`` x |median| (a flat loss curve would
    otherwise turn noise into spikes). A score above ``threshold`` is a spike of that
    step; the finding names the ranks whose loss spiked and is reported until a later
    step's loss is back below the threshold. Both histories are the state that
    checkpoints.
    """

    def __init__(
        self,
        *,
        threshold: float = 6.0,
        window: int = 50,
        warmup: int = 20,
        rel_floor: float = 0.01,
        name: str = "loss_spike",
    ) -> None:
        self.name = detector_name(name)
        self.threshold = number("threshold", threshold, low=0.0)
        self.window = integer("window", window, low=3)
        self.warmup = integer("warmup", warmup, low=3)
        if self.warmup > self.window:
            raise ValueError(f"warmup must be <= window ({self.window}), got {warmup!r}")
        self.rel_floor = number("rel_floor", rel_floor, low=0.0, strict=False)
        self._history: deque[float] = deque(maxlen=self.window)
        # |loss - its step's median| of every rank, over the same steps as the history
        self._spread: deque[tuple[float, ...]] = deque(maxlen=self.window)
        self._bins = StepBins()
        # step -> (median, mad, scale) of the history when the step first showed up
        self._baselines: dict[int, tuple[float, float, float] | None] = {}
        # step -> {rank: (loss, score)} of the ranks whose loss spiked, and when first
        self._spikes: dict[int, tuple[float, dict[int, tuple[float, float]]]] = {}
        self._outbox = Outbox()

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        loss, step = record.loss, record.step
        if loss is None or step is None or not math.isfinite(loss):
            return  # a non-finite loss is NonFiniteLoss's; it must not enter the history
        added = self._bins.add(record.rank, record.pid, step, loss)
        if added.rewound:
            self._forget_live()
        for closed, per_rank in added.closed:
            self._close(closed, per_rank)
        if not added.accepted:
            return
        if step not in self._baselines:
            self._baselines[step] = self._baseline()
        base = self._baselines[step]
        if base is not None:
            score = (loss - base[0]) / base[2]
            if score > self.threshold:
                self._spike(step, record.rank, loss, score, base, now)

    def _baseline(self) -> tuple[float, float, float] | None:
        if len(self._history) < self.warmup:
            return None
        med, mad = median_mad(self._history)
        apart = [d for step in self._spread for d in step]
        across = median(apart) if apart else 0.0
        noise = MAD_TO_SIGMA * math.hypot(mad, across)
        # The floor of 1e-12 keeps a loss of exactly 0 from dividing by zero.
        return med, mad, max(noise, self.rel_floor * abs(med), 1e-12)

    def _spike(
        self,
        step: int,
        rank: int,
        loss: float,
        score: float,
        base: tuple[float, float, float],
        now: float,
    ) -> None:
        at, ranks = self._spikes.setdefault(step, (now, {}))
        ranks[rank] = (loss, score)
        worst = max(s for _, s in ranks.values())
        self._outbox.put(
            step,
            Finding(
                detector=self.name,
                kind="loss_spike",
                ranks=tuple(sorted(ranks)),
                message=(
                    f"loss {max(v for v, _ in ranks.values()):.4g} at step {step} on rank(s) "
                    f"{sorted(ranks)}: {worst:.1f} robust deviations above the median "
                    f"{base[0]:.4g} of the last {len(self._history)} steps "
                    f"(threshold {self.threshold:g})"
                ),
                evidence={
                    "losses": listed({r: v for r, (v, _) in ranks.items()}),
                    "scores": listed({r: round(s, 3) for r, (_, s) in ranks.items()}),
                    "median": base[0],
                    "mad": base[1],
                    "scale": base[2],
                    "threshold": self.threshold,
                    "history_steps": len(self._history),
                },
                at=at,
                step=step,
            ),
        )
        if len(self._spikes) > _MAX_SPIKES:
            oldest = min(self._spikes)
            del self._spikes[oldest]
            self._outbox.clear(oldest)

    def _close(self, step: int, per_rank: dict[int, list[float]]) -> None:
        base = self._baselines.pop(step, None)
        losses = [v for values in per_rank.values() for v in values]
        if not losses:
            return
        med = median(losses)
        self._history.append(med)
        self._spread.append(tuple(abs(v - med) for v in losses))
        if base is not None and (med - base[0]) / base[2] <= self.threshold:
            # The loss is back to normal: earlier spikes are over.
            for spiked in [s for s in self._spikes if s < step]:
                del self._spikes[spiked]
                self._outbox.clear(spiked)

    def check(self, now: float) -> list[Finding]:
        return self._outbox.collect()

    def _forget_live(self) -> None:
        self._baselines.clear()
        self._spikes.clear()
        self._outbox.drop_all()

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        chosen = rank_set(ranks)
        self._bins.reset(chosen)
        if chosen is None:
            self._forget_live()

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "detector", "history": [per-step median loss, oldest first],
        "spread": [[|rank loss - its step's median|, ...] per step]}``."""
        return {
            "version": _SPIKE_VERSION,
            "detector": type(self).__name__,
            "history": list(self._history),
            "spread": [list(step) for step in self._spread],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Formats 2 and 1 (0.1.0's, without the spread: it refills as steps close)."""
        old = isinstance(state, Mapping) and state.get("version") == 1
        reader = StateReader(state, type(self).__name__, 1 if old else _SPIKE_VERSION)
        # A history saved with a longer window is honoured by its most recent steps.
        history = reader.numbers("history", limit=_MAX_SAVED)
        spread: list[tuple[float, ...]] = []
        if not old:
            raw = reader.get("spread")
            if not isinstance(raw, list) or len(raw) > _MAX_SAVED:
                raise reader.bad("'spread'", f"a list of at most {_MAX_SAVED} lists", raw)
            for i, step in enumerate(raw):
                if not isinstance(step, list) or not all(
                    isinstance(d, (int, float)) and not isinstance(d, bool) and 0 <= d < math.inf
                    for d in step
                ):
                    raise reader.bad(f"'spread'][{i}", "a list of finite numbers >= 0", step)
                spread.append(tuple(float(d) for d in step))
        self._history = deque(history[-self.window :], maxlen=self.window)
        self._spread = deque(spread[-self.window :], maxlen=self.window)
