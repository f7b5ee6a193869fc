"""What detectors report to the driver, and the interface every detector implements.

The driver feeds each accepted heartbeat to every detector (:meth:`Detector.observe`,
with the driver's own receipt time) and asks each for findings on a fixed tick
(:meth:`Detector.check`). A detector only reports; what to do about a finding (log it,
dump stacks, evict, restart) is the driver's decision, recorded with the finding as
its evidence. Detector state (learned timeouts, baselines, strikes) checkpoints with
``state_dict`` / ``load_state_dict`` so that a restarted driver does not relearn it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from ms_health.record import HeartbeatRecord

__all__ = ["KINDS", "Detector", "Finding", "FindingKind"]

FindingKind = Literal["crash", "hang", "nonfinite", "loss_spike", "throughput", "straggler"]
#: Every kind of finding, in the order the driver ranks them when several fire at once
#: (the first is acted on; a crash explains a hang of its peers, not the reverse).
KINDS: tuple[FindingKind, ...] = (
    "crash",
    "hang",
    "nonfinite",
    "loss_spike",
    "straggler",
    "throughput",
)


@attrs.frozen
class Finding:
    """One detector's conclusion about one or more ranks."""

    detector: str
    kind: FindingKind
    #: The ranks it is about (the suspects), sorted; empty for a job-wide finding.
    ranks: tuple[int, ...]
    #: One line for people: what was seen, against what threshold.
    message: str
    #: The figures behind it (thresholds, last values, times), JSON-serialisable.
    evidence: Mapping[str, Any] = attrs.field(factory=dict)
    #: Driver time (``time.monotonic()`` of the driver) at which it was found.
    at: float = 0.0
    #: The optimizer step it concerns, where one is known (e.g. the NaN's step).
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "detector": self.detector,
            "kind": self.kind,
            "ranks": list(self.ranks),
            "message": self.message,
            "evidence": dict(self.evidence),
            "at": self.at,
            "step": self.step,
        }


@runtime_checkable
class Detector(Protocol):
    """A fault detector the driver runs; see the module docstring."""

    #: Stable name, used in findings, events, metrics and the driver's state.
    name: str

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        """Take one heartbeat, received by the driver at ``now`` (its monotonic clock)."""

    def check(self, now: float) -> list[Finding]:
        """Findings as of ``now``. A condition that persists is reported again on each
        check until it clears or :meth:`reset` is called."""

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        """Forget the live state of ``ranks`` (all when None), keeping what was learned
        (timeouts, baselines): after a restart the ranks start over."""

    def state_dict(self) -> dict[str, Any]:
        """What was learned, with a format version, JSON-serialisable."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, validated; ValueError names the field."""
