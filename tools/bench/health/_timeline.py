"""Arithmetic over what a health benchmark saw: progress records and driver events.

Progress records are ``(step, t, record)`` triples in the order they were read, as
``ms_testing.progress.Progress.seen`` holds them, with ``t`` converted to the wall clock
by the caller (``t_mono + offset``, one offset taken when the benchmark started) so that
they compare with the driver's event times (``time.time()`` of the driver, see
``ms_health._events``) and with ``.taken`` fault files' modification times.

A restart of the job shows in the records as a *rewind*: a resumed run rewrites its
``metrics.jsonl`` with its records up to the resume step, which are read again, so a
record's step is not above the one read before it. Every record of one process's life
has a step above its predecessor's.

A step counts as progress only where its logged loss is finite: the steps a NaN run
logs are thrown away by the rollback, and their records must not raise the furthest
step that later steps are measured against.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "Record",
    "finite_loss",
    "first_event",
    "first_finding",
    "furthest_good",
    "productive_seconds",
    "regained",
]

Record = tuple[int, float, Mapping[str, Any]]


def finite_loss(record: Mapping[str, Any]) -> bool:
    """False when the record's loss is a NaN or an infinity (a missing loss is fine)."""
    loss = record.get("loss")
    return not isinstance(loss, (int, float)) or math.isfinite(loss)


def furthest_good(seen: Iterable[Record], before: float) -> int:
    """The highest step with a finite loss among the records read before ``before``."""
    return max((s for s, t, r in seen if t < before and finite_loss(r)), default=0)


def regained(seen: Sequence[Record], t_fault: float) -> dict[str, Any] | None:
    """When the job made new progress again after a fault at ``t_fault``, or None.

    New progress: a record, read after the first rewind that follows the fault, whose
    step is above every finite-loss step read before it. Records read after the fault
    but before the rewind (a step the faulted rank had finished its share of, logged
    by rank 0 just after the fault) still raise that bar. Returns ``rewind_t`` (when
    the rewritten metrics were read), ``first_step_t`` and ``first_step`` (the first
    record the restarted job trained, redone or new), ``regained_t`` and
    ``regained_step``; the ``regained`` keys are None while no new progress came.
    """
    furthest = 0
    prev: int | None = None
    out: dict[str, Any] | None = None
    for step, t, rec in seen:
        if t >= t_fault and prev is not None and step <= prev and out is None:
            out = {"rewind_t": t, "first_step_t": None, "first_step": None}
            out.update(regained_t=None, regained_step=None)
        elif out is not None and out["first_step_t"] is None and t > out["rewind_t"]:
            out["first_step_t"], out["first_step"] = t, step
        if out is not None and t > out["rewind_t"] and step > furthest and finite_loss(rec):
            out["regained_t"], out["regained_step"] = t, step
            return out
        if out is None and finite_loss(rec):
            furthest = max(furthest, step)
        prev = step
    return out


def productive_seconds(seen: Sequence[Record], t0: float, t1: float) -> float:
    """Wall seconds within ``[t0, t1]`` spent making new progress (the ETTR numerator).

    Each pair of consecutive records ``a``, ``b`` of one process's life (``b``'s step
    above ``a``'s) spans ``t_b - t_a`` seconds in which steps ``s_a + 1 .. s_b`` were
    trained. Of those, the steps above the furthest finite-loss step read before ``b``
    are new; the span counts in proportion to them: ``(t_b - t_a) * new / (s_b - s_a)``.
    A span whose record has a non-finite loss counts nothing. Only the part of a span
    inside ``[t0, t1]`` counts. So redone steps after a restart, the restart itself
    (the rewind's records are read again, their steps not above the furthest) and NaN
    steps are unproductive; a slow step that is new progress counts in full.
    """
    if t1 <= t0:
        raise ValueError(f"t1 must be after t0, got t0={t0} t1={t1}")
    furthest = 0
    total = 0.0
    prev: Record | None = None
    for rec in seen:
        step, t, body = rec
        if prev is not None and step > prev[0] and t > prev[1] and finite_loss(body):
            s_a, t_a = prev[0], prev[1]
            new = max(0, step - max(s_a, furthest))
            if new:
                span = t - t_a
                inside = max(0.0, min(t, t1) - max(t_a, t0))
                total += span * new / (step - s_a) * (inside / span)
        if finite_loss(body):
            furthest = max(furthest, step)
        prev = rec
    return total


def first_event(
    events: Iterable[Mapping[str, Any]], kind: str, after: float, until: float = math.inf
) -> Mapping[str, Any] | None:
    """The first driver event of ``kind`` with ``after <= time < until``."""
    for e in events:
        if e.get("kind") == kind and after <= float(e["time"]) < until:
            return e
    return None


def first_finding(
    events: Iterable[Mapping[str, Any]],
    after: float,
    kinds: Sequence[str],
    rank: int | None = None,
    until: float = math.inf,
) -> Mapping[str, Any] | None:
    """The first ``finding`` event at or after ``after`` (wall time) whose finding is of
    one of ``kinds`` and, when ``rank`` is given, names it among its ranks."""
    for e in events:
        if e.get("kind") != "finding" or not after <= float(e["time"]) < until:
            continue
        finding = e.get("evidence", {}).get("finding", {})
        if finding.get("kind") in kinds and (rank is None or rank in e.get("ranks", [])):
            return e
    return None
