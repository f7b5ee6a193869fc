"""Step engines by name: the swappable component that owns one optimizer step.

``parallel.engine`` picks one of ms-parallel's engines (``ms_parallel.engine``):
``"zero"`` (ZeRO-2 with overlapped reduce-scatter and prefetched all-gather, the
default) or ``"ddp"`` (torch ``DistributedDataParallel``). An object with the
``ms_parallel.StepEngine`` interface can also be given as ``Trainer(config, engine=...)``.
The trainer only calls it: the micro-batch loop, gradient sync, clipping, what the
optimizer steps on and what the checkpoint sees are the engine's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ms_parallel import DDPEngine, EventHook, StepEngine, ZeroEngine
from ms_train.config import ParallelConfig

__all__ = ["ENGINES", "DDPEngine", "StepEngine", "ZeroEngine", "make_engine"]

#: ``factory(parallel, device, on_event)``: ``on_event`` is ms-parallel's event hook
#: (ms-health's heartbeat takes the collectives' waits from it), or None.
EngineFactory = Callable[[ParallelConfig, torch.device, EventHook | None], StepEngine]


def _ddp(p: ParallelConfig, device: torch.device, on_event: EventHook | None) -> StepEngine:
    return DDPEngine(device, bucket_cap_mb=p.bucket_mb)  # torch's DDP reports no events


def _zero(p: ParallelConfig, device: torch.device, on_event: EventHook | None) -> StepEngine:
    # One process without a process group still runs ZeRO's code and state form, so a
    # checkpoint moves between one rank and many.
    return ZeroEngine(
        device,
        bucket_mb=p.bucket_mb,
        timeout_s=p.collective_timeout_s,
        on_event=on_event,
        replicated_chunks=p.replicated_chunks,
    )


#: Engines by the name ``parallel.engine`` gives.
ENGINES: dict[str, EngineFactory] = {"ddp": _ddp, "zero": _zero}


def make_engine(
    parallel: ParallelConfig, device: torch.device, on_event: EventHook | None = None
) -> StepEngine:
    """The engine ``parallel.engine`` names, for ``device``, reporting to ``on_event``."""
    try:
        factory = ENGINES[parallel.engine]
    except KeyError:
        raise ValueError(
            f"parallel.engine must be one of {sorted(ENGINES)}, got {parallel.engine!r}"
        ) from None
    return factory(parallel, device, on_event)
