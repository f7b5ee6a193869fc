"""Heartbeats, a driver that detects, diagnoses and recovers, and node diagnostics.

- In each training process: :class:`Heartbeat` (``ms_health.executor``) posts the
  loop's progress to the driver from a background thread.
- The driver (:class:`Driver`, ``ms-health driver``): takes heartbeats over
  token-checked HTTP, runs the :mod:`ms_health.detectors` and hands each new
  :class:`Finding` to a recovery policy.
- Acting: :func:`escalate` ends a process for sure (dump, SIGTERM, SIGKILL, bounded);
  :mod:`ms_health.diagnostics` tests a node from outside the job; :class:`Blocklist`
  keeps failed nodes out.

Public names are imported on first use: the sender must not pay for the driver's or the
diagnostics' imports (nor torch), and ``python -m ms_health.driver`` must not find its
module imported already.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ms_health._version import __version__

if TYPE_CHECKING:
    from ms_health.blocklist import BlockedNode, Blocklist
    from ms_health.diagnostics import NodeReport, diagnose_node
    from ms_health.driver import Driver, HealthEvent
    from ms_health.escalate import Escalation, escalate
    from ms_health.executor import Heartbeat
    from ms_health.findings import Detector, Finding
    from ms_health.record import HeartbeatRecord, RecordError, StackDump

__all__ = [
    "BlockedNode",
    "Blocklist",
    "Detector",
    "Driver",
    "Escalation",
    "Finding",
    "HealthEvent",
    "Heartbeat",
    "HeartbeatRecord",
    "NodeReport",
    "RecordError",
    "StackDump",
    "__version__",
    "diagnose_node",
    "escalate",
]

# Where each public name lives.
_MODULES = {
    "BlockedNode": "ms_health.blocklist",
    "Blocklist": "ms_health.blocklist",
    "Detector": "ms_health.findings",
    "Driver": "ms_health.driver",
    "Escalation": "ms_health.escalate",
    "Finding": "ms_health.findings",
    "HealthEvent": "ms_health.driver",
    "Heartbeat": "ms_health.executor",
    "HeartbeatRecord": "ms_health.record",
    "NodeReport": "ms_health.diagnostics",
    "RecordError": "ms_health.record",
    "StackDump": "ms_health.record",
    "diagnose_node": "ms_health.diagnostics",
    "escalate": "ms_health.escalate",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'ms_health' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
