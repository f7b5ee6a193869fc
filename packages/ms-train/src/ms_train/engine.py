"""Step engines by name: the swappable component that owns one optimizer step.

``parallel.engine`` picks one of ms-parallel's engines (``ms_parallel.engine``):
``"zero"`` (ZeRO-2 with overlapped reduce-scatter and prefetched all-gather, the
default) or ``"ddp"`` (torch ``DistributedDataParallel``). An object with the
``ms_parallel.StepEngine`` interface can also be given as ``Trainer(config, engine=...)``.
The trainer only calls it: the micro-batch loop, gradient sync, clipping, what the
optimizer steps on, what the checkpoint sees and where this rank sits in the mesh
(``engine.topology``) are the engine's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from ms_parallel import DDPEngine, EventHook, StepEngine, ZeroEngine
from ms_train.config import ModelConfig, ParallelConfig
from ms_train.model import optimizer_state_upgrade

__all__ = ["ENGINES", "DDPEngine", "StepEngine", "ZeroEngine", "make_engine"]

#: ``factory(parallel, device, on_event, mesh, model)``: ``on_event`` is ms-parallel's
#: event hook (ms-health's heartbeat takes the collectives' waits from it), or None;
#: ``mesh`` the job's ``("pp", "dp", "tp")`` mesh (None in one process without a group).
EngineFactory = Callable[
    [ParallelConfig, torch.device, EventHook | None, DeviceMesh | None, ModelConfig | None],
    StepEngine,
]


def _ddp(
    p: ParallelConfig,
    device: torch.device,
    on_event: EventHook | None,
    mesh: DeviceMesh | None,
    model: ModelConfig | None,
) -> StepEngine:
    # torch's DDP reports no events.
    return DDPEngine(device, mesh=mesh, bucket_cap_mb=p.bucket_mb, timeout_s=p.collective_timeout_s)


def _zero(
    p: ParallelConfig,
    device: torch.device,
    on_event: EventHook | None,
    mesh: DeviceMesh | None,
    model: ModelConfig | None,
) -> StepEngine:
    # One process without a process group still runs ZeRO's code and state form, so a
    # checkpoint moves between one rank and many.
    return ZeroEngine(
        device,
        mesh=mesh,
        bucket_mb=p.bucket_mb,
        timeout_s=p.collective_timeout_s,
        on_event=on_event,
        replicated_chunks=p.replicated_chunks,
        # ms-train 0.4's checkpoints: the parameters' old names and QKV row order.
        state_upgrade=None if model is None else optimizer_state_upgrade(model),
    )


#: Engines by the name ``parallel.engine`` gives.
ENGINES: dict[str, EngineFactory] = {"ddp": _ddp, "zero": _zero}


def make_engine(
    parallel: ParallelConfig,
    device: torch.device,
    on_event: EventHook | None = None,
    mesh: DeviceMesh | None = None,
    model: ModelConfig | None = None,
) -> StepEngine:
    """The engine ``parallel.engine`` names, for ``device``, reporting to ``on_event``,
    over ``mesh`` (its ``dp`` dimension for data parallelism, its ``tp`` one for the
    tensor-parallel model's own sums); ``model`` lets it read older checkpoints of it."""
    try:
        factory = ENGINES[parallel.engine]
    except KeyError:
        raise ValueError(
            f"parallel.engine must be one of {sorted(ENGINES)}, got {parallel.engine!r}"
        ) from None
    return factory(parallel, device, on_event, mesh, model)
