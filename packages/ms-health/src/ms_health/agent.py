"""The node agent: the driver's hands on one node.

It runs beside the node's workers (in the launcher that starts them: ms-train's, or
any process that knows their pids) and reports to the driver every ``interval_s``:
which global ranks run here under which pid, and the outcomes of the actions the
driver asked of it. The driver's reply hands it new actions:

- ``escalate``: end one worker for sure, :func:`ms_health.escalate.escalate`: its
  stacks through faulthandler (when the worker registered a dump file under
  ``dump_dir``), SIGTERM, SIGKILL, each wait bounded. Only a pid this node's agent
  reports as its own worker is ever signalled.
- ``dump``: ask one worker for its stacks (faulthandler, as above) and leave it running:
  a rank silent to the driver whose process still answers may only have lost its
  heartbeat sender.
- ``diagnose``: run :func:`ms_health.diagnostics.diagnose_node` on this node.

Each action runs on a thread of its own, so a slow escalation never delays the
reports (the driver would take a silent agent for a dead node).

Once a worker is gone, the elastic agent that started it (torchrun's, or the one inside
``ms-train``'s launcher) sees the failure and restarts the node's workers, and the
c10d rendezvous makes the other nodes' agents restart theirs: the restart itself is
``torch.distributed.elastic``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ms_health import _host
from ms_health._client import JsonClient, LocalApp, LocalClient, TransportError
from ms_health.record import AgentReport

if TYPE_CHECKING:
    from ms_health.diagnostics.config import DiagnosticsConfig

__all__ = ["NodeAgent", "dump_file"]

_log = logging.getLogger(__name__)

# The start of a worker's stacks is what a ``dump`` action sends back: a report body must
# stay small, and faulthandler lists each thread's newest frames first.
_MAX_DUMP_CHARS = 20_000


def dump_file(dump_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank``'s faulthandler writes its stacks under ``dump_dir`` (workers
    call :func:`ms_health.escalate.install_dump_handler` on it)."""
    return Path(dump_dir) / f"rank-{rank}.stacks"


class NodeAgent:
    """Report this node's workers to the driver at ``url`` and carry out its actions.

    Args:
        url, token: the driver and its shared token.
        job: the job's id (the driver refuses another job's agent).
        node: this node's name, as its workers' heartbeats give it.
        workers: returns global rank -> pid of the node's live workers (called on the
            agent's thread at every report).
        restart: returns the elastic restart round the workers run in.
        dump_dir: where workers write their stacks on SIGUSR1 (``dump_file``).
        interval_s: seconds between reports.
        term_timeout_s, kill_timeout_s: the escalation's bounds (SIGTERM lets a rank
            save; a rank that cannot is killed after it).
        diagnose_nproc, diagnose_timeout_s: the node diagnostics' processes and bound.
        diagnostics: the diagnostics' sizes, bounds and floors (for example the least
            matmul throughput a healthy node of this kind reaches); None: defaults.
        driver: the :class:`~ms_health.driver.Driver` when it runs in this process
            (the launcher that hosts it): reports reach it by a call, with the same
            checks and reply, instead of HTTP to itself. ``url`` and ``token`` are then
            only named in messages.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        job: str,
        node: str,
        workers: Callable[[], Mapping[int, int]],
        restart: Callable[[], int] = lambda: 0,
        dump_dir: str | os.PathLike[str] | None = None,
        interval_s: float = 0.5,
        term_timeout_s: float = 10.0,
        kill_timeout_s: float = 5.0,
        diagnose_nproc: int = 2,
        diagnose_timeout_s: float = 60.0,
        diagnostics: DiagnosticsConfig | None = None,
        driver: LocalApp | None = None,
    ) -> None:
        for name, value in (
            ("interval_s", interval_s),
            ("term_timeout_s", term_timeout_s),
            ("kill_timeout_s", kill_timeout_s),
            ("diagnose_timeout_s", diagnose_timeout_s),
        ):
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        if not callable(workers):
            raise TypeError(f"workers must be callable, got {workers!r}")
        if driver is not None and not callable(getattr(driver, "post", None)):
            raise TypeError(
                f"driver must be a Driver (with post(path, body, client)) in this process "
                f"or None, got {driver!r}"
            )
        self.job, self.node = job, node
        self.workers, self.restart = workers, restart
        self.dump_dir = None if dump_dir is None else Path(dump_dir)
        self.interval_s = float(interval_s)
        self.term_timeout_s, self.kill_timeout_s = term_timeout_s, kill_timeout_s
        self.diagnose_nproc, self.diagnose_timeout_s = diagnose_nproc, diagnose_timeout_s
        self.diagnostics = diagnostics
        self._client: JsonClient | LocalClient = (
            JsonClient(url, token, timeout_s=max(2.0, 4 * interval_s))
            if driver is None
            else LocalClient(driver, name=f"agent {node}")
        )
        self._results: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._busy: list[threading.Thread] = []
        self._host = socket.gethostname()
        self._warned = False
        #: Every action's outcome, in the order they finished (for the launcher's log).
        self.done: list[dict[str, Any]] = []

    def start(self) -> NodeAgent:
        self._thread = threading.Thread(
            target=_host.named("agent", self._loop), name="ms-health-agent", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop reporting; actions in progress finish (bounded by ``timeout_s``), and one
        last report carries their outcomes."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._busy:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(TransportError):
            self._report()
        self._client.close()

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                actions = self._report()
                self._warned = False
            except TransportError as e:
                if not self._warned:
                    _log.warning("ms-health agent: the driver is unreachable (%s); retrying", e)
                    self._warned = True
                actions = []
            except Exception:  # a bug here must not end the agent
                _log.exception("ms-health agent: report failed")
                actions = []
            for action in actions:
                thread = threading.Thread(
                    target=_host.named("action", self._run),
                    args=(action,),
                    name="ms-health-action",
                    daemon=True,
                )
                thread.start()
                self._busy = [t for t in self._busy if t.is_alive()] + [thread]
            self._stop.wait(self.interval_s)

    def _report(self) -> list[dict[str, Any]]:
        with self._lock:
            results, self._results = self._results, []
        report = AgentReport(
            job=self.job,
            node=self.node,
            host=self._host,
            pid=os.getpid(),
            sent_at=time.time(),
            restart=int(self.restart()),
            workers=dict(self.workers()),
            results=tuple(results),
        )
        try:
            status, reply = self._client.post("/agent", report.to_json())
        except TransportError:
            with self._lock:  # try the outcomes again next time
                self._results = results + self._results
            raise
        if status != 200:
            _log.warning("ms-health agent: the driver refused a report: %s %s", status, reply)
            return []
        actions = reply.get("actions", [])
        return [a for a in actions if isinstance(a, dict) and isinstance(a.get("id"), int)]

    def _run(self, action: dict[str, Any]) -> None:
        kind = action.get("kind")
        try:
            if kind == "escalate":
                result = self._escalate(action)
            elif kind == "dump":
                result = self._dump(action)
            elif kind == "diagnose":
                result = self._diagnose(action)
            else:
                result = {"ok": False, "summary": f"unknown action {kind!r}"}
        except Exception as e:
            _log.exception("ms-health agent: action %s failed", action)
            result = {"ok": False, "summary": f"{type(e).__name__}: {e}"}
        result = {"id": action["id"], "kind": kind, **result}
        with self._lock:
            self._results.append(result)
            self.done.append(result)

    def _not_mine(self, action: dict[str, Any]) -> dict[str, Any] | None:
        """The refusal when the action's pid is not one of this node's workers: never
        signal another process (a pid from an old heartbeat may since be anything)."""
        pid = action.get("pid")
        mine = dict(self.workers())
        if isinstance(pid, int) and pid in mine.values():
            return None
        return {
            "ok": False,
            "rank": action.get("rank"),
            "summary": f"pid {pid} is not a worker of node {self.node} (workers: {mine})",
        }

    def _dump_file(self, rank: object) -> Path | None:
        if self.dump_dir is None or not isinstance(rank, int):
            return None
        candidate = dump_file(self.dump_dir, rank)
        return candidate if candidate.exists() else None

    def _dump(self, action: dict[str, Any]) -> dict[str, Any]:
        from ms_health.escalate import process_state, request_dump

        refused = self._not_mine(action)
        if refused is not None:
            return refused
        rank, pid = action.get("rank"), int(action["pid"])
        path = self._dump_file(rank)
        state = process_state(pid)
        if path is None:
            text = ""
            why = "no dump file (the worker registered no faulthandler for it)"
        elif state in ("T", "t"):
            text, why = "", "none: it is stopped and cannot answer"
        else:
            timeout = float(action.get("timeout_s", 2.0))
            text = request_dump(pid, path, timeout_s=timeout)
            why = f"{len(text)} characters" if text else "no answer"
        return {
            "ok": bool(text),
            "rank": rank,
            "pid": pid,
            "state": state,
            "dump": text[:_MAX_DUMP_CHARS],
            "summary": f"rank {rank} (pid {pid}, state {state}) stacks: {why}",
        }

    def _escalate(self, action: dict[str, Any]) -> dict[str, Any]:
        from ms_health.escalate import escalate

        refused = self._not_mine(action)
        if refused is not None:
            return refused
        rank, pid = action.get("rank"), int(action["pid"])
        dump = self._dump_file(rank)
        term = float(action.get("term_timeout_s", self.term_timeout_s))
        outcome = escalate(
            pid,
            dump_file=dump,
            term_timeout_s=term,
            kill_timeout_s=self.kill_timeout_s,
        )
        return {
            "ok": outcome.outcome != "survived",
            "rank": rank,
            "summary": f"rank {rank} (pid {pid}) {outcome.outcome} after "
            f"{', '.join(name for name, _ in outcome.steps) or 'nothing'}",
            "escalation": outcome.to_json(),
        }

    def _diagnose(self, action: dict[str, Any]) -> dict[str, Any]:
        from ms_health.diagnostics import diagnose_node

        report = diagnose_node(
            nproc=self.diagnose_nproc, timeout_s=self.diagnose_timeout_s, config=self.diagnostics
        )
        return {
            "ok": report.ok,
            "summary": report.summary(),
            "report": report.to_json(),
        }
