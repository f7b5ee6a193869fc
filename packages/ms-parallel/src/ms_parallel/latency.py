"""A ``torch.distributed`` backend that injects network latency: overlap made measurable on CPU.

On a 2-core machine communication over loopback gloo is nearly free and compute and
communication share the cores, so wall clock alone cannot show whether a schedule
overlaps them. This backend runs every op on a real gloo backend and completes it no
earlier than its issue time + ``L``, with ``L`` set per op type: a schedule that hides
communication behind compute keeps its step time as ``L`` grows, one that waits right
after issuing pays ``L`` per op. It is a backend, not a wrapper around ms code, so that
torch's DDP and FSDP2 run under the same injected network::

    import torch.distributed as dist
    from ms_parallel.latency import register_latency_backend

    net = register_latency_backend("latency", latency={"default": 0.02, "barrier": 0})
    dist.init_process_group("latency", rank=rank, world_size=world)  # or new_group(backend=)
    ...
    net.set_latency(all_gather=0.05)  # applies to ops issued from now on

Semantics of every op (collective or point to point) on a group of this backend:

- it is issued on the inner gloo backend at once, in the caller;
- its work completes (``wait()`` returns, its future is done) no earlier than issue time
  + ``L`` of its op type, and never before the gloo op itself completed;
- the ops of one group complete in issue order, each as soon as it may: a completion
  thread per group does the waiting, so ops issued together overlap their latencies;
- synchronous calls (``dist.all_reduce(t)`` without ``async_op``) wait for it too;
- an error of the gloo op is raised by ``wait()`` (and set on the future);
- ``work.wait(timeout)`` raises ``torch.distributed.DistBackendError`` when the op has not
  completed within ``timeout``, like gloo's works.

Callbacks on an op's future (``Future.then``, DDP comm hooks) run on the group's
completion thread, in completion order; one that waits for a later op of the same group
gets a ``RuntimeError`` (that op cannot complete before the callback returns). Groups
take CPU tensors only (gloo). ``destroy_process_group`` completes what was issued and
stops the thread; groups still open at interpreter exit are closed by an exit hook that
the first group registers.

Registration is explicit and process-wide (c10d's backend table is): registering a name
again updates that name's latencies and hook, and returns the same handle; a name c10d
already knows that this module did not register (``gloo``, ``nccl``, ...) is refused.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping
from datetime import timedelta

import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from ms_parallel._latency_group import LatencyProcessGroup
from ms_parallel.events import EventHook

__all__ = [
    "OP_TYPES",
    "LatencyBackend",
    "LatencyProcessGroup",
    "register_latency_backend",
]

#: Op types with their own latency; ``default`` covers every op without one of its own
#: (reduce, gather, scatter). ``p2p`` is send, recv and recv from any source.
OP_TYPES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "p2p",
    "barrier",
    "default",
)
# Op types the group reports that have no latency key of their own.
_DEFAULTED = ("reduce", "gather", "scatter")
_INNER = ("gloo",)
_NAME = re.compile(r"[a-z][a-z0-9_]*")

_registry_lock = threading.Lock()
_registered: dict[str, LatencyBackend] = {}


class LatencyBackend:
    """The handle of one registered latency backend: its latencies and its event hook.

    Made by :func:`register_latency_backend`. Every group of the backend reads them at
    each op's issue, so a change applies to the ops issued after it, in every group
    already created and every group created later.
    """

    def __init__(
        self,
        name: str,
        inner: str,
        latency: float | Mapping[str, float],
        on_event: EventHook | None,
    ) -> None:
        self._name = name
        self._inner = inner
        self._lock = threading.Lock()
        self._latency = dict.fromkeys(OP_TYPES, 0.0)
        self._explicit: set[str] = {"default"}
        self._bandwidth = math.inf
        self._on_event: EventHook | None = None
        self.set_latency(latency)
        self.on_event = on_event

    @property
    def name(self) -> str:
        """The backend name to pass to ``init_process_group`` / ``new_group``."""
        return self._name

    @property
    def inner(self) -> str:
        """The backend every op really runs on."""
        return self._inner

    @property
    def on_event(self) -> EventHook | None:
        """Called as ``on_event(op_type, kind, t, **attrs)`` with ``kind`` ``"issue"`` (on
        the issuing thread) and ``"complete"`` (on the completion thread, just before the
        work completes); ``t`` is ``time.perf_counter()``. attrs: ``method`` (the c10d
        method), ``group`` (group name), ``rank`` (in the group), ``seq`` (issue number in
        the group), ``bytes`` (this rank's input bytes, else its output bytes),
        ``latency`` (the ``L`` applied), ``peer`` (p2p); ``error`` (the exception's type
        name) on a ``"complete"`` of an op that failed. ``None``: no events."""
        return self._on_event

    @on_event.setter
    def on_event(self, hook: EventHook | None) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(f"on_event must be a callable or None, got {hook!r}")
        self._on_event = hook

    def latency(self, op: str) -> float:
        """The latency in seconds applied now to ops of type ``op`` (see :data:`OP_TYPES`;
        ``reduce``, ``gather`` and ``scatter`` take ``default``)."""
        with self._lock:
            if op in self._latency:
                return self._latency[op] if op in self._explicit else self._latency["default"]
            if op in _DEFAULTED:
                return self._latency["default"]
        raise ValueError(f"op must be one of {', '.join(OP_TYPES + _DEFAULTED)}, got {op!r}")

    def latencies(self) -> dict[str, float]:
        """Every op type's latency now, in seconds."""
        return {op: self.latency(op) for op in OP_TYPES}

    def set_latency(
        self, latency: float | Mapping[str, float] | None = None, **per_op: float
    ) -> None:
        """Set latencies in seconds: a number sets ``default`` and clears every per-op value;
        a mapping or keywords set the named op types (``default`` included) and leave the
        others as they are. Ops already issued keep the latency they were issued with."""
        updates: dict[str, float] = {}
        reset = False
        if isinstance(latency, Mapping):
            updates.update(latency)
        elif latency is not None:
            updates["default"] = latency
            reset = True
        updates.update(per_op)
        checked = {op: _check_latency(op, value) for op, value in updates.items()}
        with self._lock:
            if reset:
                self._explicit = {"default"}
            self._latency.update(checked)
            self._explicit.update(checked)

    @property
    def bandwidth(self) -> float:
        """Bytes per second each rank's link of a group carries (``inf``: no transfer
        time, the default). With a finite bandwidth an op also occupies its group's link
        for its wire bytes / bandwidth, after the ops issued before it: it completes no
        earlier than ``max(issue, the link free) + wire_bytes / bandwidth + L``. Wire
        bytes are what this rank sends in a ring algorithm (``wire_bytes`` of the
        events): an all-gather ``(n - 1) x`` its input, a reduce-scatter or all-to-all
        ``(n - 1) / n``, an all-reduce ``2 (n - 1) / n``."""
        with self._lock:
            return self._bandwidth

    def set_bandwidth(self, bytes_per_s: float) -> None:
        """Set :attr:`bandwidth` (``math.inf`` turns transfer times off); applies to ops
        issued from now on."""
        if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, (int, float)):
            raise TypeError(f"bandwidth must be a number of bytes per second, got {bytes_per_s!r}")
        if not bytes_per_s > 0:
            raise ValueError(f"bandwidth must be > 0 bytes per second, got {bytes_per_s!r}")
        with self._lock:
            self._bandwidth = float(bytes_per_s)

    def __repr__(self) -> str:
        return (
            f"LatencyBackend(name={self._name!r}, inner={self._inner!r}, "
            f"latency={self.latencies()}, bandwidth={self.bandwidth})"
        )

    def _create(
        self, store: c10d.Store, rank: int, size: int, timeout: timedelta
    ) -> LatencyProcessGroup:
        """c10d's creator: the inner gloo backend on the group's store, then the group."""
        inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        return LatencyProcessGroup(inner, rank, size, self)


def _check_latency(op: object, value: object) -> float:
    if op not in OP_TYPES:
        raise ValueError(f"latency op type must be one of {', '.join(OP_TYPES)}, got {op!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"latency[{op!r}] must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"latency[{op!r}] must be a finite number >= 0 seconds, got {value!r}")
    return seconds


def register_latency_backend(
    name: str = "latency",
    *,
    latency: float | Mapping[str, float] = 0.0,
    inner: str = "gloo",
    on_event: EventHook | None = None,
) -> LatencyBackend:
    """Register (or update) the c10d backend ``name`` and return its handle.

    Args:
        name: the backend name for ``dist.init_process_group(backend=name)`` and
            ``dist.new_group(backend=name)``: lower case letters, digits and ``_``.
        latency: seconds; a number is the latency of every op type, a mapping sets op
            types by name (:data:`OP_TYPES`), the others taking ``default`` (0 if unset).
        inner: the backend every op runs on; only ``"gloo"`` (CPU tensors).
        on_event: an :data:`~ms_parallel.events.EventHook` for each op's issue and
            completion, or ``None``.

    Registering a name that this function registered before updates its latencies (as
    :meth:`LatencyBackend.set_latency` with ``latency``) and its hook, and returns the
    same handle; a name c10d already has for another backend is refused.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"name must be lower case letters, digits and '_', starting with a letter, got {name!r}"
        )
    if inner not in _INNER:
        raise ValueError(f"inner must be one of {', '.join(_INNER)}, got {inner!r}")
    with _registry_lock:
        handle = _registered.get(name)
        if handle is not None:
            handle.set_latency(latency)
            handle.on_event = on_event
            return handle
        if name in dist.Backend.backend_list or name.upper() in dist.Backend._plugins:
            raise ValueError(
                f"name {name!r} is already a c10d backend not registered here; choose another"
            )
        handle = LatencyBackend(name, inner, latency, on_event)
        # devices=["cpu"]: c10d gives it only CPU tensors, and does not make it the
        # default CPU backend, which stays gloo.
        dist.Backend.register_backend(name, handle._create, devices=["cpu"])
        _registered[name] = handle
        return handle
