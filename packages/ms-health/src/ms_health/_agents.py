"""The driver's side of the node agents: who runs which workers, the actions ordered
for each node, and their outcomes.

An agent reports every fraction of a second (``POST /agent``); the reply hands it the
actions queued for its node since, and its next report carries their outcomes. A
policy on the driver orders an action with :meth:`AgentBook.order` and waits for its
outcome with :meth:`AgentBook.wait`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs

from ms_health.record import AgentReport

__all__ = ["AgentBook", "AgentView"]

ACTIONS = ("escalate", "dump", "diagnose")


@attrs.frozen
class AgentView:
    """What the driver knows of one node's agent."""

    node: str
    host: str
    pid: int
    restart: int
    workers: Mapping[int, int]
    #: Driver clock time of its last report.
    seen_at: float


#: Worker pids remembered with their node (the oldest are forgotten first).
_MAX_PIDS = 65536


class AgentBook:
    """Thread-safe; every method may be called from any thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._agents: dict[str, AgentView] = {}
        self._queued: dict[str, list[dict[str, Any]]] = {}
        self._results: dict[int, dict[str, Any]] = {}
        self._ids = itertools.count(1)
        #: Every worker pid an agent reported, to the node of its newest report, newest
        #: last: a crashed worker is gone from its agent's list by the time the driver
        #: sees its silence, and the recovery must still find its node.
        self._pid_nodes: dict[int, str] = {}

    def report(self, report: AgentReport, now: float) -> list[dict[str, Any]]:
        """Take ``report``; the actions to hand its agent."""
        with self._cond:
            self._agents[report.node] = AgentView(
                report.node, report.host, report.pid, report.restart, dict(report.workers), now
            )
            for pid in report.workers.values():
                self._pid_nodes.pop(pid, None)
                self._pid_nodes[pid] = report.node
            while len(self._pid_nodes) > _MAX_PIDS:
                del self._pid_nodes[next(iter(self._pid_nodes))]
            for result in report.results:
                self._results[int(result["id"])] = dict(result)
            handed = self._queued.pop(report.node, [])
            self._cond.notify_all()
            return handed

    def agents(self) -> dict[str, AgentView]:
        with self._cond:
            return dict(self._agents)

    def node_of(self, pid: int) -> str | None:
        """The node whose agent runs worker ``pid`` or last reported it (a worker that
        has since died), or None when no agent ever did."""
        with self._cond:
            for view in self._agents.values():
                if pid in view.workers.values():
                    return view.node
            return self._pid_nodes.get(pid)

    def order(self, node: str, kind: str, **params: Any) -> int:
        """Queue action ``kind`` for ``node``'s agent; its id."""
        if kind not in ACTIONS:
            raise ValueError(f"kind must be one of {ACTIONS}, got {kind!r}")
        with self._cond:
            action_id = next(self._ids)
            self._queued.setdefault(node, []).append({"id": action_id, "kind": kind, **params})
            return action_id

    def wait(self, action_id: int, timeout_s: float) -> dict[str, Any] | None:
        """The outcome of ``action_id``, or None if it did not come within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while action_id not in self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return dict(self._results[action_id])
