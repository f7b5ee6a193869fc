"""The process group behind :mod:`ms_parallel.latency`: a real gloo backend, slowed down.

A Python subclass of ``torch.distributed.ProcessGroup``: c10d's Python functions call its
methods directly, and C++ users (DDP's reducer, ``_broadcast_coalesced``) reach the same
methods through torch's pybind trampoline. Every op is issued on the inner gloo backend
at once and handed, with its deadline (issue time + L), to one completion thread per
group, which completes the ops in issue order: it waits for the real op, then for the
deadline, then fulfils the op's future. Ops issued together therefore share their
latency instead of adding it up, and the caller never sleeps.
"""

from __future__ import annotations

import atexit
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from ms_parallel.latency import LatencyBackend

__all__ = ["LatencyProcessGroup"]

# How long shutdown waits for the completion thread to finish the ops already queued.
_SHUTDOWN_JOIN_S = 10.0
_NO_TIMEOUT = timedelta(0)


class _LatencyWork(dist.Work):
    """The handle of one delayed op: done when the completion thread says so.

    torch's ``_create_work_from_future`` would do, except that its ``wait`` refuses
    a finite timeout; this one honours it, as gloo's own works do.
    """

    def __init__(
        self,
        future: torch.futures.Future[list[torch.Tensor]],
        what: str,
        completer: threading.Thread,
    ) -> None:
        super().__init__()
        self._future = future
        self._done = threading.Event()
        self._what = what
        self._completer = completer

    def wait(self, timeout: timedelta = _NO_TIMEOUT) -> bool:
        if not self._future.done() and threading.current_thread() is self._completer:
            # Callbacks on a completed op's future (Future.then, DDP comm hooks) run on
            # the completion thread, which must complete this op first: say so, not hang.
            raise RuntimeError(
                f"{self._what} was waited for inside a callback of an earlier op of its "
                "group, on the thread that completes both; wait outside the callback"
            )
        # c10d's kNoTimeout (0 ms) means "wait as long as it takes".
        seconds = timeout.total_seconds()
        if seconds > 0 and not self._done.wait(seconds):
            raise dist.DistBackendError(
                f"{self._what} did not complete within the wait timeout of {seconds:g} s"
            )
        self._future.wait()  # re-raises the inner op's error, if any
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as e:
            return e
        return None

    def result(self) -> list[torch.Tensor]:
        return self._future.wait()

    def _complete(self, value: list[torch.Tensor], error: BaseException | None) -> None:
        # The future first (it runs its callbacks inline), then the event that timed
        # waits watch: whoever wakes finds the result there.
        if error is None:
            self._future.set_result(value)
        else:
            self._future.set_exception(error)  # type: ignore[arg-type]
        self._done.set()


@dataclass
class _Pending:
    """One issued op as the completion thread sees it."""

    op: str
    method: str
    seq: int
    nbytes: int
    deadline: float
    latency: float
    inner: list[dist.Work]
    outputs: list[torch.Tensor]
    work: _LatencyWork
    attrs: dict[str, Any] = field(default_factory=dict)


class _Completer:
    """A daemon thread that completes one group's ops in issue order.

    For each op it waits for the gloo work, then for the deadline, then hands the op to
    ``complete`` (which fulfils the op's work). ``close`` lets it finish what is queued;
    ``stop`` (abort, interpreter exit) drops what is queued: nobody waits any more.
    """

    def __init__(
        self, name: str, complete: Callable[[_Pending, BaseException | None], None]
    ) -> None:
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._complete = complete
        self._stopping = threading.Event()
        # Daemon: a process that forgets destroy_process_group() must still exit.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def put(self, pending: _Pending) -> None:
        self._queue.put(pending)

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._join(timeout)

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._queue.put(None)
        self._join(timeout)

    def _join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while (pending := self._queue.get()) is not None:
            if not self._stopping.is_set():
                self._wait_for(pending)

    def _wait_for(self, pending: _Pending) -> None:
        error: BaseException | None = None
        for work in pending.inner:
            try:
                work.wait()
            except BaseException as e:  # the waiter gets the inner op's error
                error = error or e
        # Until perf_counter itself says the deadline has passed: the bound is "no
        # earlier than", and a timed wait may end a hair early on another clock.
        while (left := pending.deadline - time.perf_counter()) > 0:
            if self._stopping.wait(left):
                return
        self._complete(pending, error)


# The groups still open when the interpreter exits are closed first. Finalization must
# not catch a thread inside torch's C++ holding the last reference to a Python object:
# our completion thread (fulfilling a future), or a gloo worker thread dropping a finished
# work whose tensors it then frees; either aborts the process ("terminate called without
# an active exception"). So the completion thread is stopped and joined, then the gloo
# backend is released, whose destructor joins gloo's worker threads.
_EXIT_JOIN_S = 5.0
_open_groups: weakref.WeakSet[LatencyProcessGroup] = weakref.WeakSet()
_open_lock = threading.Lock()
_exit_hook_registered = False


def _track(group: LatencyProcessGroup) -> None:
    global _exit_hook_registered
    with _open_lock:
        _open_groups.add(group)
        if not _exit_hook_registered:  # registered with the first group, not at import
            atexit.register(_close_all_at_exit)
            _exit_hook_registered = True


def _close_all_at_exit() -> None:
    with _open_lock:
        groups = list(_open_groups)
    for group in groups:
        group._release(_EXIT_JOIN_S)


def _opts(opts: Any, default: Callable[[], Any]) -> Any:
    return default() if opts is None else opts


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _wire_bytes(op: str, nbytes: int, size: int) -> int:
    """What this rank sends for ``op`` in a ring algorithm, ``nbytes`` its input (or
    output) bytes on a group of ``size``."""
    if size <= 1 or op in ("barrier",):
        return 0
    if op == "all_gather":
        return nbytes * (size - 1)
    if op in ("reduce_scatter", "all_to_all"):
        return nbytes * (size - 1) // size
    if op == "all_reduce":
        return 2 * nbytes * (size - 1) // size
    return nbytes


def _flat(lists: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for ts in lists for t in ts]


class LatencyProcessGroup(dist.ProcessGroup):
    """A process group whose every op completes no earlier than issue time + L.

    Built by the backend creator that :func:`ms_parallel.latency.register_latency_backend`
    registers; ``L`` per op type comes from that registration's handle at issue time.
    """

    def __init__(
        self,
        inner: c10d.Backend,
        rank: int,
        size: int,
        backend: LatencyBackend,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        # gloo's bindings are missing from torch's stubs.
        self._inner: Any = inner
        self._rank = rank
        self._size = size
        self._backend = backend
        # c10d hands the name to _set_group_name; the C++ base class would look for it
        # in a registered backend, which a Python group does not have.
        self._group_name = ""
        self._group_desc = ""
        self._seq = 0
        self._link_free = 0.0  # when this rank's link of the group ends its last transfer
        self._lock = threading.Lock()
        self._completer: _Completer | None = None
        self._closed = False
        _track(self)

    # -- identity ------------------------------------------------------------------

    def getBackendName(self) -> str:
        return self._backend.name

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def inner(self) -> c10d.Backend:
        """The real gloo backend every op runs on (released at interpreter exit)."""
        backend: c10d.Backend = self._inner
        return backend

    def __repr__(self) -> str:
        return (
            f"LatencyProcessGroup(backend={self._backend.name!r}, group={self._group_name!r}, "
            f"rank={self._rank}, size={self._size})"
        )

    # -- collectives ---------------------------------------------------------------
    # Each method keeps c10d's signature (the C++ trampoline and distributed_c10d call
    # them positionally, barrier with opts= as a keyword) and issues the same op on gloo.
    # torch's stubs also list Python-side overloads that c10d never calls on a group,
    # hence the ignored override checks.

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        o = _opts(opts, c10d.AllreduceOptions)
        return self._submit(
            "all_reduce", "allreduce", tensors, tensors,
            lambda: [self._inner.allreduce(tensors, o)],
        )  # fmt: skip

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:
        o = _opts(opts, c10d.AllreduceCoalescedOptions)
        return self._submit(
            "all_reduce", "allreduce_coalesced", tensors, tensors,
            lambda: [self._inner.allreduce_coalesced(tensors, o)],
        )  # fmt: skip

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        o = _opts(opts, c10d.BroadcastOptions)
        return self._submit(
            "broadcast", "broadcast", tensors, tensors,
            lambda: [self._inner.broadcast(tensors, o)],
        )  # fmt: skip

    def reduce(self, tensors: list[Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        o = _opts(opts, c10d.ReduceOptions)
        return self._submit(
            "reduce", "reduce", tensors, tensors, lambda: [self._inner.reduce(tensors, o)]
        )

    def allgather(  # type: ignore[override]
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        o = _opts(opts, c10d.AllgatherOptions)
        return self._submit(
            "all_gather", "allgather", inputs, _flat(output_lists),
            lambda: [self._inner.allgather(output_lists, inputs, o)],
        )  # fmt: skip

    def allgather_coalesced(
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        o = _opts(opts, c10d.AllgatherOptions)
        return self._submit(
            "all_gather", "allgather_coalesced", inputs, _flat(output_lists),
            lambda: [self._inner.allgather_coalesced(output_lists, inputs, o)],
        )  # fmt: skip

    def all_gather_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        o = _opts(opts, c10d.AllgatherOptions)
        return self._submit(
            "all_gather", "all_gather_single", [input], [output],
            lambda: [self._inner._allgather_base(output, input, o)],
        )  # fmt: skip

    def all_gather_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        o = _opts(opts, c10d.AllgatherOptions)
        # gloo has no coalesced form: one op per pair, completed together as one.
        return self._submit(
            "all_gather", "all_gather_single_coalesced", inputs, outputs,
            lambda: [
                self._inner._allgather_base(out, inp, o)
                for out, inp in zip(outputs, inputs, strict=True)
            ],
        )  # fmt: skip

    def gather(  # type: ignore[override]
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        o = _opts(opts, c10d.GatherOptions)
        return self._submit(
            "gather", "gather", inputs, _flat(output_lists),
            lambda: [self._inner.gather(output_lists, inputs, o)],
        )  # fmt: skip

    def scatter(  # type: ignore[override]
        self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None
    ) -> dist.Work:
        o = _opts(opts, c10d.ScatterOptions)
        return self._submit(
            "scatter", "scatter", _flat(input_lists), outputs,
            lambda: [self._inner.scatter(outputs, input_lists, o)],
        )  # fmt: skip

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None
    ) -> dist.Work:
        o = _opts(opts, c10d.ReduceScatterOptions)
        return self._submit(
            "reduce_scatter", "reduce_scatter", _flat(input_lists), outputs,
            lambda: [self._inner.reduce_scatter(outputs, input_lists, o)],
        )  # fmt: skip

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts: Any = None) -> dist.Work:
        o = _opts(opts, c10d.ReduceScatterOptions)
        return self._submit(
            "reduce_scatter", "reduce_scatter_single", [input], [output],
            lambda: [self._inner._reduce_scatter_base(output, input, o)],
        )  # fmt: skip

    def reduce_scatter_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> dist.Work:
        o = _opts(opts, c10d.ReduceScatterOptions)
        return self._submit(
            "reduce_scatter", "reduce_scatter_single_coalesced", inputs, outputs,
            lambda: [
                self._inner._reduce_scatter_base(out, inp, o)
                for out, inp in zip(outputs, inputs, strict=True)
            ],
        )  # fmt: skip

    def all_to_all_single(
        self,
        output: Tensor,
        input: Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        o = _opts(opts, c10d.AllToAllOptions)
        return self._submit(
            "all_to_all", "all_to_all_single", [input], [output],
            lambda: [
                self._inner.alltoall_base(output, input, output_split_sizes, input_split_sizes, o)
            ],
        )  # fmt: skip

    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> dist.Work:
        o = _opts(opts, c10d.AllToAllOptions)
        return self._submit(
            "all_to_all", "alltoall", inputs, outputs,
            lambda: [self._inner.alltoall(outputs, inputs, o)],
        )  # fmt: skip

    def barrier(self, opts: Any = None) -> dist.Work:
        o = _opts(opts, c10d.BarrierOptions)
        return self._submit("barrier", "barrier", [], [], lambda: [self._inner.barrier(o)])

    # The names older torch releases (and some callers) use for the same ops.
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]
    alltoall_base = all_to_all_single  # type: ignore[assignment]

    # -- point to point ------------------------------------------------------------

    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._submit(
            "p2p", "send", tensors, [], lambda: [self._inner.send(tensors, dst, tag)], peer=dst
        )

    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._submit(
            "p2p", "recv", [], tensors, lambda: [self._inner.recv(tensors, src, tag)], peer=src
        )

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> dist.Work:
        return self._submit(
            "p2p", "recv_anysource", [], tensors,
            lambda: [self._inner.recv_anysource(tensors, tag)],
        )  # fmt: skip

    # -- life cycle ----------------------------------------------------------------

    def shutdown(self) -> None:
        """Complete what was issued, stop the completion thread, shut the inner group."""
        completer, inner = self._close()
        if completer is not None:
            completer.close(_SHUTDOWN_JOIN_S)
        if inner is not None:
            inner.shutdown()

    def abort(self) -> None:
        completer, inner = self._close()
        if completer is not None:
            completer.stop(0.0)
        if inner is not None:
            inner.abort()

    def _release(self, timeout: float) -> None:
        """At interpreter exit: drop what is queued, stop the thread, free the gloo backend."""
        completer, _ = self._close()
        if completer is not None:
            completer.stop(timeout)
        with self._lock:
            self._inner = None  # the last reference: its destructor joins gloo's threads

    def _close(self) -> tuple[_Completer | None, Any]:
        with self._lock:
            completer, self._completer = self._completer, None
            self._closed = True
            return completer, self._inner

    # -- the mechanism -------------------------------------------------------------

    def _submit(
        self,
        op: str,
        method: str,
        inputs: Sequence[Tensor],
        outputs: list[Tensor],
        issue: Callable[[], list[dist.Work]],
        **attrs: Any,
    ) -> dist.Work:
        latency = self._backend.latency(op)
        # One lock from issue to queue: the queue's order is the order gloo saw the ops in,
        # even when several threads issue (DDP's reducer runs on autograd's thread).
        with self._lock:
            if self._closed:
                raise RuntimeError(
                    f"{self!r} was shut down (destroy_process_group, abort or interpreter "
                    f"exit); {method} cannot run on it"
                )
            t_issue = time.perf_counter()
            inner = issue()  # a bad argument raises here, in the caller, as with gloo
            nbytes = _nbytes(inputs) if inputs else _nbytes(outputs)
            wire = _wire_bytes(op, nbytes, self._size)
            bandwidth = self._backend.bandwidth
            start = max(t_issue, self._link_free)
            self._link_free = start + (wire / bandwidth if math.isfinite(bandwidth) else 0.0)
            seq = self._seq
            self._seq += 1
            what = f"{method} #{seq} on {self._backend.name} group {self._group_name!r}"
            if self._completer is None:
                self._completer = _Completer(f"ms-latency-{self._group_name}", self._complete_op)
            pending = _Pending(
                op=op,
                method=method,
                seq=seq,
                nbytes=nbytes,
                deadline=self._link_free + latency,
                latency=latency,
                inner=inner,
                outputs=list(outputs),
                work=_LatencyWork(torch.futures.Future(), what, self._completer.thread),
                attrs={**attrs, "wire_bytes": wire},
            )
            # The issue event goes out before the op is queued, so that a log never
            # holds an op's completion before its issue.
            self._emit(pending, "issue", t_issue)
            self._completer.put(pending)
        return pending.work

    def _complete_op(self, pending: _Pending, error: BaseException | None) -> None:
        """On the completion thread, at or after the op's deadline: report and complete."""
        extra = {} if error is None else {"error": type(error).__name__}
        try:
            self._emit(pending, "complete", time.perf_counter(), **extra)
        except BaseException as e:  # a failing hook fails the op's wait, not the thread
            error = error or e
        pending.work._complete(pending.outputs, error)

    def _emit(self, pending: _Pending, kind: str, t: float, **extra: Any) -> None:
        hook = self._backend.on_event
        if hook is None:
            return
        hook(
            pending.op,
            kind,
            t,
            method=pending.method,
            group=self._group_name,
            rank=self._rank,
            seq=pending.seq,
            bytes=pending.nbytes,
            latency=pending.latency,
            **pending.attrs,
            **extra,
        )
