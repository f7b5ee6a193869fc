"""The driver: a server that takes every rank's heartbeats, runs the detectors on them,
records each decision as an event, and hands new findings to a recovery policy.

Endpoints (every one requires ``Authorization: Bearer <token>``):

=====================  ===============================================================
``POST /heartbeat``    a :class:`~ms_health.record.HeartbeatRecord`; the reply may ask
                       for a stack dump: ``{"ok": true, "dump": <request id>}``
``POST /dump``         a :class:`~ms_health.record.StackDump` answering such a request
``POST /agent``        a node agent's :class:`~ms_health.record.AgentReport`; the reply
                       hands it the actions ordered for its node: ``{"actions": [...]}``
``GET /status``        job, ranks alive/stale/stopping, latest step, phases, open findings
``GET /ranks``         each rank's last heartbeat and its age on the driver's clock
``GET /events``        ``?since=<seq>&limit=<n>``: the event log after ``seq``
``GET /metrics``       Prometheus text: per-rank progress, counters, findings by kind
=====================  ===============================================================

Liveness is judged by the driver's own monotonic clock at receipt, never by the
senders' clocks. Detectors run under one lock: ``observe`` for each accepted heartbeat
on the request's thread, ``check`` on the tick thread. A condition a detector keeps
reporting is one open finding (keyed by detector, kind and ranks) until it stops being
reported; only its first report becomes an event and reaches ``on_finding``, which runs
on a thread of its own so that a slow recovery never delays detection.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ms_health import _host, _http, _metrics
from ms_health._agents import AgentBook, AgentView
from ms_health._dumps import DumpBook
from ms_health._events import EventLog, HealthEvent, RateLimiter
from ms_health._state import STATE_FORMAT, check_state, read_state, write_atomic
from ms_health.findings import KINDS, Detector, Finding
from ms_health.record import (
    AgentReport,
    HeartbeatRecord,
    RecordError,
    StackDump,
    parse_agent_report,
    parse_dump,
    parse_heartbeat,
)

__all__ = ["STATE_FORMAT", "Driver", "HealthEvent", "main"]

_log = logging.getLogger(__name__)

# Kernel thread names have 15 bytes: "ms-health-" leaves 5.
_KERNEL_ROLES = {"actions": "act"}

# Stacks kept in an event's evidence; the whole dump stays available from dumps().
_EVENT_STACK_CHARS = 16 * 1024


@attrs.define
class _Rank:
    record: HeartbeatRecord | None = None
    received_at: float | None = None
    heartbeats: int = 0


class Driver:
    """The health driver; see the module docstring.

    ``token``: the shared secret every request must present. ``world_size`` and
    ``job``: fixed when given; otherwise taken from the first heartbeat (a heartbeat of a
    later restart round may then change the world size). ``tick_s``: how often
    detectors are checked (None: no tick thread; call :meth:`tick`). ``observe_only``:
    findings are recorded as "would act" and ``on_finding`` is never called.
    ``state_path``: where :meth:`state_dict` is kept; an existing file is loaded here.
    ``state_every_s``: the tick writes a changed state at most this often (detectors
    learn at every heartbeat, and a synced write each time costs the training hosts'
    CPU), but at once after a new event (a finding, an order, an outcome: a restarted
    driver numbers its events from the saved sequence), and :meth:`stop` writes it
    last; a driver that is killed loses at most this much learning.
    ``events_path``: a JSON-lines file every event is appended to. ``on_finding``: the
    recovery policy, called with each new finding on the driver's action thread, one at
    a time, most urgent kind first. ``stale_after_s``: a rank silent longer than this
    counts as stale in ``/status`` (detection is the detectors' business).
    ``io_timeout_s``: how long a connection may stay silent, and a body take to arrive.
    ``max_connections``: connections served at once (more are closed at once).
    ``max_events``: events kept in memory. ``clock``: the driver's monotonic clock.
    """

    get_paths = frozenset({"/status", "/ranks", "/events", "/metrics"})
    post_paths = frozenset({"/heartbeat", "/dump", "/agent"})

    def __init__(
        self,
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        detectors: Iterable[Detector] = (),
        world_size: int | None = None,
        job: str | None = None,
        tick_s: float | None = 0.25,
        observe_only: bool = False,
        state_path: str | os.PathLike[str] | None = None,
        state_every_s: float = 5.0,
        events_path: str | os.PathLike[str] | None = None,
        on_finding: Callable[[Finding], None] | None = None,
        stale_after_s: float = 5.0,
        io_timeout_s: float = 10.0,
        max_connections: int = 1024,
        max_events: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(token, str) and token and token.isascii() and token.isprintable()):
            raise ValueError("token must be a non-empty string of printable ASCII")
        self._token = token.encode()
        self._detectors = list(detectors)
        names = set()
        for det in self._detectors:
            if not isinstance(det, Detector):
                raise TypeError(f"detectors must implement findings.Detector, got {det!r}")
            if det.name in names:
                raise ValueError(f"detector names must be unique, got {det.name!r} twice")
            names.add(det.name)
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ValueError(f"world_size must be an int >= 1 or None, got {world_size!r}")
        if job is not None and (not isinstance(job, str) or not job):
            raise ValueError(f"job must be a non-empty string or None, got {job!r}")
        for name, value in (
            ("tick_s", tick_s),
            ("stale_after_s", stale_after_s),
            ("io_timeout_s", io_timeout_s),
            ("state_every_s", state_every_s),
        ):
            if value is None and name == "tick_s":
                continue
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name, count in (("max_connections", max_connections), ("max_events", max_events)):
            if not _is_int(count) or count < 1:
                raise ValueError(f"{name} must be an int >= 1, got {count!r}")
        if on_finding is not None and not callable(on_finding):
            raise TypeError(f"on_finding must be callable, got {on_finding!r}")
        self.host, self.port = host, port
        self.tick_s = tick_s
        self.observe_only = observe_only
        self.on_finding = on_finding
        self.stale_after_s = float(stale_after_s)
        self.state_path = None if state_path is None else Path(state_path)
        self.state_every_s = float(state_every_s)
        self._io_timeout_s = float(io_timeout_s)
        self._max_connections = max_connections
        self._clock = clock

        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one writer of the state file at a time
        self._job = job
        self._world_size = world_size
        self._world_fixed = world_size is not None
        self._restart = 0  # the newest restart round seen
        self._ranks: dict[int, _Rank] = {}
        self._open: dict[tuple[str, str, tuple[int, ...]], Finding] = {}
        self._dumps = DumpBook()
        self._agents = AgentBook()
        self._heartbeats = 0
        self._rejected: dict[str, int] = {}
        self._findings_total: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._other_detector_states: dict[str, Any] = {}
        self._reject_limit = RateLimiter(every_s=10.0)
        self._error_limit = RateLimiter(every_s=60.0)
        self._started_at = clock()

        state = None if self.state_path is None else read_state(self.state_path)
        checked = None if state is None else check_state(state)
        seq = 0 if checked is None else checked.event_seq
        self._events = EventLog(events_path, capacity=max_events, seq=seq)
        if state is not None and checked is not None:
            self.load_state_dict(state)
            restored = sorted(d.name for d in self._detectors if d.name in checked.detectors)
            self._event(
                "restored",
                f"state restored from {self.state_path} (detectors: {', '.join(restored)})",
                evidence={"detectors": restored, "job": self._job, "event_seq": seq},
            )
        self._saved_state: str | None = None
        self._state_seen_at: float | None = None  # the clock when the tick last compared
        self._state_seen_events = -1  # the event sequence then

        self._server: _http.Server | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._actions: queue.Queue[Finding | None] = queue.Queue()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> Driver:
        """Bind, then serve and tick on background threads; returns self."""
        if self._server is not None:
            raise RuntimeError("this Driver was already started; make a new one")
        self._server = _http.Server(
            self.host,
            self.port,
            self,
            io_timeout_s=self._io_timeout_s,
            max_connections=self._max_connections,
        )
        self.port = self._server.server_port
        targets: list[tuple[str, Callable[[], None]]] = [
            ("serve", self._serve),
            ("actions", self._act_loop),
        ]
        if self.tick_s is not None:
            targets.append(("tick", self._tick_loop))
        for name, target in targets:
            thread = threading.Thread(
                target=_host.named(_KERNEL_ROLES.get(name, name), target),
                name=f"ms-health-driver-{name}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        self._event(
            "start",
            f"driver listening on {self.url}",
            evidence={
                "observe_only": self.observe_only,
                "detectors": [d.name for d in self._detectors],
            },
        )
        return self

    def _serve(self) -> None:
        assert self._server is not None
        self._server.serve_forever()  # sleeps between connections; stop() wakes it

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and ticking, save the state, close the events file. Open
        connections are cut so that senders reconnect to the next driver."""
        if self._server is None or self._stop.is_set():
            return
        self._stop.set()
        self._actions.put(None)
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._event("stop", "driver stopped")
        self.save_state()
        self._events.close()

    def __enter__(self) -> Driver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://host:port`` (the bound port once started)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def job(self) -> str | None:
        return self._job

    @property
    def world_size(self) -> int | None:
        return self._world_size

    # ------------------------------------------------------------------ detection

    def tick(self, now: float | None = None) -> list[Finding]:
        """Check every detector as of ``now`` (default: the clock); return the findings
        that are new, most urgent kind first. The tick thread calls this every
        ``tick_s``; call it yourself when ``tick_s`` is None."""
        now = self._clock() if now is None else now
        with self._lock:
            current: dict[tuple[str, str, tuple[int, ...]], Finding] = {}
            for det in self._detectors:
                try:
                    found = det.check(now)
                    for f in found:
                        if not isinstance(f, Finding):
                            raise TypeError(f"check() returned {type(f).__name__}, not Finding")
                        current.setdefault((f.detector, f.kind, tuple(f.ranks)), f)
                except Exception as e:
                    self._detector_error(det, "check", e, now)
            new = [f for key, f in current.items() if key not in self._open]
            new.sort(key=lambda f: KINDS.index(f.kind) if f.kind in KINDS else len(KINDS))
            for key, f in self._open.items():
                if key not in current:
                    self._event(
                        "cleared",
                        f"{f.detector}: {f.kind} no longer reported",
                        ranks=f.ranks,
                        evidence={"finding": f.to_json()},
                        at=now,
                    )
            self._open = current
            for f in new:
                if f.kind in self._findings_total:
                    self._findings_total[f.kind] += 1
                if self.observe_only:
                    action, level = "would act (observe-only)", logging.WARNING
                elif self.on_finding is not None:
                    action, level = "on_finding", logging.WARNING
                else:
                    action, level = "none (no on_finding)", logging.WARNING
                prefix = "would act: " if self.observe_only else ""
                self._event(
                    "finding",
                    f"{prefix}{f.detector}: {f.kind}: {f.message}",
                    ranks=f.ranks,
                    evidence={"finding": f.to_json(), "action": action},
                    at=now,
                    level=level,
                )
        if not self.observe_only and self.on_finding is not None:
            for f in new:
                self._actions.put(f)
        self._save_if_changed(now, force=bool(new))
        return new

    def open_findings(self) -> list[Finding]:
        """The findings reported at the last tick."""
        with self._lock:
            return list(self._open.values())

    def _tick_loop(self) -> None:
        assert self.tick_s is not None
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # never seen; the tick thread must survive it
                _log.exception("ms-health: driver tick failed")

    def _act_loop(self) -> None:
        while True:
            finding = self._actions.get()
            if finding is None or self.on_finding is None:
                return
            try:
                self.on_finding(finding)
            except Exception as e:
                _log.exception("ms-health: on_finding raised")
                self._event(
                    "action_error",
                    f"on_finding raised {type(e).__name__}: {e}",
                    ranks=finding.ranks,
                    evidence={"finding": finding.to_json()},
                    level=logging.ERROR,
                )

    def _detector_error(self, det: Detector, method: str, e: Exception, now: float) -> None:
        held = self._error_limit.allow(f"{det.name}.{method}", now)
        if held is not None:
            self._event(
                "detector_error",
                f"{det.name}.{method}() raised {type(e).__name__}: {e}",
                evidence={"detector": det.name, "method": method, "suppressed": held},
                at=now,
                level=logging.ERROR,
            )

    # ------------------------------------------------------------------ stack dumps

    def request_dumps(self, ranks: Iterable[int]) -> int:
        """Ask ``ranks`` for their stacks; each one's next heartbeat reply carries the
        request. Returns the request id for :meth:`dumps` and :meth:`wait_dumps`."""
        request, asked = self._dumps.open(ranks, self._clock())
        self._event(
            "dump_request",
            f"stack dump {request} requested",
            ranks=asked,
            evidence={"request": request},
        )
        return request

    def dumps(self, request: int) -> dict[int, StackDump]:
        """The dumps that answered ``request`` so far, by rank."""
        return self._dumps.answers(request)

    def wait_dumps(self, request: int, timeout_s: float) -> dict[int, StackDump]:
        """Wait until every rank asked has answered ``request`` or ``timeout_s`` passed;
        the dumps that came. A rank missing from it did not answer in time."""
        return self._dumps.wait(request, timeout_s)

    # ------------------------------------------------------------------ HTTP app

    def check_token(self, presented: bytes) -> bool:
        return hmac.compare_digest(self._token, presented)

    def rejected(self, reason: str, client: str, detail: str) -> None:
        with self._lock:
            self._rejected[reason] = self._rejected.get(reason, 0) + 1
        # A flood of bad requests makes one event per reason per 10 s, not one each.
        held = self._reject_limit.allow(reason, self._clock())
        if held is not None:
            note = f" ({held} more since the last such event)" if held else ""
            self._event(
                "rejected",
                f"{reason} from {client}: {detail}{note}",
                evidence={
                    "reason": reason,
                    "client": client,
                    "detail": detail[:300],
                    "suppressed": held,
                },
                level=logging.WARNING,
            )

    def get(self, path: str, query: dict[str, list[str]]) -> _http.Response:
        if path == "/status":
            return _http.json_response(200, self.status())
        if path == "/ranks":
            return _http.json_response(200, {"ranks": self.ranks()})
        if path == "/metrics":
            return 200, self.metrics().encode(), _metrics.CONTENT_TYPE
        try:
            since = int(query.get("since", ["0"])[0])
            limit = int(query.get("limit", ["1000"])[0])
        except ValueError:
            return _http.json_response(400, {"error": "since and limit must be integers"})
        events, dropped = self._events.since(since, max(1, min(limit, 10_000)))
        return _http.json_response(
            200,
            {
                "events": [e.to_json() for e in events],
                "last": self._events.seq,
                "dropped": dropped,
            },
        )

    def post(self, path: str, body: bytes, client: str) -> _http.Response:
        if self._stop.is_set():
            return _http.json_response(503, {"error": "the driver is stopping"})
        try:
            if path == "/heartbeat":
                record = parse_heartbeat(body)
            elif path == "/agent":
                report = parse_agent_report(body)
            else:
                dump = parse_dump(body)
        except RecordError as e:
            self.rejected("bad_record", client, str(e))
            return _http.json_response(400, {"error": str(e)})
        if path == "/heartbeat":
            return self._take_heartbeat(record, client)
        if path == "/agent":
            return self._take_agent_report(report, client)
        return self._take_dump(dump, client)

    def _take_agent_report(self, report: AgentReport, client: str) -> _http.Response:
        if self._job is not None and report.job != self._job:
            conflict = f"agent.job must be {self._job!r}, got {report.job!r}"
            self.rejected("conflict", client, conflict)
            return _http.json_response(409, {"error": conflict})
        known = report.node in self._agents.agents()
        actions = self._agents.report(report, self._clock())
        if not known:
            self._event(
                "agent",
                f"node agent {report.node} (pid {report.pid} on {report.host}) reports "
                f"{len(report.workers)} worker(s)",
                ranks=tuple(sorted(report.workers)),
                evidence={"node": report.node, "host": report.host, "pid": report.pid},
            )
        for result in report.results:
            self._event(
                "action_result",
                f"node {report.node}: action {result.get('id')} "
                f"({result.get('kind', '?')}): {result.get('summary', 'done')}",
                ranks=tuple(r for r in [result.get("rank")] if isinstance(r, int)),
                evidence={"node": report.node, "result": dict(result)},
            )
        return _http.json_response(200, {"ok": True, "actions": actions})

    # ------------------------------------------------------------------ acting

    def agents(self) -> dict[str, AgentView]:
        """The node agents by node, as last reported."""
        return self._agents.agents()

    def now(self) -> float:
        """The driver's clock (findings' ``at`` and events' ``at`` are on it)."""
        return self._clock()

    def node_of(self, pid: int) -> str | None:
        """The node whose agent runs worker ``pid``, or last reported it (a worker that
        died since), or None."""
        return self._agents.node_of(pid)

    def order(self, node: str, kind: str, **params: Any) -> int:
        """Hand action ``kind`` (``escalate``, ``diagnose``) to ``node``'s agent at its
        next report; the action id for :meth:`wait_result`."""
        action_id = self._agents.order(node, kind, **params)
        self._event(
            "order",
            f"action {action_id} ({kind}) ordered on node {node}",
            ranks=tuple(r for r in [params.get("rank")] if isinstance(r, int)),
            evidence={"node": node, "kind": kind, "id": action_id, **params},
        )
        return action_id

    def wait_result(self, action_id: int, timeout_s: float) -> dict[str, Any] | None:
        """The outcome an agent reported for ``action_id``, or None after ``timeout_s``."""
        return self._agents.wait(action_id, timeout_s)

    def last_records(self) -> dict[int, HeartbeatRecord]:
        """Each rank's last heartbeat."""
        with self._lock:
            return {r: v.record for r, v in self._ranks.items() if v.record is not None}

    def heard_since(self) -> dict[int, float]:
        """Each rank's last heartbeat time on the driver's clock."""
        with self._lock:
            return {r: v.received_at for r, v in self._ranks.items() if v.received_at is not None}

    def record_event(
        self,
        kind: str,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        evidence: Mapping[str, Any] | None = None,
        level: int = logging.INFO,
    ) -> HealthEvent:
        """Add a decision to the event log (what a recovery policy does, and why)."""
        return self._event(kind, message, ranks=ranks, evidence=evidence, level=level)

    def reset_detectors(self, ranks: tuple[int, ...] | None = None) -> None:
        """Forget the live state of ``ranks`` (all when None) in every detector, keeping
        what they learned: after the policy restarted them."""
        with self._lock:
            for det in self._detectors:
                det.reset(ranks)
            self._open.clear()

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    def _take_heartbeat(self, record: HeartbeatRecord, client: str) -> _http.Response:
        with self._lock:
            conflict = self._admit(record)
            if conflict is None:
                now = self._clock()
                rank = self._ranks.setdefault(record.rank, _Rank())
                rank.record, rank.received_at = record, now
                rank.heartbeats += 1
                self._heartbeats += 1
                self._restart = max(self._restart, record.restart)
                for det in self._detectors:
                    try:
                        det.observe(record, now)
                    except Exception as e:
                        self._detector_error(det, "observe", e, now)
                fresh = sum(
                    1
                    for r in self._ranks.values()
                    if r.received_at is not None and now - r.received_at <= self.stale_after_s
                )
                # The job as the driver sees it, for the loop's progress line.
                reply: dict[str, Any] = {
                    "ok": True,
                    "job": {
                        "heard": fresh,
                        "world": self._world_size,
                        "open": sorted({f.kind for f in self._open.values()}),
                    },
                }
                pending = self._dumps.pending(record.rank)
                if pending is not None:
                    reply["dump"] = pending
        if conflict is not None:
            self.rejected("conflict", client, conflict)
            return _http.json_response(409, {"error": conflict})
        return _http.json_response(200, reply)

    def _admit(self, record: HeartbeatRecord) -> str | None:
        """Why ``record`` does not belong to this job (None if it does); adopts the job
        and world size from the first heartbeat where they were not given."""
        if self._job is None:
            self._job = record.job
            self._event(
                "job",
                f"job {record.job!r} taken from rank {record.rank}'s heartbeat",
                ranks=(record.rank,),
            )
        elif record.job != self._job:
            return f"heartbeat.job must be {self._job!r}, got {record.job!r}"
        if self._world_size is None:
            self._world_size = record.world_size
        elif record.world_size != self._world_size:
            if self._world_fixed or record.restart <= self._restart:
                return (
                    f"heartbeat.world_size must be {self._world_size} (rank < "
                    f"{self._world_size}), got {record.world_size} from rank {record.rank}"
                )
            # An elastic restart may run with fewer or more ranks than the last round.
            old, self._world_size = self._world_size, record.world_size
            for r in [r for r in self._ranks if r >= record.world_size]:
                del self._ranks[r]
            self._event(
                "world_size",
                f"world size {old} -> {record.world_size} in restart round {record.restart}",
                evidence={"old": old, "new": record.world_size},
            )
        return None

    def _take_dump(self, dump: StackDump, client: str) -> _http.Response:
        if dump.job != self._job:
            conflict: str | None = f"dump.job must be {self._job!r}, got {dump.job!r}"
        else:
            conflict = self._dumps.answer(dump)
        if conflict is not None:
            self.rejected("conflict", client, conflict)
            return _http.json_response(409, {"error": conflict})
        stacks = dump.stacks
        if len(stacks) > _EVENT_STACK_CHARS:
            stacks = stacks[:_EVENT_STACK_CHARS] + "\n[truncated; Driver.dumps() has all]"
        self._event(
            "dump",
            f"rank {dump.rank} answered stack dump {dump.request}",
            ranks=(dump.rank,),
            evidence={
                "request": dump.request,
                "pid": dump.pid,
                "step": dump.step,
                "last_op": dump.last_op,
                "stacks": stacks,
            },
        )
        return _http.json_response(200, {"ok": True})

    # ------------------------------------------------------------------ views

    def status(self) -> dict[str, Any]:
        """What ``GET /status`` serves."""
        now = self._clock()
        with self._lock:
            alive = stale = stopping = 0
            phases: dict[str, int] = {}
            steps = []
            for rank in self._ranks.values():
                rec = rank.record
                if rec is None or rank.received_at is None:
                    continue
                if rec.status == "stopping":
                    stopping += 1
                elif now - rank.received_at > self.stale_after_s:
                    stale += 1
                else:
                    alive += 1
                    phases[rec.phase] = phases.get(rec.phase, 0) + 1
                if rec.step is not None:
                    steps.append(rec.step)
            heard = {r for r, s in self._ranks.items() if s.record is not None}
            expected = set(range(self._world_size or 0)) | set(self._ranks)
            return {
                "job": self._job,
                "world_size": self._world_size,
                "restart": self._restart,
                "observe_only": self.observe_only,
                "uptime_s": now - self._started_at,
                "ranks": {
                    "known": len(expected),
                    "alive": alive,
                    "stale": stale,
                    "stopping": stopping,
                    "never_heard": sorted(expected - heard),
                },
                "latest_step": max(steps) if steps else None,
                "slowest_step": min(steps) if steps else None,
                "phases": phases,
                "findings_open": [f.to_json() for f in self._open.values()],
                "heartbeats": self._heartbeats,
                "events": self._events.seq,
            }

    def ranks(self) -> list[dict[str, Any]]:
        """What ``GET /ranks`` serves: each rank's last heartbeat and its age."""
        now = self._clock()
        with self._lock:
            return [
                {
                    "rank": r,
                    "age_s": None if s.received_at is None else now - s.received_at,
                    "heartbeats": s.heartbeats,
                    "record": None if s.record is None else s.record.to_json(),
                }
                for r, s in sorted(self._ranks.items())
            ]

    def events(self, since: int = 0, limit: int = 10_000) -> list[HealthEvent]:
        """Events numbered after ``since`` still in memory, oldest first."""
        return self._events.since(since, limit)[0]

    def metrics(self) -> str:
        """What ``GET /metrics`` serves (Prometheus text format)."""
        now = self._clock()
        with self._lock:
            rows = [
                _metrics.RankRow(r, s.record, now - s.received_at, s.heartbeats)
                for r, s in sorted(self._ranks.items())
                if s.record is not None and s.received_at is not None
            ]
            return _metrics.render(
                self._job or "",
                rows,
                heartbeats=self._heartbeats,
                rejected=self._rejected,
                findings_total=self._findings_total,
                findings_open=len(self._open),
            )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Detectors' learned states by name, the event sequence, the job, its world
        size and the ranks known, with a format version; JSON-serialisable."""
        with self._lock:
            detectors = dict(self._other_detector_states)
            for det in self._detectors:
                detectors[det.name] = det.state_dict()
            return {
                "format": STATE_FORMAT,
                "job": self._job,
                "world_size": self._world_size,
                "restart": self._restart,
                "event_seq": self._events.seq,
                "ranks": sorted(self._ranks),
                "detectors": detectors,
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output. A state of another job is refused;
        the states of detectors this driver does not run are kept and saved again."""
        checked = check_state(state)
        job = checked.job
        if self._job is not None and job is not None and job != self._job:
            raise ValueError(f"state.job is {job!r}, but this driver's job is {self._job!r}")
        with self._lock:
            for det in self._detectors:
                if det.name in checked.detectors:
                    try:
                        det.load_state_dict(checked.detectors[det.name])
                    except ValueError as e:
                        raise ValueError(f"state.detectors.{det.name}: {e}") from e
            mine = {d.name for d in self._detectors}
            self._other_detector_states = {
                k: v for k, v in checked.detectors.items() if k not in mine
            }
            if self._job is None:
                self._job = job
            if not self._world_fixed and checked.world_size is not None:
                self._world_size = checked.world_size
            self._restart = max(self._restart, checked.restart)
            for r in checked.ranks:
                self._ranks.setdefault(r, _Rank())

    def save_state(self) -> None:
        """Write :meth:`state_dict` to ``state_path`` atomically (no-op without one)."""
        if self.state_path is None:
            return
        text = json.dumps(self.state_dict(), sort_keys=True, allow_nan=False)
        self._write_state(text)

    def _save_if_changed(self, now: float, *, force: bool = False) -> None:
        if self.state_path is None:
            return
        seen = self._state_seen_at
        # A new event is due at once: a restarted driver numbers its events from the
        # saved sequence, and must not reuse numbers already in the events file.
        events = self._events.seq
        due = force or events != self._state_seen_events
        if not due and seen is not None and 0 <= now - seen < self.state_every_s:
            return  # not due: not even serialised
        self._state_seen_at, self._state_seen_events = now, events
        try:
            text = json.dumps(self.state_dict(), sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as e:
            if self._error_limit.allow("state", self._clock()) is not None:
                self._event("state_error", f"state is not JSON: {e}", level=logging.ERROR)
            return
        if text != self._saved_state:
            self._write_state(text)

    def _write_state(self, text: str) -> None:
        assert self.state_path is not None
        try:
            with self._save_lock:
                write_atomic(self.state_path, text)
                self._saved_state = text
        except OSError as e:
            if self._error_limit.allow("state", self._clock()) is not None:
                self._event(
                    "state_error", f"cannot write {self.state_path}: {e}", level=logging.ERROR
                )

    # ------------------------------------------------------------------ events

    def _event(
        self,
        kind: str,
        message: str,
        *,
        ranks: tuple[int, ...] = (),
        evidence: Mapping[str, Any] | None = None,
        at: float | None = None,
        level: int = logging.INFO,
    ) -> HealthEvent:
        return self._events.add(
            kind,
            message,
            at=self._clock() if at is None else at,
            ranks=ranks,
            evidence=evidence,
            level=level,
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def main(argv: list[str] | None = None, prog: str = "python -m ms_health.driver") -> int:
    """The driver's command line (``ms-health driver``); see :mod:`ms_health._driver_cli`."""
    from ms_health._driver_cli import run

    return run(argv, prog)


if __name__ == "__main__":
    raise SystemExit(main())
