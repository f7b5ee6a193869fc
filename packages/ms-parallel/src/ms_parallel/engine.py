"""The step engine: one object owns everything about one optimizer step that depends on
how the model is parallelized (design: ``docs/step-engine.md``).

A trainer calls :meth:`StepEngine.step` once per optimizer step with a way to get the
step's micro-batches and a loss function, and checkpoints :meth:`StepEngine.state`.
Everything else is the engine's: the order of forward and backward over the
micro-batches (a pipeline schedule needs to own it), when gradients are synchronized,
the global gradient norm and clipping (each parameter counted once across the mesh),
which tensors the optimizer steps on (whole parameters, or this rank's shards), and
what state a checkpoint sees. :class:`DDPEngine` and :class:`ZeroEngine` implement it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ms_parallel.events import EventHook
from ms_parallel.zero import ZeroDataParallel

_T = TypeVar("_T")

__all__ = [
    "DDPEngine",
    "LossFn",
    "OptimizerFactory",
    "ShardSpec",
    "StepEngine",
    "StepResult",
    "ZeroEngine",
]


@dataclass(frozen=True)
class ShardSpec:
    """How an optimizer's tensors map onto logical parameters when they are shards.

    What a ZeRO-aware optimizer needs to complete per-parameter quantities (LAMB's
    trust-ratio norms) with one all-reduce over ``group``; ms-optim's ``ShardMap``
    takes ``param_ids``, ``numels`` and ``replicated`` as they are.
    """

    #: For each tensor the optimizer will hold (group after group), the index of the
    #: logical parameter it is a slice of.
    param_ids: tuple[int, ...]
    #: Element count of every logical parameter.
    numels: tuple[int, ...]
    #: The group the shards are spread over; ``None`` in one process without
    #: ``torch.distributed``, where every tensor is a whole (flattened) parameter.
    group: dist.ProcessGroup | None
    #: Positions in ``param_ids`` (ascending) of the tensors that every rank of
    #: ``group`` holds whole and steps identically (ZeRO's replicated chunks): a
    #: norm over the group counts them once, not once per rank.
    replicated: tuple[int, ...] = ()


#: ``make_optimizer(param_groups, shards)``: build the optimizer on the given groups
#: (their ``params`` are what the engine wants stepped); ``shards`` is ``None`` when
#: they are whole parameters.
OptimizerFactory = Callable[[list[dict[str, Any]], ShardSpec | None], torch.optim.Optimizer]

#: ``loss_fn(module, batch)``: the loss of one micro-batch (autocast is the caller's).
LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    #: This rank's mean loss over the step's micro-batches (detached).
    loss: torch.Tensor
    #: The global gradient norm before clipping, over every parameter once.
    grad_norm: torch.Tensor


@runtime_checkable
class StepEngine(Protocol):
    """What a trainer needs from a parallel engine."""

    name: str

    def setup(
        self,
        model: nn.Module,
        param_groups: Sequence[dict[str, Any]],
        make_optimizer: OptimizerFactory,
    ) -> None:
        """Wrap ``model`` and build the optimizer; ``param_groups`` name the model's own
        parameters (hyperparameters per group), the engine maps them to what it steps."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def eval_module(self) -> nn.Module:
        """The module to run forward-only passes on (full parameters, no gradient sync)."""
        ...

    def step(
        self,
        next_batch: Callable[[], Any],
        loss_fn: LossFn,
        *,
        grad_accum: int,
        max_norm: float | None,
    ) -> StepResult:
        """Forward and backward over ``grad_accum`` micro-batches (``next_batch()``
        each), synchronize, clip to ``max_norm`` (``None``: no clipping) and step the
        optimizer. The caller sets learning rates on ``optimizer.param_groups`` first."""
        ...

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves and loads: ``{"model": ..., "optim": ...}``, each
        with ``state_dict`` / ``load_state_dict`` (collective where the state is)."""
        ...


class DDPEngine:
    """``torch.nn.parallel.DistributedDataParallel`` over ``process_group`` (default:
    the world): gradients all-reduced in buckets during backward, ``no_sync`` on the
    micro-batches before the last. With one rank, the model as it is."""

    name = "ddp"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self.device = torch.device(device)
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self._model: nn.Module | None = None
        self._wrapped: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    def world_size(self) -> int:
        if not dist.is_available() or not dist.is_initialized():
            return 1
        return dist.get_world_size(self.process_group)

    def setup(
        self,
        model: nn.Module,
        param_groups: Sequence[dict[str, Any]],
        make_optimizer: OptimizerFactory,
    ) -> None:
        self._model = model
        if self.world_size() == 1:
            self._wrapped = model
        else:
            self._wrapped = DistributedDataParallel(
                model,
                device_ids=[self.device] if self.device.type == "cuda" else None,
                process_group=self.process_group,
                bucket_cap_mb=self.bucket_cap_mb,
            )
        self._optimizer = make_optimizer([dict(g) for g in param_groups], None)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return _set(self._optimizer, "optimizer")

    @property
    def eval_module(self) -> nn.Module:
        return _set(self._model, "eval_module")

    def step(
        self,
        next_batch: Callable[[], Any],
        loss_fn: LossFn,
        *,
        grad_accum: int,
        max_norm: float | None,
    ) -> StepResult:
        wrapped = _set(self._wrapped, "step")
        no_sync = (
            wrapped.no_sync
            if isinstance(wrapped, DistributedDataParallel)
            else contextlib.nullcontext
        )
        loss = _micro_batches(wrapped, no_sync, next_batch, loss_fn, grad_accum, self.device)
        # Gradients are replicated: every rank computes the same norm locally.
        norm = torch.nn.utils.clip_grad_norm_(
            _set(self._model, "step").parameters(), _max_norm(max_norm)
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm)

    def state(self) -> dict[str, Any]:
        return {"model": _set(self._model, "state"), "optim": self.optimizer}


class ZeroEngine:
    """ZeRO-2 (:class:`ms_parallel.ZeroDataParallel`) over ``process_group`` (default:
    the world; one process without ``torch.distributed`` communicates nothing but keeps
    the same state form): reduce-scatter per bucket during backward, the optimizer on this rank's
    shards, the all-gather deferred into the next forward with chained prefetch. The first
    ``replicated_chunks`` chunks are all-reduced and stepped whole on every rank instead.

    The keyword arguments are :class:`ZeroDataParallel`'s.
    """

    name = "zero"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        prefetch: bool = True,
        prefetch_chunks: int | None = None,
        timeout_s: float = 600.0,
        on_event: EventHook | None = None,
        replicated_chunks: int = 0,
    ) -> None:
        self.device = torch.device(device)
        self.process_group = process_group
        self.options: dict[str, Any] = {
            "bucket_mb": bucket_mb,
            "reduce_dtype": reduce_dtype,
            "prefetch": prefetch,
            "prefetch_chunks": prefetch_chunks,
            "timeout_s": timeout_s,
            "on_event": on_event,
            "replicated_chunks": replicated_chunks,
        }
        self.zero: ZeroDataParallel | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    def setup(
        self,
        model: nn.Module,
        param_groups: Sequence[dict[str, Any]],
        make_optimizer: OptimizerFactory,
    ) -> None:
        group = self.process_group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self._model = model
        self.zero = zero = ZeroDataParallel(model, group, **self.options)
        groups = zero.optimizer_param_groups(param_groups)
        spec = ShardSpec(
            zero.group_param_ids(groups),
            zero.param_numels,
            zero.group,
            replicated=zero.group_replicated(groups),
        )
        self._optimizer = zero.attach_optimizer(make_optimizer(groups, spec))

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return _set(self._optimizer, "optimizer")

    @property
    def eval_module(self) -> nn.Module:
        return _set(self.zero, "eval_module")

    def step(
        self,
        next_batch: Callable[[], Any],
        loss_fn: LossFn,
        *,
        grad_accum: int,
        max_norm: float | None,
    ) -> StepResult:
        zero = _set(self.zero, "step")
        loss = _micro_batches(zero, zero.no_sync, next_batch, loss_fn, grad_accum, self.device)
        norm = zero.clip_grad_norm_(_max_norm(max_norm))
        zero.step(self.optimizer)  # chunk by chunk where that is the same update
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm)

    def state(self) -> dict[str, Any]:
        zero = _set(self.zero, "state")
        return {
            "model": _ZeroModelState(zero, _set(self._model, "state")),
            "optim": _ZeroOptimState(zero, self.optimizer),
        }


class _ZeroModelState:
    """The full model parameters, gathered first (after a step each rank's buffers hold
    only its own updated shard until the next forward gathers them)."""

    def __init__(self, zero: ZeroDataParallel, model: nn.Module) -> None:
        self.zero, self.model = zero, model

    def state_dict(self) -> dict[str, Any]:
        self.zero.gather_params()
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zero.gather_params()  # nothing in flight may write over what is loaded
        self.model.load_state_dict(state)


class _ZeroOptimState:
    def __init__(self, zero: ZeroDataParallel, optimizer: torch.optim.Optimizer) -> None:
        self.zero, self.optimizer = zero, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.zero.optimizer_state_dict(self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zero.load_optimizer_state_dict(self.optimizer, state)


def _micro_batches(
    module: nn.Module,
    no_sync: Callable[[], AbstractContextManager[Any]],
    next_batch: Callable[[], Any],
    loss_fn: LossFn,
    grad_accum: int,
    device: torch.device,
) -> torch.Tensor:
    """Forward and backward of ``grad_accum`` micro-batches, all but the last under
    ``no_sync()``; the mean loss (detached)."""
    _check_accum(grad_accum)
    total = torch.zeros((), device=device)
    for micro in range(grad_accum):
        batch = next_batch()
        last = micro == grad_accum - 1
        with contextlib.nullcontext() if last else no_sync():
            loss = loss_fn(module, batch)
            (loss / grad_accum).backward()  # type: ignore[no-untyped-call]
        total += loss.detach()
    return total / grad_accum


def _set(value: _T | None, what: str) -> _T:
    if value is None:
        raise RuntimeError(f"call setup(model, param_groups, make_optimizer) before {what}")
    return value


def _check_accum(grad_accum: int) -> None:
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be an int >= 1, got {grad_accum!r}")


def _max_norm(max_norm: float | None) -> float:
    if max_norm is None:
        return math.inf
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0 or None, got {max_norm!r}")
    return float(max_norm)
