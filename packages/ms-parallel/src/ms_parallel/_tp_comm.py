"""The communication side of the chunked collective matmuls: one tensor-parallel group,
its bounded waits and its events, and the split of a shard's rows into chunks.

Every collective here is issued asynchronously and waited through
:func:`ms_parallel._wait.wait_bounded`, so a TP peer that stops participating is a
:class:`~ms_parallel.CollectiveTimeout` naming the op, the group, this rank, the layer
and the chunk, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ms_parallel._wait import wait_bounded
from ms_parallel.events import EventHook

__all__ = ["Pending", "TPComm", "chunk_bounds"]

# torch 2.13 renamed the flat all-gather (the old name warns); older torch has only that.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous row ranges covering ``[0, rows)``, sizes differing by at most
    one (fewer when there are fewer rows than chunks: no range is empty)."""
    c = max(1, min(chunks, rows))
    return [(i * rows // c, (i + 1) * rows // c) for i in range(c)]


@dataclass
class Pending:
    """One issued collective of one chunk and the buffer it fills."""

    work: dist.Work | None
    buffer: torch.Tensor
    op: str
    chunk: int
    chunks: int


class TPComm:
    """The tensor-parallel group of one layer's collectives.

    Args:
        group: the TP process group (``mesh["tp"]``'s), or None for one rank.
        timeout_s: the bound of every wait.
        on_event: ``on_event(name, kind, t, **attrs)`` at every issue, wait and chunk GEMM.
        label: what the collectives are for, in errors and events (``"block 3 attn"``).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | DeviceMesh | None,
        *,
        timeout_s: float = 600.0,
        on_event: EventHook | None = None,
        label: str = "",
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
        self._mesh: DeviceMesh | None = None
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(
                    f"group must be a 1-D DeviceMesh (e.g. mesh['tp']), got a {group.ndim}-D "
                    f"mesh with dims {group.mesh_dim_names}"
                )
            self._mesh, group = group, group.get_group()
        elif group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got "
                f"{type(group).__name__}"
            )
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.timeout_s = float(timeout_s)
        self.on_event = on_event
        self.label = label

    def mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The 1-D ``DeviceMesh`` of the group, for ``DTensor`` state (made once)."""
        if self._mesh is None:
            if self.group is None:
                raise RuntimeError("a TPComm without a process group has no mesh")
            self._mesh = DeviceMesh.from_group(self.group, device_type)
        return self._mesh

    def quiet(self) -> TPComm:
        """The same group, reporting no events (for measurements off the real step)."""
        other = self.with_label(self.label)
        other.on_event = None
        return other

    def with_label(self, label: str) -> TPComm:
        """The same group, reporting as ``label``."""
        other = TPComm.__new__(TPComm)
        other.__dict__.update(self.__dict__)
        other.label = label
        return other

    def emit(self, name: str, kind: str, **attrs: Any) -> None:
        if self.on_event is not None:
            self.on_event(
                name, kind, time.perf_counter(), rank=self.rank, layer=self.label, **attrs
            )

    def _group(self) -> dist.ProcessGroup:
        if self.group is None:
            raise RuntimeError("internal: a TP collective without a process group")
        return self.group

    def gather(self, part: torch.Tensor, op: str, chunk: int, chunks: int, phase: str) -> Pending:
        """Issue the all-gather of ``part`` (rows, ...) into ``(size, rows, ...)``."""
        flat = torch.empty(
            (self.size * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device
        )
        self.emit(op, "issue", chunk=chunk, chunks=chunks, phase=phase, transport="all_gather")
        # gloo takes the output concatenated along dim 0 only, not stacked.
        work = _all_gather(flat, part.contiguous(), group=self._group(), async_op=True)
        return Pending(work, flat.view(self.size, *part.shape), op, chunk, chunks)

    def exchange(self, send: torch.Tensor, op: str, chunk: int, chunks: int, phase: str) -> Pending:
        """Issue an all-to-all of ``send`` (size, rows, ...): slot ``j`` goes to rank ``j``,
        and slot ``j`` of the result comes from rank ``j``."""
        out = torch.empty_like(send)
        self.emit(op, "issue", chunk=chunk, chunks=chunks, phase=phase, transport="all_to_all")
        work = dist.all_to_all_single(out, send, group=self._group(), async_op=True)
        return Pending(work, out, op, chunk, chunks)

    def all_reduce(
        self, t: torch.Tensor, op: str, phase: str, reduce_op: Any = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """``t`` all-reduced in place over the group, waited (bounded)."""
        self.emit(op, "issue", chunk=0, chunks=1, phase=phase, transport="all_reduce")
        work = dist.all_reduce(t, op=reduce_op, group=self._group(), async_op=True)
        return self.wait(Pending(work, t, op, 0, 1), phase)

    def wait(self, pending: Pending, phase: str) -> torch.Tensor:
        """Wait (bounded) for ``pending``; its filled buffer.

        On a CUDA buffer the wait is stream-ordered (``work.wait()``: the compute stream
        waits for NCCL's, the CPU goes on enqueueing the next chunk's GEMM): a timed
        wait there would block the CPU until the collective ends, leaving the GPU idle
        between chunks. The bound on a stopped peer is then the process group's own
        timeout (NCCL's watchdog), which ms-train sets to
        ``parallel.collective_timeout_s``.
        """
        at = {"chunk": pending.chunk, "chunks": pending.chunks, "phase": phase}
        self.emit(pending.op, "wait_begin", **at)
        if pending.work is not None and pending.buffer.is_cuda:
            pending.work.wait()
            pending.work = None
        elif pending.work is not None:
            where = f"{self.label or 'tensor-parallel layer'}, {phase}, chunk {pending.chunk}"
            wait_bounded(
                pending.work,
                op=pending.op,
                group=self._group(),
                where=f"{where} of {pending.chunks}",
                timeout_s=self.timeout_s,
            )
            pending.work = None
        self.emit(pending.op, "wait_end", **at)
        return pending.buffer
