"""What the detectors share: argument checks, state reading, robust statistics, and the
outbox that holds findings until the driver's next check."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

import attrs

from ms_health.findings import Finding

__all__: list[str] = []

#: A finding's evidence lists at most this many ranks one by one (a 1,000-rank job
#: would otherwise write kilobytes per finding, on every check); the rest are counted.
MAX_LISTED_RANKS = 64
#: Scale of the median absolute deviation that makes it estimate a normal
#: distribution's standard deviation.
MAD_TO_SIGMA = 1.4826


# ----------------------------------------------------------------- constructor arguments


def number(name: str, value: Any, *, low: float, strict: bool = True) -> float:
    """``value`` as a float; it must be finite and ``> low`` (``>= low`` when not strict)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        rel = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {rel} {low:g}, got {value!r}")
    return float(value)


def integer(name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def fraction(name: str, value: Any) -> float:
    v = number(name, value, low=0.0)
    if v >= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")
    return v


def detector_name(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 64:
        raise ValueError(f"name must be a non-empty string of <= 64 chars, got {value!r}")
    return value


def rank_set(ranks: Any) -> set[int] | None:
    """``reset``'s argument as a set (None: every rank), each rank checked."""
    if ranks is None:
        return None
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"ranks must be a tuple of ints or None, got {type(ranks).__name__}")
    out = set()
    for r in ranks:
        out.add(integer("ranks[...]", r, low=0))
    return out


# ------------------------------------------------------------------------- saved state


class StateReader:
    """Checked access to a saved state; every error names ``<Detector> state[<field>]``."""

    def __init__(self, state: Any, owner: str, version: int) -> None:
        self.owner = owner
        if not isinstance(state, Mapping):
            raise TypeError(f"{owner} state must be a mapping, got {type(state).__name__}")
        got = state.get("version")
        if isinstance(got, bool) or got != version:
            raise ValueError(
                f"{owner} state['version'] must be {version} (the format this version "
                f"reads), got {got!r}"
            )
        kind = state.get("detector")
        if kind != owner:
            raise ValueError(
                f"{owner} state['detector'] must be {owner!r} (a state saved by another "
                f"detector cannot be honoured), got {kind!r}"
            )
        self.state = state

    def bad(self, field: str, expected: str, value: Any) -> ValueError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return ValueError(f"{self.owner} state[{field}] must be {expected}, got {shown}")

    def get(self, key: str) -> Any:
        if key not in self.state:
            raise ValueError(f"{self.owner} state[{key!r}] is missing")
        return self.state[key]

    def number(self, field: str, value: Any, *, low: float = -math.inf) -> float:
        ok = not isinstance(value, bool) and isinstance(value, (int, float))
        if not ok or not math.isfinite(value) or value < low:
            raise self.bad(field, f"a finite number >= {low:g}", value)
        return float(value)

    def integer(self, field: str, value: Any, *, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.bad(field, f"an int >= {low}", value)
        return value

    def numbers(self, key: str, *, low: float = -math.inf, limit: int) -> list[float]:
        """The list ``state[key]`` of at most ``limit`` finite numbers ``>= low``."""
        value = self.get(key)
        if not isinstance(value, list) or len(value) > limit:
            raise self.bad(repr(key), f"a list of at most {limit} numbers", value)
        return [self.number(f"{key!r}][{i}", v, low=low) for i, v in enumerate(value)]

    def mapping(self, key: str, *, limit: int) -> Mapping[Any, Any]:
        value = self.get(key)
        if not isinstance(value, Mapping) or len(value) > limit:
            raise self.bad(repr(key), f"a mapping of at most {limit} entries", value)
        return value

    def rank(self, key: str, raw: Any) -> int:
        """A rank used as a mapping key: an int, or its decimal string as JSON has it."""
        if isinstance(raw, str) and raw.isdigit():
            return int(raw)
        if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
            return raw
        raise self.bad(f"{key!r}][{raw!r}", "keyed by a rank (an int >= 0 or its string)", raw)


# --------------------------------------------------------------------------- statistics


def median(values: Iterable[float]) -> float:
    xs = sorted(values)
    if not xs:
        raise ValueError("median of no values")
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def median_mad(values: Iterable[float]) -> tuple[float, float]:
    """The median and the median absolute deviation from it."""
    xs = list(values)
    m = median(xs)
    return m, median(abs(x - m) for x in xs)


def listed(per_rank: Mapping[int, Any], first: Iterable[int] = ()) -> dict[str, Any]:
    """``per_rank`` as JSON-ready evidence: ranks in ``first`` (the suspects) and then
    the lowest others, at most :data:`MAX_LISTED_RANKS` of them."""
    order = [r for r in first if r in per_rank]
    seen = set(order)
    order += [r for r in sorted(per_rank) if r not in seen]
    return {str(r): per_rank[r] for r in order[:MAX_LISTED_RANKS]}


def loss_json(x: float) -> float | str:
    """A loss as evidence: JSON has no NaN or infinity, so those travel as strings
    (the same spelling as the heartbeat's wire format)."""
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


# ------------------------------------------------------------------------------ outbox


class Outbox:
    """Findings keyed by what they are about, returned on every check while they hold.

    A condition seen at a heartbeat can clear before the next check (a one-step loss
    spike followed by a normal step); it is still returned once, so that no finding
    is lost between two ticks of the driver.
    """

    def __init__(self) -> None:
        self._open: dict[Any, Finding] = {}
        self._delivered: set[Any] = set()
        self._cleared: set[Any] = set()

    def __contains__(self, key: Any) -> bool:
        return key in self._open

    def __getitem__(self, key: Any) -> Finding:
        return self._open[key]

    def keys(self) -> list[Any]:
        return list(self._open)

    def put(self, key: Any, finding: Finding) -> None:
        self._open[key] = finding
        self._cleared.discard(key)

    def clear(self, key: Any) -> None:
        """The condition ended: drop it now if the driver has seen it, else after the
        next check."""
        if key not in self._open:
            return
        if key in self._delivered:
            self._drop(key)
        else:
            self._cleared.add(key)

    def drop_all(self) -> None:
        self._open.clear()
        self._delivered.clear()
        self._cleared.clear()

    def collect(self) -> list[Finding]:
        out = list(self._open.values())
        for key in self._cleared:
            self._drop(key)
        self._cleared.clear()
        self._delivered.update(self._open)
        return out

    def _drop(self, key: Any) -> None:
        self._open.pop(key, None)
        self._delivered.discard(key)


# ------------------------------------------------------------------- per-step values


#: What a :class:`StepBins` holds per rank and step: a number, or a tuple of them.
V = TypeVar("V")


@attrs.frozen
class Added(Generic[V]):
    """What :meth:`StepBins.add` did with one value."""

    #: False for a heartbeat that repeats its rank's last step, or comes too late.
    accepted: bool
    #: The bins completed by it, oldest first: (bin, {rank: values}).
    closed: list[tuple[int, dict[int, list[V]]]] = attrs.field(factory=list)
    #: True when it showed that the job went back (a restart from a checkpoint) and
    #: the bins were emptied.
    rewound: bool = False


class StepBins(Generic[V]):
    """Per-rank values of the job's recent steps, grouped in bins of ``width`` steps;
    each bin is handed back once, complete.

    Heartbeats carry the latest step of each rank, so a step may be seen by some
    ranks' heartbeats only, and one rank may repeat it (a heartbeat between two steps:
    counted once). Ranks of a synchronous job are within a step of each other, so a
    bin is complete once some rank has reported step ``(bin + 1) * width + lag``;
    a later value for it is dropped. With ``wait_all``, for values that heartbeats
    carry for every step (each rank reports all its steps since its last heartbeat,
    at its own moment), a bin is also complete once every rank of the job (``world``,
    as the heartbeats give it) has reported its last step, and ``lag`` only bounds the
    wait for a rank that went quiet or has not reported since a restart.

    A new process of a rank (another pid) reporting a step behind the job's front
    means the job restarted from a checkpoint: the open bins are dropped and counting
    starts over.
    """

    def __init__(self, width: int = 1, lag: int = 0, *, wait_all: bool = False) -> None:
        self.width, self.lag, self.wait_all = width, lag, wait_all
        self._bins: dict[int, dict[int, list[V]]] = {}
        self._last: dict[int, tuple[int, int]] = {}  # rank -> (pid, step)
        # (step, rank) of every rank's last step, the lowest first; an entry whose
        # rank has moved on since is stale and skipped (wait_all only)
        self._behind: list[tuple[int, int]] = []
        self._front: int | None = None  # the highest step reported
        self._closed_below = 0  # bins below this one were handed back
        self._world = 0  # the job's ranks, the most any value came with

    def add(self, rank: int, pid: int, step: int, value: V) -> Added[V]:
        return self.add_many(rank, pid, ((step, value),))

    def add_many(
        self, rank: int, pid: int, values: Iterable[tuple[int, V]], world: int = 0
    ) -> Added[V]:
        """Values of one rank's consecutive steps, oldest first (one heartbeat's), in a
        job of ``world`` ranks (wait_all)."""
        self._world = max(self._world, world)
        accepted = rewound = False
        for step, value in values:
            prev = self._last.get(rank)
            if prev == (pid, step):
                continue
            front = self._front
            if prev is not None and prev[0] != pid and front is not None and step < front:
                self.reset()
                rewound = True
            self._last[rank] = (pid, step)
            if self.wait_all:
                heapq.heappush(self._behind, (step, rank))
            if self._front is None or step > self._front:
                self._front = step
            b = step // self.width
            if b >= self._closed_below:
                self._bins.setdefault(b, {}).setdefault(rank, []).append(value)
                accepted = True
        if len(self._behind) > 4 * len(self._last) + 1024:  # a quiet rank holds the top
            self._behind = [(step, r) for r, (_, step) in self._last.items()]
            heapq.heapify(self._behind)
        return Added(accepted, self._close(), rewound)

    def _close(self) -> list[tuple[int, dict[int, list[V]]]]:
        if self._front is None:
            return []
        everyone = self._everyone_through()
        closed = []
        for k in sorted(self._bins):
            end = (k + 1) * self.width - 1  # the bin's last step
            if end + 1 + self.lag > self._front and (everyone is None or end > everyone):
                break
            closed.append((k, self._bins.pop(k)))
            self._closed_below = k + 1
        return closed

    def _everyone_through(self) -> int | None:
        """The step that every rank seen has reported (wait_all), else None."""
        if not self.wait_all:
            return None
        if len(self._last) < self._world:
            return -1  # a rank of the job has not reported (since a restart)
        while self._behind:
            step, rank = self._behind[0]
            last = self._last.get(rank)
            if last is not None and last[1] == step:
                return step
            heapq.heappop(self._behind)  # stale: the rank moved on or was reset
        return None

    def reset(self, ranks: set[int] | None = None) -> None:
        if ranks is None:
            self._bins.clear()
            self._last.clear()
            self._behind.clear()
            self._front, self._closed_below = None, 0
            return
        for rank in ranks:
            self._last.pop(rank, None)
            for values in self._bins.values():
                values.pop(rank, None)
