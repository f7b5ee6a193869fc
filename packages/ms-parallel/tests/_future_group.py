"""A process group written in Python whose works are made from futures, as latency- or
fault-injecting wrappers make theirs: ``torch._C._distributed_c10d._create_work_from_future``
gives a ``FutureWrappingWork``, whose ``wait(timeout)`` refuses a finite timeout. Every op
runs on a real gloo backend; a reduce-scatter is an all-reduce whose future copies out
this rank's part (gloo's own reduce-scatter work has no future)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

NAME = "futurepg"


class FutureProcessGroup(dist.ProcessGroup):
    def __init__(self, inner: Any, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self._inner = inner
        self._name = ""

    def getBackendName(self) -> str:
        return NAME

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    @staticmethod
    def _wrap(future: torch.futures.Future[Any]) -> dist.Work:
        return c10d._create_work_from_future(future)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        work = self._inner.allreduce(tensors, opts or c10d.AllreduceOptions())
        return self._wrap(work.get_future())

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        work = self._inner.broadcast(tensors, opts or c10d.BroadcastOptions())
        return self._wrap(work.get_future())

    def all_gather_single(
        self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        work = self._inner._allgather_base(out, inp, opts or c10d.AllgatherOptions())
        return self._wrap(work.get_future())

    def allgather(
        self, outs: list[list[torch.Tensor]], inps: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:  # type: ignore[override]
        work = self._inner.allgather(outs, inps, opts or c10d.AllgatherOptions())
        return self._wrap(work.get_future())

    def reduce_scatter_single(
        self, out: torch.Tensor, inp: torch.Tensor, opts: Any = None
    ) -> dist.Work:
        whole = inp.clone()
        work = self._inner.allreduce([whole], c10d.AllreduceOptions())
        n = out.numel()
        lo = self.rank() * n

        def take(_: torch.futures.Future[Any]) -> list[torch.Tensor]:
            out.copy_(whole.view(-1)[lo : lo + n].view_as(out))
            return [out]

        return self._wrap(work.get_future().then(take))

    def barrier(self, opts: Any = None) -> dist.Work:  # type: ignore[override]
        return self._wrap(self._inner.barrier(opts or c10d.BarrierOptions()).get_future())


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> FutureProcessGroup:
    return FutureProcessGroup(dist.ProcessGroupGloo(store, rank, size, timeout), rank, size)


def init(timeout_s: float = 60.0) -> None:
    """Register the backend (once per process) and make it the default group, on the
    launcher's store (``ms_testing.dist.launch(..., init_process_group=False)``)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    store = TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(60)
    )
    dist.init_process_group(
        NAME,
        store=store,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
