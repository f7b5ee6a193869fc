"""Prometheus text exposition (format 0.0.4) for the driver's ``GET /metrics``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = ["CONTENT_TYPE", "Exposition"]

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
