"""The heartbeat sender that runs inside each training process.

The training loop calls three cheap methods, none of which does I/O or raises:
:meth:`Heartbeat.step` after each optimizer step, :meth:`Heartbeat.phase` around
checkpoints and evaluation, and :meth:`Heartbeat.on_event`, an event hook with
ms-parallel's signature ``hook(name, kind, t, **attrs)``. They only update a few fields
under a lock. A daemon thread turns those fields into a
:class:`~ms_health.record.HeartbeatRecord` every ``interval_s`` (and at once after a
phase change) and posts it to the driver. That thread absorbs every failure: a driver
that is down, restarting or refusing is retried at the next interval, counted, and
logged once per outage.

A driver's reply may ask for a stack dump; the same thread answers with every
thread's Python stack. A process that is stopped, or a thread that holds the GIL,
cannot answer, and that silence is what tells the driver which rank hangs. So the
answer never comes from anywhere else (no signal handler, no second process).

This module does not import torch: a loss passed as a device tensor is converted on
the sender's thread (one in host memory at once, since that does not wait), and GPU
facts are read only if the process has imported torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import os
import re
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

from ms_health import _host
from ms_health._client import JsonClient, TransportError
from ms_health.record import (
    MAX_BODY_BYTES,
    MAX_LOG_LINE_CHARS,
    MAX_LOG_LINES,
    MAX_LOSSES,
    STATUSES,
    HeartbeatRecord,
    StackDump,
)

__all__ = ["DEFAULT_LOG_KEYWORDS", "Heartbeat", "sender_in_stacks"]

_log = logging.getLogger(__name__)

# The sender thread's function as faulthandler prints it (``File ".../ms_health/
# executor.py", line N in _sender_loop``): a process's stacks without it have no sender.
_SENDER_FRAME = re.compile(r'File "[^"]*ms_health[/\\]executor\.py", line \d+ in _sender_loop\b')


def sender_in_stacks(stacks: str) -> bool:
    """Whether a process's faulthandler stacks (``ms_health.escalate.request_dump``) hold a
    live heartbeat sender thread. A rank silent to the driver whose stacks come back
    without one lost its monitoring, not its training."""
    return _SENDER_FRAME.search(stacks) is not None


#: Substrings (case-insensitive) that make a WARNING+ log line worth sending.
DEFAULT_LOG_KEYWORDS: tuple[str, ...] = (
    "error",
    "exception",
    "traceback",
    "timeout",
    "timed out",
    "nccl",
    "gloo",
    "cuda",
    "out of memory",
    "oom",
    "nan",
    "inf",
    "fail",
    "abort",
    "killed",
    "signal",
    "hang",
    "deadlock",
    "straggl",
)

# Event kinds that are not the loop's own operations: the latency backend reports
# completions from its own thread, which would hide what the loop entered last.
_NOT_AN_OP = frozenset({"complete"})
_MAX_OP_ATTRS = 32
_MAX_OPEN_WAITS = 1024


class Heartbeat:
    """Sends this process's heartbeats to the driver at ``url``; see the module docstring.

    Rank, world size and local rank default to torchrun's ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` (0, 1, 0 without them), the node to ``<host>/<GROUP_RANK>`` (the
    host alone without ``GROUP_RANK``) and the restart round to
    ``TORCHELASTIC_RESTART_COUNT``, all read from ``environ`` (``os.environ`` by
    default). ``log_keywords`` selects the WARNING+ log lines that travel with the
    heartbeats (None: every one). ``timeout_s`` bounds each request to the driver.
    """

    def __init__(
        self,
        url: str,
        token: str,
        *,
        job: str,
        interval_s: float = 1.0,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        node: str | None = None,
        mesh: Mapping[str, int] | None = None,
        log_keywords: tuple[str, ...] | None = DEFAULT_LOG_KEYWORDS,
        restart: int | None = None,
        timeout_s: float = 2.0,
        join_timeout_s: float = 5.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        if not isinstance(token, str) or not token:
            raise ValueError("token must be a non-empty string")
        _check_text("job", job)
        for name, value in (
            ("interval_s", interval_s),
            ("timeout_s", timeout_s),
            ("join_timeout_s", join_timeout_s),
        ):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self.url = url
        self.job = job
        self.interval_s = float(interval_s)
        self.rank = _from_env(rank, "rank", env, "RANK", 0)
        self.world_size = _from_env(world_size, "world_size", env, "WORLD_SIZE", 1)
        self.local_rank = _from_env(local_rank, "local_rank", env, "LOCAL_RANK", 0)
        self.restart = _from_env(restart, "restart", env, "TORCHELASTIC_RESTART_COUNT", 0)
        if self.world_size < 1 or self.rank >= self.world_size:
            raise ValueError(
                f"rank must be in [0, world_size), got rank {self.rank}, "
                f"world_size {self.world_size}"
            )
        self.host = _host.host_name()
        if node is None:
            group = env.get("GROUP_RANK")
            node = f"{self.host}/{group}" if group else self.host
        _check_text("node", node)
        self.node = node
        self._mesh = _check_mesh(mesh or {})
        keywords: Any = log_keywords
        if keywords is not None and (
            isinstance(keywords, str) or not all(isinstance(k, str) for k in keywords)
        ):
            raise TypeError(
                f"log_keywords must be a tuple of strings or None, got {log_keywords!r}"
            )
        self._client = JsonClient(url, token, timeout_s=float(timeout_s))
        self._join_timeout_s = float(join_timeout_s)
        self._tap = _LogTap(None if log_keywords is None else tuple(log_keywords))

        # What the loop reports, guarded by _lock; the sender only copies it.
        self._lock = threading.Lock()
        self._phase = "init"
        self._step: Any = None
        self._loss: Any = None
        #: The driver's last view of the job (``{"heard", "world", "open"}``), from the
        #: reply to a heartbeat; empty before the first.
        self.job_view: dict[str, Any] = {}
        # (step, loss) of every step since the last heartbeat (bounded), converted on
        # the sender's thread: a NaN is reported with the step it first appeared at,
        # not the step the next heartbeat happens to carry, and the driver sees every
        # step's loss of every rank.
        self._losses: deque[tuple[Any, Any]] = deque(maxlen=1024)
        self._step_time: float | None = None
        self._step_t: float | None = None  # perf_counter at the last step()
        self._clock_t: float | None = None  # start of the step now running
        # (thread, its CPU clock) at the start of the step now running
        self._cpu_t: tuple[int, float] | None = None
        self._step_cpu: float | None = None
        self._window_tokens = 0.0
        self._window_s = 0.0
        self._tokens_per_s: float | None = None
        self._last_op: tuple[Any, Any, Any, dict[str, Any]] | None = None
        self._saw_events = False
        self._open_waits: dict[Any, int] = {}
        self._wait_depth = 0
        self._wait_t0 = 0.0
        self._wait_now = 0.0  # wait seconds of the step now running
        self._wait_last: float | None = None

        # The sender's own state.
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        # Set by every step() with a loss: the sender looks at it at once, and sends
        # early when it is not finite (the rank that saw a NaN first must be heard
        # first: its peers go NaN one step later, through the gradients).
        self._new_loss = threading.Event()
        self._stopping = threading.Event()
        self._final_status = "stopping"
        self._seq = 0
        self._hardware: dict[str, Any] | None = None
        self._gpu_known = False
        self._log_sent = 0  # the tap's count of the last log line delivered
        self._trouble = False  # an outage is going on (and was logged)
        # What this sender costs the process (see cost()).
        self._api_s = 0.0
        self._api_calls = 0
        self._sender_cpu_s = 0.0
        self.sent = 0
        self.failures = 0
        self.rejected = 0
        self.dumps_answered = 0

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> Heartbeat | None:
        """A sender configured by ``MS_HEALTH_URL``, ``MS_HEALTH_TOKEN`` (or
        ``MS_HEALTH_TOKEN_FILE``) and ``MS_HEALTH_JOB`` (default: torchrun's
        ``TORCHELASTIC_RUN_ID``); None when ``MS_HEALTH_URL`` is unset or empty.
        ``kwargs`` go to the constructor."""
        env = os.environ if environ is None else environ
        url = env.get("MS_HEALTH_URL", "")
        if not url:
            return None
        token = env.get("MS_HEALTH_TOKEN", "")
        if not token and env.get("MS_HEALTH_TOKEN_FILE"):
            path = env["MS_HEALTH_TOKEN_FILE"]
            try:
                with open(path) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ValueError(f"MS_HEALTH_TOKEN_FILE {path!r} cannot be read: {e}") from e
        if not token:
            raise ValueError(
                "MS_HEALTH_URL is set, so MS_HEALTH_TOKEN or MS_HEALTH_TOKEN_FILE must give "
                "a non-empty token; got none"
            )
        job = env.get("MS_HEALTH_JOB") or env.get("TORCHELASTIC_RUN_ID", "")
        if not job:
            raise ValueError(
                "MS_HEALTH_URL is set, so MS_HEALTH_JOB (or torchrun's TORCHELASTIC_RUN_ID) "
                "must name the job; got neither"
            )
        return cls(url, token, job=job, environ=env, **kwargs)

    # ------------------------------------------------------------------ the loop's API

    def step(self, step: int, loss: Any = None, tokens: float | None = None) -> None:
        """Step ``step`` just finished, with its ``loss`` and the ``tokens`` it trained.

        Its time runs from the previous call or the last phase change, whichever came
        later; the tokens/s a heartbeat carries are over the steps since the previous
        heartbeat. A loss in host memory (a number, a CPU tensor) is read here, and wakes
        the sender only when it is not finite; a loss on a device is read on the
        sender's thread, which each such step wakes, so that the loop never waits for
        the device.
        """
        t = time.perf_counter()
        cpu = (threading.get_ident(), time.thread_time())
        try:
            value = _host_value(loss)
            if value is not None:
                loss = value
            with self._lock:
                self._api_calls += 1
                self._step = step
                self._loss = loss
                if loss is not None:
                    self._losses.append((step, loss))
                self._step_t = t  # made wall-clock when sent: one clock read less here
                if self._saw_events:
                    self._wait_last = self._wait_now
                self._wait_now = 0.0
                start, self._clock_t = self._clock_t, t
                cpu_start, self._cpu_t = self._cpu_t, cpu
                if cpu_start is not None and cpu_start[0] == cpu[0]:
                    self._step_cpu = cpu[1] - cpu_start[1]
                if start is not None:
                    self._step_time = t - start
                    if tokens is not None:
                        self._window_tokens += tokens
                        self._window_s += t - start
                self._api_s += time.perf_counter() - t
            if loss is not None and (value is None or not math.isfinite(value)):
                self._new_loss.set()
        except Exception:  # a bad argument must not stop training
            pass

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Report phase ``name`` (``init``, ``train``, ``checkpoint``, ``eval``,
        ``shutdown`` or another name) while the block runs, then the previous one.
        Raises ValueError at once for a name the wire format cannot carry."""
        previous = self.set_phase(name)
        try:
            yield
        finally:
            self.set_phase(previous)

    def set_phase(self, name: str) -> str:
        """Switch to phase ``name`` and return the previous one (see :meth:`phase`)."""
        _check_text("phase", name)
        with self._lock:
            previous, self._phase = self._phase, name
            # A phase is not part of a step: the next step's clock starts here.
            self._clock_t = time.perf_counter()
            self._cpu_t = (threading.get_ident(), time.thread_time())
        if previous != name:
            self._wake.set()
            self._new_loss.set()  # ends the sender's pause
        return previous

    def on_event(self, name: str, kind: str, t: float, **attrs: Any) -> None:
        """ms-parallel's event hook: remember the last operation and sum the step's
        collective wait (``wait_begin`` to ``wait_end``, overlapping waits counted
        once; ``t`` on one clock per process)."""
        t0 = time.perf_counter()
        try:
            with self._lock:
                self._api_calls += 1
                self._saw_events = True
                if kind not in _NOT_AN_OP:
                    self._last_op = (name, kind, t, attrs)
                if kind == "wait_begin":
                    if len(self._open_waits) < _MAX_OPEN_WAITS:
                        self._open_waits[name] = self._open_waits.get(name, 0) + 1
                        if self._wait_depth == 0:
                            self._wait_t0 = t
                        self._wait_depth += 1
                elif kind == "wait_end":
                    open_ = self._open_waits.get(name, 0)
                    if open_:  # a wait that began before this sender saw events: skipped
                        if open_ == 1:
                            del self._open_waits[name]
                        else:
                            self._open_waits[name] = open_ - 1
                        self._wait_depth -= 1
                        if self._wait_depth == 0:
                            self._wait_now += t - self._wait_t0
                self._api_s += time.perf_counter() - t0
        except Exception:
            pass

    def set_mesh(self, mesh: Mapping[str, int]) -> None:
        """Mesh coordinates (``{"dp": 1, "tp": 0}``) for the following heartbeats."""
        checked = _check_mesh(mesh)
        with self._lock:
            self._mesh = checked

    def cost(self) -> dict[str, float]:
        """What heartbeats have cost this process so far: ``loop_s``, the seconds the
        calling threads spent in :meth:`step` and :meth:`on_event` (``loop_calls``
        calls), and ``sender_cpu_s``, the CPU seconds of the sender thread, which
        holds the GIL part of that time (an upper bound on what it takes from the loop).
        Take two and subtract for a window of training."""
        return {
            "loop_s": self._api_s,
            "loop_calls": float(self._api_calls),
            "sender_cpu_s": self._sender_cpu_s,
            "heartbeats": float(self.sent),
        }

    # ------------------------------------------------------------------ life cycle

    def summary(self) -> str:
        """The job as the driver last saw it, for a progress line: ``"4/4 ranks heard"``,
        with the kinds of open findings; ``"no driver"`` before a reply came."""
        view = self.job_view
        if not view:
            return "no driver"
        text = f"{view.get('heard', '?')}/{view.get('world', '?')} ranks heard"
        open_ = view.get("open") or []
        return text + (f", {'/'.join(map(str, open_))}" if open_ else "")

    def start(self) -> Heartbeat:
        """Start the sender thread and the log tap; returns self."""
        if self._thread is not None:
            raise RuntimeError("this Heartbeat was already started; make a new one")
        logging.getLogger().addHandler(self._tap)
        self._thread = threading.Thread(
            target=self._sender_loop, name=f"ms-health-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, status: str = "stopping") -> None:
        """Send a last heartbeat with ``status`` (``"stopping"``: silence after it is
        not a crash), then end the thread, waiting at most ``join_timeout_s``."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        logging.getLogger().removeHandler(self._tap)
        if self._thread is None or self._stopping.is_set():
            return
        self._final_status = status
        self._stopping.set()
        self._wake.set()
        self._new_loss.set()
        self._thread.join(self._join_timeout_s)

    @property
    def running(self) -> bool:
        """Whether the sender thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ sender thread

    def _sender_loop(self) -> None:  # named in SENDER_FRAME: keep them in step
        _host.name_thread("send")
        failed = False
        try:
            while True:
                # This heartbeat carries every loss so far: a wake for one is served.
                self._wake.clear()
                self._new_loss.clear()
                final = self._stopping.is_set()
                try:
                    self._send(self._final_status if final else "running")
                except Exception:  # never seen; one bad heartbeat must not end the thread
                    if not failed:
                        _log.exception("ms-health: building or sending a heartbeat failed")
                    failed = True
                    self.failures += 1
                self._sender_cpu_s = time.thread_time()  # this thread's CPU seconds
                if final:
                    return
                self._pause()
        finally:
            self._client.close()

    def _pause(self) -> None:
        """Wait for the next heartbeat: ``interval_s``, or less after a phase change, a
        stop, or a step whose loss is not finite."""
        deadline = time.monotonic() + self.interval_s
        while not self._wake.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._new_loss.wait(left):
                self._new_loss.clear()
                seen = self._saw_nonfinite()
                self._sender_cpu_s = time.thread_time()
                if seen:
                    return

    def _saw_nonfinite(self) -> bool:
        """Whether the newest loss is not finite (one conversion per wake: a model that
        went NaN stays NaN, and the heartbeat finds the first such step)."""
        with self._lock:
            newest = [self._losses[-1]] if self._losses else []
        return _first_nonfinite(newest) is not None

    def _send(self, status: str) -> None:
        record, last_log = self._record(status)
        try:
            code, reply = self._client.post("/heartbeat", record.to_json())
        except TransportError as e:
            self.failures += 1
            self._trouble_once(
                f"ms-health: cannot reach the driver at {self.url} ({e}); retrying every "
                f"{self.interval_s:g} s"
            )
            return
        if code != 200:
            self.rejected += 1
            self._trouble_once(
                f"ms-health: the driver at {self.url} refused a heartbeat with HTTP {code}: "
                f"{str(reply.get('error', ''))[:200]}; retrying every {self.interval_s:g} s"
            )
            return
        self.sent += 1
        self._log_sent = last_log
        view = reply.get("job")
        if isinstance(view, dict):
            self.job_view = view
        if self._trouble:
            _log.info(
                "ms-health: heartbeats reach the driver at %s again (%d failed so far)",
                self.url,
                self.failures + self.rejected,
            )
            self._trouble = False
        request = reply.get("dump")
        if isinstance(request, int) and not isinstance(request, bool) and request >= 0:
            self._answer_dump(request)

    def _trouble_once(self, message: str) -> None:
        # One warning per outage, however long it lasts and whatever its failures are.
        if not self._trouble:
            self._trouble = True
            _log.warning(message)

    def _record(self, status: str) -> tuple[HeartbeatRecord, int]:
        with self._lock:
            phase, step, loss = self._phase, self._step, self._loss
            losses = list(self._losses)
            self._losses.clear()
            step_time, step_t, wait = self._step_time, self._step_t, self._wait_last
            step_cpu = self._step_cpu
            last_op, mesh = self._last_op, self._mesh
            if self._window_s > 0:
                self._tokens_per_s = self._window_tokens / self._window_s
            self._window_tokens = self._window_s = 0.0
            tokens_per_s = self._tokens_per_s
        logs, last_log = self._tap.since(self._log_sent)
        losses = [(step, _as_float(loss)) for step, loss in losses]  # one sync each
        record = HeartbeatRecord(
            job=self.job,
            rank=self.rank,
            world_size=self.world_size,
            local_rank=self.local_rank,
            node=self.node,
            host=self.host,
            pid=os.getpid(),
            seq=self._seq,
            sent_at=time.time(),
            status=status,
            phase=phase,
            step=_as_step(step),
            loss=_as_float(loss),
            nonfinite_step=_first_nonfinite(losses),
            losses=_step_losses(losses),
            tokens_per_s=_as_rate(tokens_per_s),
            step_time_s=_as_rate(step_time),
            step_at=None if step_t is None else time.time() - (time.perf_counter() - step_t),
            wait_s=_as_rate(wait),
            step_cpu_s=_as_rate(step_cpu),
            last_op=_as_op(last_op),
            mesh=mesh,
            hardware=self._hardware_facts(),
            logs=logs,
            restart=self.restart,
        )
        self._seq += 1
        return record, last_log

    def _hardware_facts(self) -> dict[str, Any]:
        if self._hardware is None:
            self._hardware = _host.cpu_facts()
        if not self._gpu_known:
            gpu = _host.gpu_facts(self.local_rank)
            if gpu is not None:
                self._hardware.update(gpu)
                self._gpu_known = True
        return self._hardware

    def _answer_dump(self, request: int) -> None:
        with self._lock:
            last_op, step = self._last_op, self._step
        stacks = _host.thread_stacks()
        while True:
            body = StackDump(
                job=self.job,
                rank=self.rank,
                pid=os.getpid(),
                request=request,
                sent_at=time.time(),
                stacks=stacks,
                last_op=_as_op(last_op),
                step=_as_step(step),
            ).to_json()
            if len(json.dumps(body).encode()) <= MAX_BODY_BYTES - 1024:
                break
            stacks = stacks[: len(stacks) * 3 // 4] + "\n[stacks truncated to fit the body]\n"
        try:
            code, _ = self._client.post("/dump", body)
        except TransportError as e:
            _log.debug("ms-health: stack dump %d not delivered: %s", request, e)
            return
        if code == 200:
            self.dumps_answered += 1


class _LogTap(logging.Handler):
    """Keeps the latest WARNING+ lines that match a keyword, numbered, for heartbeats."""

    def __init__(self, keywords: tuple[str, ...] | None) -> None:
        super().__init__(logging.WARNING)
        self._keywords = None if keywords is None else tuple(k.lower() for k in keywords)
        self._lines: deque[tuple[int, str]] = deque(maxlen=MAX_LOG_LINES)
        self._count = 0

    def emit(self, record: logging.LogRecord) -> None:
        # Runs in whatever thread logs; it must never raise or print.
        try:
            if record.name == __name__:
                return  # the sender's own outage warnings
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                e = record.exc_info[1]
                text = f"{text} [{type(e).__name__}: {e}]"
            if self._keywords is not None:
                lowered = text.lower()
                if not any(k in lowered for k in self._keywords):
                    return
            line = f"{record.levelname} {record.name}: {text}"[:MAX_LOG_LINE_CHARS]
            self._count += 1
            self._lines.append((self._count, line))
        except Exception:
            pass

    def since(self, count: int) -> tuple[tuple[str, ...], int]:
        """Lines numbered after ``count`` (at most the latest MAX_LOG_LINES), and the
        number of the newest line."""
        with self.lock or contextlib.nullcontext():
            lines = tuple(line for n, line in self._lines if n > count)
            return lines, self._count


# ---------------------------------------------------------------------- sanitizing


def _check_text(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise ValueError(f"{name} must be a non-empty string of <= 256 chars, got {value!r}")


def _check_mesh(mesh: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(mesh, Mapping) or len(mesh) > 64:
        raise TypeError(f"mesh must be a mapping of <= 64 entries, got {mesh!r}")
    for key, coord in mesh.items():
        if not isinstance(key, str) or isinstance(coord, bool) or not isinstance(coord, int):
            raise TypeError(f"mesh must map str to int, got {key!r}: {coord!r}")
        if coord < 0:
            raise ValueError(f"mesh[{key!r}] must be >= 0, got {coord}")
    return dict(mesh)


def _from_env(value: int | None, name: str, env: Mapping[str, str], var: str, default: int) -> int:
    if value is None:
        raw = env.get(var)
        if raw is None or raw == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{var} must be an integer, got {raw!r}") from None
        name = var
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _as_step(step: Any) -> int | None:
    try:
        n = int(step)
    except (TypeError, ValueError, OverflowError):
        return None
    return n if n >= 0 else None


def _as_float(x: Any) -> float | None:
    if x is None:
        return None
    try:
        return float(x)  # a tensor syncs here, on this thread, not in the loop
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return None


def _host_value(x: Any) -> float | None:
    """``x`` as a float when reading it cannot wait on a device: a real number, or a
    one-element tensor in host memory. None for anything else (a device tensor, which
    the sender reads, or something that is not a number or cannot be read as one)."""
    try:
        if type(x) is float or type(x) is int:  # the common cases, before the ABC check
            return float(x)
        if getattr(getattr(x, "device", None), "type", None) == "cpu":
            # A CPU tensor is read at once, as any read of it would be (one copied with
            # non_blocking=True must be synchronised first). item(), not float(), reads
            # one that requires grad without autograd's warning.
            return float(x.item())
        if isinstance(x, numbers.Real):
            return float(x)
    except Exception:  # too large for a float, not one element, a broken object
        return None
    return None


def _first_nonfinite(losses: list[tuple[Any, Any]]) -> int | None:
    for step, loss in losses:
        value = _as_float(loss)
        if value is not None and not math.isfinite(value):
            return _as_step(step)
    return None


def _step_losses(losses: list[tuple[Any, Any]]) -> tuple[tuple[int, float], ...]:
    """The newest :data:`MAX_LOSSES` of ``losses`` that are a step and a number."""
    out = []
    for step, loss in losses[-MAX_LOSSES:]:
        s, value = _as_step(step), _as_float(loss)
        if s is not None and value is not None:
            out.append((s, value))
    return tuple(out)


def _as_rate(x: Any) -> float | None:
    v = _as_float(x)
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def _json_value(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    return str(v)[:200]


def _as_op(op: tuple[Any, Any, Any, dict[str, Any]] | None) -> dict[str, Any] | None:
    if op is None:
        return None
    name, kind, t, attrs = op
    out: dict[str, Any] = {"name": str(name)[:200], "kind": str(kind)[:50], "t": _json_value(t)}
    for key in list(attrs)[:_MAX_OP_ATTRS]:
        if key not in out:
            out[str(key)[:64]] = _json_value(attrs[key])
    return out
