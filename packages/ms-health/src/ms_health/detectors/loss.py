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
    """Reports a step whose loss over the whole job is far above its recent past (kind
    ``"loss_spike"``), once per step whatever the number of ranks.

    A step's loss is the median of its ranks' losses: heartbeats carry every step's
    loss since the previous one, and a step is scored once every rank of the job has
    reported it (or ``lag`` steps later, for a rank that went quiet or has not reported
    since a restart: its losses of that step are left out). Each rank's loss is that of
    its own micro-batches, and one rank's hard batch at 3x the median is common in a
    heavy-tailed loss; it is no spike of the run, and it does not move the median of
    its peers. A divergence moves every rank's.

    The history is the step losses of the last ``window`` steps. Once it holds
    ``warmup`` steps, a step's loss scores ``(loss - median) / scale``, where
    ``scale`` is the history's median absolute deviation (scaled to a standard
    deviation), at least ``rel_floor`` x |median| (a flat loss curve would otherwise
    turn noise into spikes). A score above ``threshold`` is a spike. The finding
    names the ranks whose own loss scored above the threshold (all that reported the
    step when none did alone) and is reported until a later step is back below it.
    The history is the state that checkpoints.
    """

    def __init__(
        self,
        *,
        threshold: float = 6.0,
        window: int = 50,
        warmup: int = 20,
        rel_floor: float = 0.01,
        lag: int = 64,
        name: str = "loss_spike",
    ) -> None:
        self.name = detector_name(name)
        self.threshold = number("threshold", threshold, low=0.0)
        self.window = integer("window", window, low=3)
        self.warmup = integer("warmup", warmup, low=3)
        if self.warmup > self.window:
            raise ValueError(f"warmup must be <= window ({self.window}), got {warmup!r}")
        self.rel_floor = number("rel_floor", rel_floor, low=0.0, strict=False)
        self.lag = integer("lag", lag, low=0)
        self._history: deque[float] = deque(maxlen=self.window)
        self._bins: StepBins[float] = StepBins(lag=self.lag, wait_all=True)
        # step -> finding of the steps that spiked and are not over yet
        self._spikes: dict[int, Finding] = {}
        self._outbox = Outbox()

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        if record.losses:
            pairs = [(s, v) for s, v in record.losses if math.isfinite(v)]
        elif record.step is not None and record.loss is not None:  # a sender before 0.3
            pairs = [(record.step, record.loss)] if math.isfinite(record.loss) else []
        else:
            return
        # A non-finite loss is NonFiniteLoss's; it must not enter the history.
        added = self._bins.add_many(record.rank, record.pid, pairs, record.world_size)
        if added.rewound:
            self._forget_live()
        for step, per_rank in added.closed:
            self._close(step, per_rank, now)

    def _close(self, step: int, per_rank: dict[int, list[float]], now: float) -> None:
        losses = {r: values[-1] for r, values in per_rank.items() if values}
        if not losses:
            return
        loss = median(losses.values())
        base, steps = self._baseline(), len(self._history)
        self._history.append(loss)
        if base is None:
            return
        med, mad, scale = base
        if (loss - med) / scale <= self.threshold:
            # The loss is back to normal: earlier spikes are over.
            for spiked in [s for s in self._spikes if s < step]:
                del self._spikes[spiked]
                self._outbox.clear(spiked)
            return
        scores = {r: (v - med) / scale for r, v in losses.items()}
        named = [r for r, s in scores.items() if s > self.threshold] or list(losses)
        finding = Finding(
            detector=self.name,
            kind="loss_spike",
            ranks=tuple(sorted(named)),
            message=(
                f"loss {loss:.4g} at step {step} (median of {len(losses)} rank(s)) is "
                f"{(loss - med) / scale:.1f} robust deviations above the median {med:.4g} "
                f"of the last {steps} steps (threshold "
                f"{self.threshold:g}); highest on rank(s) {sorted(named)}"
            ),
            evidence={
                "step_loss": loss,
                "losses": listed(losses, first=named),
                "scores": listed({r: round(s, 3) for r, s in scores.items()}, first=named),
                "median": med,
                "mad": mad,
                "scale": scale,
                "threshold": self.threshold,
                "history_steps": steps,
            },
            at=now,
            step=step,
        )
        self._spikes[step] = finding
        self._outbox.put(step, finding)
        if len(self._spikes) > _MAX_SPIKES:
            oldest = min(self._spikes)
            del self._spikes[oldest]
            self._outbox.clear(oldest)

    def _baseline(self) -> tuple[float, float, float] | None:
        if len(self._history) < self.warmup:
            return None
        med, mad = median_mad(self._history)
        # The floor of 1e-12 keeps a loss of exactly 0 from dividing by zero.
        return med, mad, max(MAD_TO_SIGMA * mad, self.rel_floor * abs(med), 1e-12)

    def check(self, now: float) -> list[Finding]:
        return self._outbox.collect()

    def _forget_live(self) -> None:
        self._spikes.clear()
        self._outbox.drop_all()

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        chosen = rank_set(ranks)
        self._bins.reset(chosen)
        if chosen is None:
            self._forget_live()

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "detector", "history": [step loss, oldest first], "spread":
        []}``: 0.2's format (whose history is the same step losses), its spread of the
        ranks' losses no longer used and saved empty, so that a 0.2 driver reads it."""
        return {
            "version": _SPIKE_VERSION,
            "detector": type(self).__name__,
            "history": list(self._history),
            "spread": [],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Format 2, and 0.1's format 1 (the same history, no spread); a saved spread
        is not used."""
        old = isinstance(state, Mapping) and state.get("version") == 1
        reader = StateReader(state, type(self).__name__, 1 if old else _SPIKE_VERSION)
        # A history saved with a longer window is honoured by its most recent steps.
        history = reader.numbers("history", limit=_MAX_SAVED)
        self._history = deque(history[-self.window :], maxlen=self.window)
