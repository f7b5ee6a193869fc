"""What a training process tells the driver: heartbeats and stack dumps, as JSON.

The sender (:mod:`ms_health.executor`) builds these records; the driver parses every
body it receives with :func:`parse_heartbeat` / :func:`parse_dump`, which refuse
anything malformed, oversized or of the wrong type with :class:`RecordError`, naming
the field. The wire format is plain JSON objects, one per HTTP request; a loss that is
not finite travels as the string ``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has no
literal for them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = [
    "FORMAT",
    "MAX_BODY_BYTES",
    "MAX_LOG_LINES",
    "MAX_LOG_LINE_CHARS",
    "MAX_LOSSES",
    "PHASES",
    "STATUSES",
    "AgentReport",
    "HeartbeatRecord",
    "RecordError",
    "StackDump",
    "parse_agent_report",
    "parse_dump",
    "parse_heartbeat",
]

#: Version of the wire format; a record of another version is refused.
FORMAT = 1
#: The largest request body the driver reads (a stack dump of every thread fits).
MAX_BODY_BYTES = 256 * 1024
#: Recent warning/error log lines a heartbeat carries, and how long each may be.
MAX_LOG_LINES = 20
MAX_LOG_LINE_CHARS = 500
#: Losses of the steps since the previous heartbeat that one heartbeat carries (the
#: newest; a sender beating every second keeps all of them up to 256 steps/s); the
#: driver reads the newest this many of a longer list.
MAX_LOSSES = 256
#: Phases a training loop reports; detectors keep a timeout per phase.
PHASES = ("init", "train", "checkpoint", "eval", "shutdown")
#: ``running``: the loop reports; ``stopping``: it is ending on purpose (a signal, the
#: last step), so silence after it is not a crash.
STATUSES = ("running", "stopping")

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class RecordError(ValueError):
    """A body the driver cannot accept; the message names the field."""


@attrs.frozen
class HeartbeatRecord:
    """One heartbeat of one rank.

    Times are the sender's wall clock (``time.time()``); the driver judges liveness
    by its own receipt times, so clocks of different hosts need not agree.
    """

    job: str
    rank: int
    world_size: int
    local_rank: int
    #: The node (an elastic agent's machine) this rank runs on: ``host`` is not
    #: enough where several agents share a host, as in tests.
    node: str
    host: str
    pid: int
    seq: int  # counts this process's heartbeats from 0
    sent_at: float
    status: str
    phase: str
    #: Optimizer steps completed by this process's loop (None before the first).
    step: int | None = None
    loss: float | None = None
    #: The first step since the previous heartbeat whose loss was NaN or inf (the loop
    #: reports every step's loss; ``loss`` is only the newest), or None.
    nonfinite_step: int | None = None
    #: ``(step, loss)`` of every step since the previous heartbeat, oldest first (at
    #: most :data:`MAX_LOSSES`, the newest): ranks beat at different steps, so the
    #: driver needs them all to see each step's loss over the whole job.
    losses: tuple[tuple[int, float], ...] = ()
    tokens_per_s: float | None = None
    #: Wall seconds of the last step, and when it ended (sender clock).
    step_time_s: float | None = None
    step_at: float | None = None
    #: Of ``step_time_s``, the seconds this rank spent waiting on collectives (from
    #: ``wait_begin``/``wait_end`` events). In synchronous training every rank's step
    #: takes as long as the slowest one's; the busy part, step minus wait, is what
    #: tells a straggler from the peers that wait for it.
    wait_s: float | None = None
    #: CPU seconds the loop's thread ran during the last step (``time.thread_time``). A
    #: rank whose cores another process shares takes longer per step without using
    #: more CPU; a slower processor uses more.
    step_cpu_s: float | None = None
    #: The last operation the loop entered: ``{"name", "kind", "t", ...}`` from an
    #: ``on_event`` callback (ms-parallel's collective events), or None.
    last_op: Mapping[str, Any] | None = None
    #: Mesh coordinates, e.g. ``{"dp": 1, "tp": 0}``.
    mesh: Mapping[str, int] = attrs.field(factory=dict)
    #: CPU/GPU model and memory, sent once per process and then on every heartbeat.
    hardware: Mapping[str, Any] = attrs.field(factory=dict)
    #: Recent warning and error log lines, filtered by keyword.
    logs: tuple[str, ...] = ()
    #: The restart round this process belongs to (``TORCHELASTIC_RESTART_COUNT``).
    restart: int = 0

    def to_json(self) -> dict[str, Any]:
        body = attrs.asdict(self, recurse=False)
        body["loss"] = _encode_float(self.loss)
        body["losses"] = [[step, _encode_float(loss)] for step, loss in self.losses]
        body["logs"] = list(self.logs)
        body["mesh"] = dict(self.mesh)
        body["hardware"] = dict(self.hardware)
        body["last_op"] = None if self.last_op is None else dict(self.last_op)
        body["format"] = FORMAT
        body["type"] = "heartbeat"
        return body


@attrs.frozen
class StackDump:
    """A rank's answer to the driver's request for its stacks."""

    job: str
    rank: int
    pid: int
    request: int  # the driver's request id it answers
    sent_at: float
    #: Every Python thread's stack, as ``faulthandler`` or ``traceback`` prints it.
    stacks: str
    last_op: Mapping[str, Any] | None = None
    step: int | None = None

    def to_json(self) -> dict[str, Any]:
        body = attrs.asdict(self, recurse=False)
        body["last_op"] = None if self.last_op is None else dict(self.last_op)
        body["format"] = FORMAT
        body["type"] = "dump"
        return body


def parse_heartbeat(body: bytes | str | Mapping[str, Any]) -> HeartbeatRecord:
    """The heartbeat in ``body``, validated; :class:`RecordError` names what is wrong."""
    obj = _object(body, "heartbeat")
    r = _Reader(obj, "heartbeat")
    record = HeartbeatRecord(
        job=r.text("job"),
        rank=r.integer("rank", low=0),
        world_size=r.integer("world_size", low=1),
        local_rank=r.integer("local_rank", low=0),
        node=r.text("node"),
        host=r.text("host"),
        pid=r.integer("pid", low=1),
        seq=r.integer("seq", low=0),
        sent_at=r.number("sent_at"),
        status=r.choice("status", STATUSES),
        phase=r.text("phase"),
        step=r.integer("step", low=0, optional=True),
        loss=r.loss("loss"),
        nonfinite_step=r.integer("nonfinite_step", low=0, optional=True),
        losses=r.step_losses("losses"),
        tokens_per_s=r.number("tokens_per_s", optional=True, low=0.0),
        step_time_s=r.number("step_time_s", optional=True, low=0.0),
        step_at=r.number("step_at", optional=True),
        wait_s=r.number("wait_s", optional=True, low=0.0),
        step_cpu_s=r.number("step_cpu_s", optional=True, low=0.0),
        last_op=r.mapping("last_op", optional=True),
        mesh=r.int_mapping("mesh"),
        hardware=r.mapping("hardware") or {},
        logs=r.lines("logs"),
        restart=r.integer("restart", low=0, default=0),
    )
    if record.rank >= record.world_size:
        raise RecordError(
            f"heartbeat.rank must be < world_size ({record.world_size}), got {record.rank}"
        )
    return record


def parse_dump(body: bytes | str | Mapping[str, Any]) -> StackDump:
    """The stack dump in ``body``, validated."""
    obj = _object(body, "dump")
    r = _Reader(obj, "dump")
    return StackDump(
        job=r.text("job"),
        rank=r.integer("rank", low=0),
        pid=r.integer("pid", low=1),
        request=r.integer("request", low=0),
        sent_at=r.number("sent_at"),
        stacks=r.text("stacks", limit=MAX_BODY_BYTES, empty=True),
        last_op=r.mapping("last_op", optional=True),
        step=r.integer("step", low=0, optional=True),
    )


# ---------------------------------------------------------------------------- parsing


def _encode_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _object(body: bytes | str | Mapping[str, Any], what: str) -> Mapping[str, Any]:
    if isinstance(body, Mapping):
        obj: Any = body
    else:
        size = len(body.encode() if isinstance(body, str) else body)
        if size > MAX_BODY_BYTES:
            raise RecordError(f"{what} body is {size} bytes, more than {MAX_BODY_BYTES}")
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise RecordError(f"{what} body is not JSON: {e}") from e
    if not isinstance(obj, Mapping):
        raise RecordError(f"{what} body must be a JSON object, got {type(obj).__name__}")
    fmt = obj.get("format")
    if fmt != FORMAT:
        raise RecordError(f"{what}.format must be {FORMAT}, got {fmt!r}")
    kind = obj.get("type")
    if kind != what:
        raise RecordError(f"{what}.type must be {what!r}, got {kind!r}")
    return obj


class _Reader:
    """Typed field access on a decoded object, each error naming ``<what>.<field>``."""

    def __init__(self, obj: Mapping[str, Any], what: str) -> None:
        self.obj, self.what = obj, what

    def _get(self, name: str, optional: bool) -> Any:
        if name not in self.obj:
            if optional:
                return None
            raise RecordError(f"{self.what}.{name} is missing")
        return self.obj[name]

    def _bad(self, name: str, expected: str, value: Any) -> RecordError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return RecordError(f"{self.what}.{name} must be {expected}, got {shown}")

    def text(self, name: str, *, limit: int = 256, empty: bool = False) -> str:
        v = self._get(name, False)
        if not isinstance(v, str) or (not v and not empty) or len(v) > limit:
            raise self._bad(name, f"a {'' if empty else 'non-empty '}string of <= {limit} chars", v)
        return v

    def integer(
        self, name: str, *, low: int, optional: bool = False, default: int | None = None
    ) -> Any:
        v = self._get(name, optional or default is not None)
        if v is None and (optional or default is not None):
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise self._bad(name, f"an int >= {low}", v)
        return v

    def number(self, name: str, *, optional: bool = False, low: float | None = None) -> Any:
        v = self._get(name, optional)
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self._bad(name, "a finite number", v)
        if low is not None and v < low:
            raise self._bad(name, f"a number >= {low}", v)
        return float(v)

    def loss(self, name: str) -> float | None:
        v = self._get(name, True)
        if v is None:
            return None
        if isinstance(v, str) and v in _NONFINITE:
            return _NONFINITE[v]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._bad(name, 'a number, "nan", "inf" or "-inf"', v)
        return float(v)

    def step_losses(self, name: str) -> tuple[tuple[int, float], ...]:
        v = self._get(name, True)
        if v is None:
            return ()
        if not isinstance(v, list):
            raise self._bad(name, "a list of [step, loss] pairs", v)
        out = []
        # A sender that keeps more is read for its newest (the body's size is bounded).
        skipped = max(0, len(v) - MAX_LOSSES)
        for i, pair in enumerate(v[skipped:], start=skipped):
            ok = isinstance(pair, list) and len(pair) == 2
            step, loss = pair if ok else (None, None)
            if not ok or isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise self._bad(f"{name}[{i}]", "a [step, loss] pair with an int step >= 0", pair)
            value = _Reader({"loss": loss}, f"{self.what}.{name}[{i}]").loss("loss")
            if value is None:
                raise self._bad(f"{name}[{i}]", "a [step, loss] pair with a loss", pair)
            out.append((step, value))
        return tuple(out)

    def choice(self, name: str, choices: tuple[str, ...]) -> str:
        v = self._get(name, False)
        if v not in choices:
            raise self._bad(name, f"one of {choices}", v)
        return str(v)

    def mapping(self, name: str, *, optional: bool = True) -> dict[str, Any] | None:
        v = self._get(name, optional)
        if v is None:
            return None
        if not isinstance(v, Mapping) or len(v) > 64:
            raise self._bad(name, "a JSON object of <= 64 entries", v)
        return dict(v)

    def int_mapping(self, name: str) -> dict[str, int]:
        v = self.mapping(name) or {}
        for key, coord in v.items():
            if isinstance(coord, bool) or not isinstance(coord, int) or coord < 0:
                raise self._bad(f"{name}.{key}", "an int >= 0", coord)
        return v

    def lines(self, name: str) -> tuple[str, ...]:
        v = self._get(name, True)
        if v is None:
            return ()
        if not isinstance(v, list) or len(v) > MAX_LOG_LINES:
            raise self._bad(name, f"a list of <= {MAX_LOG_LINES} strings", v)
        for i, line in enumerate(v):
            if not isinstance(line, str) or len(line) > MAX_LOG_LINE_CHARS:
                raise self._bad(f"{name}[{i}]", f"a string of <= {MAX_LOG_LINE_CHARS} chars", line)
        return tuple(v)


# ---------------------------------------------------------------------- node agents


@attrs.frozen
class AgentReport:
    """A node agent's report: the workers it runs, and the outcomes of the actions the
    driver asked of it since its last report. The driver's reply carries new actions."""

    job: str
    node: str
    host: str
    pid: int
    sent_at: float
    #: The elastic restart round its workers run in.
    restart: int
    #: Global rank -> pid of this node's live workers.
    workers: Mapping[int, int] = attrs.field(factory=dict)
    #: ``{"id": <action id>, "ok": bool, ...}`` per finished action.
    results: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "type": "agent",
            "job": self.job,
            "node": self.node,
            "host": self.host,
            "pid": self.pid,
            "sent_at": self.sent_at,
            "restart": self.restart,
            "workers": {str(r): p for r, p in self.workers.items()},
            "results": [dict(r) for r in self.results],
        }


def parse_agent_report(body: bytes | str | Mapping[str, Any]) -> AgentReport:
    """The agent report in ``body``, validated."""
    obj = _object(body, "agent")
    r = _Reader(obj, "agent")
    workers_raw = r.mapping("workers") or {}
    workers: dict[int, int] = {}
    for key, pid in workers_raw.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise RecordError(f"agent.workers keys must be ranks (digit strings), got {key!r}")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
            raise RecordError(f"agent.workers[{key}] must be a pid (int >= 1), got {pid!r}")
        workers[int(key)] = pid
    results = obj.get("results", [])
    if not isinstance(results, list) or len(results) > 64:
        raise RecordError(f"agent.results must be a list of <= 64 objects, got {results!r:.80}")
    for i, res in enumerate(results):
        ok = isinstance(res, Mapping) and isinstance(res.get("id"), int)
        if not ok or isinstance(res.get("id"), bool):
            raise RecordError(
                f"agent.results[{i}] must be an object with an int id, got {res!r:.80}"
            )
    return AgentReport(
        job=r.text("job"),
        node=r.text("node"),
        host=r.text("host"),
        pid=r.integer("pid", low=1),
        sent_at=r.number("sent_at"),
        restart=r.integer("restart", low=0, default=0),
        workers=workers,
        results=tuple(dict(x) for x in results),
    )
