"""What a diagnosis reports: one :class:`CheckResult` per check, gathered per process
into a :class:`ProcessReport` and per node into a :class:`NodeReport`.

Everything here is plain data that round-trips through JSON: the worker processes send
their results to the runner as JSON, and the driver records a node's report as the
evidence of its decision (put the node back, or on the blocklist).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["CheckResult", "NodeReport", "ProcessReport"]


def _finite_seconds(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


@attrs.frozen
class CheckResult:
    """The outcome of one check on one process."""

    #: Which check: ``matmul``, ``memory_bandwidth``, ``collective``, ...
    name: str
    ok: bool
    #: Wall seconds the check took.
    seconds: float = attrs.field(converter=float, validator=_finite_seconds)
    #: One line for people: what was measured, against what, and what went wrong.
    message: str
    #: The figures behind it (sizes, errors, tolerances, rates), JSON-serialisable.
    evidence: Mapping[str, Any] = attrs.field(factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "seconds": self.seconds,
            "message": self.message,
            "evidence": dict(self.evidence),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CheckResult:
        """The result :meth:`to_json` wrote; ValueError names a missing or wrong field."""
        r = _Fields(obj, "check")
        return cls(
            name=r.get("name", str),
            ok=r.get("ok", bool),
            seconds=r.get("seconds", (int, float)),
            message=r.get("message", str),
            evidence=r.get("evidence", dict),
        )


@attrs.frozen
class ProcessReport:
    """What one diagnostic process did: the checks it ran, or why it stopped."""

    local_rank: int
    #: Its rank among every process of the diagnosis (all nodes).
    rank: int
    pid: int
    #: The device its checks ran on, e.g. ``cpu`` or ``cuda:3``.
    device: str
    checks: tuple[CheckResult, ...] = ()
    #: Why it did not finish normally (killed at the timeout, died, raised), or None.
    error: str | None = None
    exitcode: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        """One line per failed check, and one for the process itself if it failed."""
        where = f"local rank {self.local_rank} (rank {self.rank}, pid {self.pid}, {self.device})"
        lines = [f"{where}: {c.name}: {c.message}" for c in self.checks if not c.ok]
        if self.error is not None:
            lines.append(f"{where}: {self.error}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "local_rank": self.local_rank,
            "rank": self.rank,
            "pid": self.pid,
            "device": self.device,
            "ok": self.ok,
            "checks": [c.to_json() for c in self.checks],
            "error": self.error,
            "exitcode": self.exitcode,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ProcessReport:
        r = _Fields(obj, "process")
        checks = r.get("checks", list)
        return cls(
            local_rank=r.get("local_rank", int),
            rank=r.get("rank", int),
            pid=r.get("pid", int),
            device=r.get("device", str),
            checks=tuple(CheckResult.from_json(_mapping(c, "process.checks[]")) for c in checks),
            error=r.get("error", str, optional=True),
            exitcode=r.get("exitcode", int, optional=True),
        )


@attrs.frozen
class NodeReport:
    """The diagnosis of one node: every process's checks, and whether the node passes."""

    host: str
    node_rank: int
    nnodes: int
    #: Processes started on this node; ``processes`` holds one report for each.
    nproc: int
    backend: str
    #: Wall seconds from the first process start to the last one's end.
    seconds: float = attrs.field(converter=float, validator=_finite_seconds)
    processes: tuple[ProcessReport, ...] = ()

    @property
    def ok(self) -> bool:
        """The node passes: every process finished and every check it ran passed."""
        return len(self.processes) == self.nproc and all(p.ok for p in self.processes)

    def failures(self) -> list[str]:
        """Which check failed where, one line each; empty when the node passes."""
        lines = [line for p in self.processes for line in p.failures()]
        if len(self.processes) != self.nproc:
            lines.append(f"{len(self.processes)} of {self.nproc} processes reported")
        return lines

    def summary(self) -> str:
        """A few lines for people: the verdict, then every check of every process."""
        verdict = "PASS" if self.ok else "FAIL"
        head = (
            f"{verdict}: node {self.node_rank} of {self.nnodes} ({self.host}), {self.nproc} "
            f"process(es), backend {self.backend}, {self.seconds:.1f} s"
        )
        lines = [head]
        for p in self.processes:
            for c in p.checks:
                mark = "ok  " if c.ok else "FAIL"
                lines.append(f"  [{mark}] local rank {p.local_rank} {c.name}: {c.message}")
            if p.error is not None:
                lines.append(f"  [FAIL] local rank {p.local_rank}: {p.error}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "nproc": self.nproc,
            "backend": self.backend,
            "seconds": self.seconds,
            "ok": self.ok,
            "failures": self.failures(),
            "processes": [p.to_json() for p in self.processes],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> NodeReport:
        r = _Fields(obj, "report")
        procs = [_mapping(p, "report.processes[]") for p in r.get("processes", list)]
        return cls(
            host=r.get("host", str),
            node_rank=r.get("node_rank", int),
            nnodes=r.get("nnodes", int),
            nproc=r.get("nproc", int),
            backend=r.get("backend", str),
            seconds=r.get("seconds", (int, float)),
            processes=tuple(ProcessReport.from_json(p) for p in procs),
        )


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


class _Fields:
    """Typed access to a decoded object; each error names ``<what>.<field>``."""

    def __init__(self, obj: Mapping[str, Any], what: str) -> None:
        self.obj = _mapping(obj, what)
        self.what = what

    def get(self, name: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        value = self.obj.get(name)
        if value is None and optional:
            return None
        # bool is an int to Python; a flag is never a count and a count never a flag.
        wrong_bool = isinstance(value, bool) and kind is not bool
        if value is None or wrong_bool or not isinstance(value, kind):
            kinds = (kind,) if isinstance(kind, type) else kind
            names = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"{self.what}.{name} must be {names}, got {value!r}")
        return value
