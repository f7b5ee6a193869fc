"""Data-parallel engines: the swappable component that wraps the model for several ranks.

An engine turns the model into what the loop calls forward/backward on, and says how to
skip the gradient reduction on the micro-batches of an accumulation that are not the
last. The trainer needs nothing else from it, so another engine (the ms-parallel ZeRO
engine, when it lands) drops in by name (``parallel.engine``, a key of ``ENGINES``) or
as an object (``Trainer(config, engine=...)``).

``"ddp"`` is ``torch.nn.parallel.DistributedDataParallel`` over the default group. With
one rank (or no process group) it leaves the model as it is: there is nothing to reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ENGINES", "DDPEngine", "DataParallelEngine", "make_engine"]


@runtime_checkable
class DataParallelEngine(Protocol):
    """What the trainer needs from a data-parallel wrapper."""

    name: str

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the loop runs forward and backward on."""
        ...

    def no_sync(self, wrapped: nn.Module) -> AbstractContextManager[object]:
        """A context in which backward accumulates without reducing gradients."""
        ...


class DDPEngine:
    """``DistributedDataParallel`` over ``process_group`` (default: the world).

    Gradients are averaged over the group in buckets during backward, overlapped with
    the rest of backward; ``no_sync`` defers that to the last micro-batch.
    """

    name = "ddp"

    def __init__(
        self,
        device: torch.device,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.device = torch.device(device)
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb

    def world_size(self) -> int:
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self.process_group)

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.world_size() == 1:
            return model
        return DistributedDataParallel(
            model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            process_group=self.process_group,
            bucket_cap_mb=self.bucket_cap_mb,
        )

    def no_sync(self, wrapped: nn.Module) -> AbstractContextManager[object]:
        if isinstance(wrapped, DistributedDataParallel):
            return wrapped.no_sync()
        return contextlib.nullcontext()


EngineFactory = Callable[[torch.device], DataParallelEngine]

#: Engines by the name ``parallel.engine`` gives.
ENGINES: dict[str, EngineFactory] = {"ddp": DDPEngine}


def make_engine(name: str, device: torch.device) -> DataParallelEngine:
    """The engine registered as ``name``, for ``device``."""
    try:
        factory = ENGINES[name]
    except KeyError:
        raise ValueError(
            f"parallel.engine must be one of {sorted(ENGINES)}, got {name!r}"
        ) from None
    return factory(device)
