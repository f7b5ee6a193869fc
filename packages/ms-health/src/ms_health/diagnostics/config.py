"""What the diagnostic processes check, and against which bounds and floors."""

from __future__ import annotations

import math
from typing import Any

import attrs

from ms_health.diagnostics.compute import MATMUL_TOLERANCE

__all__ = ["DiagnosticsConfig"]


def _positive(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{attribute.name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _count(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None and attribute.name == "matmul_size":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _floor(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{attribute.name} must be None or a number >= 0, got {value!r}")


def _dtype(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in MATMUL_TOLERANCE:
        raise ValueError(
            f"{attribute.name} must be None or one of {sorted(MATMUL_TOLERANCE)}, got {value!r}"
        )


@attrs.frozen
class DiagnosticsConfig:
    """Sizes, bounds and floors of :func:`~ms_health.diagnostics.diagnose_node`'s checks.

    The floors are None by default: a healthy node's figures differ by machine, so set
    them from a known-good node of the same kind (a fraction of its measured figures).
    """

    #: Bound on the rendezvous and on each collective op, in seconds.
    collective_timeout_s: float = attrs.field(default=30.0, validator=_positive)
    #: Elements (float64) of each collective.
    collective_numel: int = attrs.field(default=1 << 18, validator=_count)
    #: Side of the matmul check's matrices; None: 1024 on CPU, 8192 on CUDA.
    matmul_size: int | None = attrs.field(default=None, validator=_count)
    #: The matmul's dtype; None: float32 on CPU, bfloat16 on CUDA.
    matmul_dtype: str | None = attrs.field(default=None, validator=_dtype)
    #: Matmul throughput floor in FLOP/s, per device.
    min_flops: float | None = attrs.field(default=None, validator=_floor)
    #: MiB copied by the host memory bandwidth check.
    memory_mb: float = attrs.field(default=256.0, validator=_positive)
    #: Host memory bandwidth floor in GB/s (bytes read plus written).
    min_gbps: float | None = attrs.field(default=None, validator=_floor)
