"""The nodes of a launch and how often its ranks may restart (``--nnodes``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--max-restarts``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Nodes"]


@dataclass(frozen=True)
class Nodes:
    """One node by default (torchrun ``--standalone``); with ``nnodes`` > 1 every node
    runs ``ms-train`` with the same ``endpoint`` and ``run_id``, and torch's c10d
    rendezvous gathers them (the first node to bind ``endpoint`` hosts its store)."""

    nnodes: int = 1
    endpoint: str | None = None
    run_id: str | None = None
    #: After a rank fails, every node's agent restarts its ranks, up to this many times.
    max_restarts: int = 0
    #: ms-health: heartbeats, a driver that detects and recovers (``ms_train._health_launch``).
    health: bool = False
    #: With several nodes, where the driver listens (the launcher that binds it hosts it).
    health_endpoint: str | None = None
    #: After a crash or hang, test the suspects' nodes; a host that fails its checks goes
    #: on the run's blocklist and the job stops.
    health_diagnose: bool = False
    #: The diagnostics' floors: matmul FLOP/s per process, memory copy bandwidth (GB/s).
    health_min_flops: float | None = None
    health_min_gbps: float | None = None
