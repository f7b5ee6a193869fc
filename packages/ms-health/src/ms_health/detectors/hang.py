"""No step progress: heartbeats may keep coming (the heartbeat thread lives on while the
training thread waits in a collective that never completes) or stop with it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import attrs

from ms_health.detectors._common import (
    StateReader,
    detector_name,
    integer,
    listed,
    number,
    rank_set,
)
from ms_health.findings import Finding
from ms_health.record import HeartbeatRecord

__all__ = ["START_TIMEOUTS_S", "Hang"]

_VERSION = 1
#: Phases the detector learns at most; a sender that invents phase names without end
#: cannot grow the driver's state (further phases use the default start value).
_MAX_PHASES = 32
_MAX_PHASE_CHARS = 256

#: Timeout per phase before anything is learned about it. Start-up (imports, the
#: process group, loading a checkpoint) and checkpoints take long and vary, and the
#: first step of a process carries one-time costs (compilation, allocator warm-up):
#: the "health pitfalls" of other projects are false alarms exactly there.
START_TIMEOUTS_S: Mapping[str, float] = {
    "init": 600.0,
    "train": 120.0,
    "checkpoint": 600.0,
    "eval": 300.0,
    "shutdown": 120.0,
}
#: Start value of a phase not in the table.
DEFAULT_START_S = 300.0


@attrs.define
class _Rank:
    """One process's progress as the driver sees it."""

    pid: int
    restart: int
    step: int | None
    phase: str
    status: str
    #: Driver time of the last progress mark (a new step or a new phase).
    mark: float
    #: Steps still to come that are not learned (this process's first steps).
    warm_left: int


class Hang:
    """Reports ranks whose step has not advanced for longer than their phase's timeout
    (kind ``"hang"``).

    A progress mark is a heartbeat whose step or phase differs from the rank's last
    one (a phase change counts: a checkpoint that starts or ends is progress); the
    first heartbeat of a process (a new pid or restart round) is one too. The age of
    a rank's progress runs from its last mark, whether heartbeats keep arriving or not.

    The timeout of a phase is learned: ``safety_factor`` times the longest interval
    between two marks spent in that phase, by any rank, and never below
    ``min_timeout_s``. Before a phase has an interval, its start value applies
    (``start_timeouts_s``, over :data:`START_TIMEOUTS_S`; ``default_start_s`` for other
    phases). In the phases of ``keep_start`` (``init`` and ``checkpoint``) the start
    value stays the least timeout once something is learned: how long they take
    depends on things outside the job (storage, the scheduler, other nodes starting
    up; a restart loads a checkpoint that the first start-up did not), and a false
    alarm there costs a restart, while a hang there is rare. The first
    ``warmup_steps`` steps of a new process (first seen in ``init``, without a step,
    replacing an earlier process of its rank, or first seen after :meth:`reset`) carry
    one-time costs (compilation, allocator and cache warm-up): they are judged against
    the ``train`` start value (or the learned timeout if longer) and not learned, so
    that one slow first step does not stretch every later timeout. The learned
    intervals are the state that checkpoints.

    Suspects: when the live ranks are at different steps, those at the lowest step
    (furthest behind; a rank without a step counts as lowest); otherwise the ranks
    past their timeout. Ranks whose last heartbeat said ``stopping`` are left out.
    """

    def __init__(
        self,
        *,
        safety_factor: float = 5.0,
        min_timeout_s: float = 2.0,
        start_timeouts_s: Mapping[str, float] | None = None,
        default_start_s: float = DEFAULT_START_S,
        warmup_steps: int = 1,
        keep_start: Collection[str] = ("init", "checkpoint"),
        name: str = "hang",
    ) -> None:
        self.name = detector_name(name)
        self.safety_factor = number("safety_factor", safety_factor, low=1.0, strict=False)
        self.min_timeout_s = number("min_timeout_s", min_timeout_s, low=0.0)
        self.default_start_s = number("default_start_s", default_start_s, low=0.0)
        self.warmup_steps = integer("warmup_steps", warmup_steps, low=0)
        starts = dict(START_TIMEOUTS_S)
        if start_timeouts_s is not None:
            if not isinstance(start_timeouts_s, Mapping):
                raise TypeError(
                    "start_timeouts_s must be a mapping of phase to seconds, got "
                    f"{type(start_timeouts_s).__name__}"
                )
            for phase, seconds in start_timeouts_s.items():
                if not isinstance(phase, str) or not phase:
                    raise ValueError(
                        f"start_timeouts_s keys must be non-empty phase names, got {phase!r}"
                    )
                starts[phase] = number(f"start_timeouts_s[{phase!r}]", seconds, low=0.0)
        self.start_timeouts_s: Mapping[str, float] = starts
        if isinstance(keep_start, str) or not all(isinstance(p, str) for p in keep_start):
            raise TypeError(f"keep_start must be a collection of phase names, got {keep_start!r}")
        self.keep_start = frozenset(keep_start)
        self._longest: dict[str, float] = {}
        self._ranks: dict[int, _Rank] = {}
        #: Ranks reset since their last heartbeat (all of them once every rank was):
        #: the next process seen there is a new one.
        self._reset: set[int] = set()
        self._reset_all = False

    # -- what was learned ------------------------------------------------------------

    @property
    def longest_s(self) -> dict[str, float]:
        """The longest interval between progress marks seen per phase, in seconds."""
        return dict(self._longest)

    def timeout_for(self, phase: str, *, warming: bool = False) -> float:
        """The timeout a rank in ``phase`` gets now (``warming``: in its first steps)."""
        return self._timeout(phase, warming)[0]

    def _timeout(self, phase: str, warming: bool) -> tuple[float, str]:
        """The timeout and how it came about, for the evidence."""
        start = self.start_timeouts_s.get(phase, self.default_start_s)
        longest = self._longest.get(phase)
        if longest is None:
            timeout, how = start, f"start value of phase {phase!r}, nothing learned yet"
        else:
            timeout = self.safety_factor * longest
            how = f"{self.safety_factor:g} x the longest {phase!r} interval {longest:.3f} s"
            if phase in self.keep_start and start > timeout:
                timeout, how = start, f"start value of phase {phase!r}, kept (else {how})"
        if warming:
            first = self.start_timeouts_s.get("train", self.default_start_s)
            if first > timeout:
                timeout, how = first, "start value of 'train': a process's first steps"
        if timeout < self.min_timeout_s:
            timeout, how = self.min_timeout_s, f"the floor min_timeout_s (else {how})"
        return timeout, how

    # -- the detector ----------------------------------------------------------------

    def observe(self, record: HeartbeatRecord, now: float) -> None:
        r = self._ranks.get(record.rank)
        if r is None or r.pid != record.pid or r.restart != record.restart:
            # A process is in its first steps when it says so (init, no step yet), when
            # it replaces a process seen before, or when it is the first seen after a
            # reset (the restarted process may have passed init before the driver
            # reset its rank, and its first steps wait for peers that load slower). A
            # process first seen mid-training otherwise (the driver restarted) is not.
            fresh = (
                record.phase == "init"
                or record.step is None
                or r is not None
                or self._reset_all
                or record.rank in self._reset
            )
            self._reset.discard(record.rank)
            self._ranks[record.rank] = _Rank(
                pid=record.pid,
                restart=record.restart,
                step=record.step,
                phase=record.phase,
                status=record.status,
                mark=now,
                warm_left=self.warmup_steps if fresh else 0,
            )
            return
        if record.step != r.step or record.phase != r.phase:
            # The interval since the last mark was spent in the phase reported then:
            # a phase change is itself a mark, so no heartbeat between the two
            # reported another phase.
            if record.step != r.step and r.warm_left > 0 and r.phase == "train":
                r.warm_left -= 1
            else:
                self._learn(r.phase, now - r.mark)
            r.mark = now
        r.step, r.phase, r.status = record.step, record.phase, record.status

    def _learn(self, phase: str, interval: float) -> None:
        if phase not in self._longest and len(self._longest) >= _MAX_PHASES:
            return
        if phase not in self._longest or interval > self._longest[phase]:
            self._longest[phase] = interval

    def check(self, now: float) -> list[Finding]:
        live = {rank: r for rank, r in self._ranks.items() if r.status != "stopping"}
        hung: dict[int, tuple[float, float, str]] = {}
        for rank, r in live.items():
            timeout, how = self._timeout(r.phase, r.warm_left > 0 and r.phase == "train")
            age = now - r.mark
            if age > timeout:
                hung[rank] = (age, timeout, how)
        if not hung:
            return []

        def position(r: _Rank) -> int:
            return -1 if r.step is None else r.step

        lowest = min(position(r) for r in live.values())
        if any(position(r) != lowest for r in live.values()):
            suspects = sorted(rank for rank, r in live.items() if position(r) == lowest)
            why = "furthest behind"
        else:
            suspects = sorted(hung)
            why = "past their timeout, all at the same step"
        shown: dict[int, dict[str, Any]] = {}
        for rank in sorted(set(suspects) | hung.keys()):
            r = live[rank]
            timeout, how = self._timeout(r.phase, r.warm_left > 0 and r.phase == "train")
            shown[rank] = {
                "step": r.step,
                "phase": r.phase,
                "progress_age_s": round(now - r.mark, 3),
                "timeout_s": round(timeout, 3),
                "timeout_from": how,
                "hung": rank in hung,
            }
        first = min(hung, key=lambda k: hung[k][1] - hung[k][0])  # furthest past its timeout
        age, timeout, how = hung[first]
        phase = live[first].phase
        message = (
            f"no progress on rank(s) {sorted(hung)} (rank {first}: {age:.2f} s in phase "
            f"{phase!r} at step {live[first].step}, timeout {timeout:.2f} s = {how}); "
            f"suspects {suspects}: {why}"
        )
        steps = [step for s in suspects if (step := live[s].step) is not None]
        return [
            Finding(
                detector=self.name,
                kind="hang",
                ranks=tuple(suspects),
                message=message,
                evidence={
                    "hung": len(hung),
                    "live": len(live),
                    "suspects_are": why,
                    "safety_factor": self.safety_factor,
                    "min_timeout_s": self.min_timeout_s,
                    "longest_s": {p: round(v, 6) for p, v in self._longest.items()},
                    "ranks": listed(shown, first=suspects),
                },
                at=now,
                step=min(steps) if steps else None,
            )
        ]

    def reset(self, ranks: tuple[int, ...] | None = None) -> None:
        chosen = rank_set(ranks)
        if chosen is None:
            self._ranks.clear()
            self._reset_all = True
        for rank in chosen or ():
            self._ranks.pop(rank, None)
            self._reset.add(rank)

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "detector", "longest_s": {phase: seconds}}``."""
        return {
            "version": _VERSION,
            "detector": type(self).__name__,
            "longest_s": dict(self._longest),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        reader = StateReader(state, type(self).__name__, _VERSION)
        raw = reader.mapping("longest_s", limit=_MAX_PHASES)
        longest: dict[str, float] = {}
        for phase, seconds in raw.items():
            if not isinstance(phase, str) or not phase or len(phase) > _MAX_PHASE_CHARS:
                raise reader.bad(
                    f"'longest_s'][{phase!r}",
                    f"keyed by a phase name of 1 to {_MAX_PHASE_CHARS} chars",
                    phase,
                )
            longest[phase] = reader.number(f"'longest_s'][{phase!r}", seconds, low=0.0)
        self._longest = longest
