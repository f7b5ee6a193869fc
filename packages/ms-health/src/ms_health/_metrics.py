"""Prometheus text exposition (format 0.0.4) for the driver's ``GET /metrics``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import attrs

from ms_health.record import HeartbeatRecord

__all__ = ["CONTENT_TYPE", "Exposition", "RankRow", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Exposition:
    """Metric families, rendered in the order they were added."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[Mapping[str, str], float | int | None]],
    ) -> None:
        """One family; samples whose value is None are left out."""
        self._lines.append(f"# HELP {name} {_escape_help(help_text)}")
        self._lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if value is None:
                continue
            self._lines.append(f"{name}{_labels(labels)} {_value(value)}")

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    # Label values can come from clients (the job's name): escaped as the format asks.
    parts = [f'{k}="{_escape_value(str(v))}"' for k, v in labels.items()]
    return "{" + ",".join(parts) + "}"


def _escape_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(value: float | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


@attrs.frozen
class RankRow:
    """One rank's figures for the per-rank families."""

    rank: int
    record: HeartbeatRecord
    age_s: float
    heartbeats: int


# (name, type, help, value from the rank's last heartbeat)
_PER_RANK: tuple[tuple[str, str, str, Callable[[HeartbeatRecord], float | None]], ...] = (
    ("ms_health_rank_step", "gauge", "Last optimizer step the rank reported.", lambda r: r.step),
    ("ms_health_rank_loss", "gauge", "Last loss the rank reported.", lambda r: r.loss),
    (
        "ms_health_rank_tokens_per_second",
        "gauge",
        "Tokens per second over the rank's steps between its last two heartbeats.",
        lambda r: r.tokens_per_s,
    ),
    (
        "ms_health_rank_step_time_seconds",
        "gauge",
        "The rank's last step time.",
        lambda r: r.step_time_s,
    ),
    (
        "ms_health_rank_wait_seconds",
        "gauge",
        "Seconds of the rank's last step spent waiting on collectives.",
        lambda r: r.wait_s,
    ),
)


def render(
    job: str,
    rows: list[RankRow],
    *,
    heartbeats: int,
    rejected: Mapping[str, int],
    findings_total: Mapping[str, int],
    findings_open: int,
) -> str:
    """The driver's ``/metrics`` text."""
    out = Exposition()
    labelled = [({"job": job, "rank": str(row.rank)}, row) for row in rows]
    for name, kind, help_text, get in _PER_RANK:
        out.family(name, kind, help_text, [(lab, get(row.record)) for lab, row in labelled])
    out.family(
        "ms_health_rank_heartbeat_age_seconds",
        "gauge",
        "Seconds since the driver received the rank's last heartbeat.",
        [(lab, row.age_s) for lab, row in labelled],
    )
    out.family(
        "ms_health_rank_heartbeats_total",
        "counter",
        "Heartbeats accepted from the rank.",
        [(lab, row.heartbeats) for lab, row in labelled],
    )
    out.family(
        "ms_health_heartbeats_total",
        "counter",
        "Heartbeats accepted.",
        [({"job": job}, heartbeats)],
    )
    out.family(
        "ms_health_rejected_requests_total",
        "counter",
        "Requests refused, by reason.",
        [({"reason": k}, v) for k, v in sorted(rejected.items())],
    )
    out.family(
        "ms_health_findings_total",
        "counter",
        "New findings, by kind.",
        [({"kind": k}, v) for k, v in findings_total.items()],
    )
    out.family(
        "ms_health_findings_open",
        "gauge",
        "Findings reported at the last tick.",
        [({"job": job}, findings_open)],
    )
    return out.text()
