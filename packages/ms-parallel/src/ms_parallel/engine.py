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
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from ms_parallel._topology import Topology, clip_, flat_group, sum_partial_grads, weighted_norm
from ms_parallel._zero_state import StateUpgrade
from ms_parallel.events import EventHook
from ms_parallel.tensor_parallel import tp_spec
from ms_parallel.zero import ZeroDataParallel

_T = TypeVar("_T")

__all__ = [
    "DDPEngine",
    "LossFn",
    "OptimizerFactory",
    "ShardSpec",
    "StepEngine",
    "StepResult",
    "Topology",
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
    #: For each tensor, how many ranks of ``group`` hold that same tensor (empty: one
    #: each). With tensor parallelism ``group`` is the dp x tp group: a ZeRO shard of a
    #: parameter that every TP rank holds whole has ``tp`` copies, a whole parameter of
    #: a replicated chunk split over TP has ``dp``; a norm weights each by 1 / copies.
    replicas: tuple[int, ...] = ()


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
    def topology(self) -> Topology:
        """This rank's mesh, DP coordinate and group, TP coordinate and group, and whether
        it reads batches and holds its replica's loss."""
        ...

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


def _resolve_topology(mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None) -> Topology:
    if mesh is not None and process_group is not None:
        raise ValueError("give mesh or process_group, not both")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh, got {type(mesh).__name__}")
        return Topology.of_mesh(mesh)
    return Topology.of_group(process_group)


def _tp_pieces(
    params: Sequence[tuple[nn.Parameter, torch.Tensor, int]], tp: int
) -> list[tuple[torch.Tensor, int]]:
    """(gradient, copies in the dp x tp group) of each piece: a parameter whole on every
    TP rank is held ``tp`` times over, on top of the copies the DP engine already has."""
    out = []
    for p, grad, copies in params:
        spec = tp_spec(p)
        whole_on_tp = spec is None or spec.dim is None
        out.append((grad, copies * (tp if whole_on_tp else 1)))
    return out


def _logical_numel(p: nn.Parameter, tp: int) -> int:
    """A parameter's element count across the TP group (its padded whole)."""
    spec = tp_spec(p)
    return p.numel() * (tp if spec is not None and spec.dim is not None else 1)


class DDPEngine:
    """``torch.nn.parallel.DistributedDataParallel`` over the data-parallel group
    (``mesh["dp"]``, or ``process_group``; default: the world): gradients all-reduced in
    buckets during backward, ``no_sync`` on the micro-batches before the last. With one
    rank, the model as it is.

    With a mesh whose ``tp`` is above 1 the model must be tensor-parallel already (its
    split parameters carry ``ms_parallel.tensor_parallel`` specs): the sequence-parallel
    partial gradients are summed over the TP group, the norm counts a parameter whole on
    every TP rank once (one all-reduce over the TP group: the DP replicas are equal), and
    the optimizer gets a :class:`ShardSpec` over the TP group so that LAMB's trust ratios
    see whole parameters."""

    name = "ddp"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        mesh: DeviceMesh | None = None,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        timeout_s: float = 600.0,
    ) -> None:
        self.device = torch.device(device)
        self._topology = _resolve_topology(mesh, process_group)
        self.process_group = self._topology.dp_group if mesh is not None else process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.timeout_s = timeout_s
        self._model: nn.Module | None = None
        self._wrapped: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    @property
    def topology(self) -> Topology:
        return self._topology

    def world_size(self) -> int:
        return self._topology.dp_size

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
        groups = [dict(g) for g in param_groups]
        spec = None
        tp = self._topology.tp_size
        if tp > 1:
            index = {id(p): i for i, p in enumerate(model.parameters())}
            flat = [p for g in groups for p in g["params"]]
            whole = [tp_spec(p) is None or tp_spec(p).dim is None for p in flat]  # type: ignore[union-attr]
            spec = ShardSpec(
                tuple(index[id(p)] for p in flat),
                tuple(_logical_numel(p, tp) for p in model.parameters()),
                self._topology.tp_group,
                replicas=tuple(tp if w else 1 for w in whole),
            )
        self._optimizer = make_optimizer(groups, spec)

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
        model = _set(self._model, "step")
        if self._topology.tp_size == 1:
            # Gradients are replicated: every rank computes the same norm locally.
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), _max_norm(max_norm))
        else:
            params = [p for p in model.parameters() if p.grad is not None]
            partial = [p.grad for p in params if _partial(p)]
            sum_partial_grads(partial, self._topology.tp_group, self.timeout_s)  # type: ignore[arg-type]
            grads = [p.grad for p in params]
            norm = weighted_norm(
                _tp_pieces([(p, p.grad, 1) for p in params], self._topology.tp_size),  # type: ignore[misc]
                self._topology.tp_group,
                self.timeout_s,
                self.device,
            )
            clip_(grads, norm, _max_norm(max_norm))  # type: ignore[arg-type]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm)

    def state(self) -> dict[str, Any]:
        return {"model": _set(self._model, "state"), "optim": self.optimizer}


def _partial(p: torch.Tensor) -> bool:
    spec = tp_spec(p)
    return spec is not None and spec.partial_grad


class ZeroEngine:
    """ZeRO-2 (:class:`ms_parallel.ZeroDataParallel`) over the data-parallel group
    (``mesh["dp"]``, or ``process_group``; default: the world; one process without
    ``torch.distributed`` communicates nothing but keeps the same state form):
    reduce-scatter per bucket during backward, the optimizer on this rank's shards, the
    all-gather deferred into the next forward with chained prefetch. The first
    ``replicated_chunks`` chunks are all-reduced and stepped whole on every rank instead.

    With a mesh whose ``tp`` is above 1 the model must be tensor-parallel already; each
    TP rank's ZeRO shards its own parameters over its DP group. The sequence-parallel
    partial gradients are then summed over the TP group, and the norm and the
    optimizer's :class:`ShardSpec` span the dp x tp group, every element counted once.

    ``state_upgrade`` renames the parameters of an optimizer state saved in 0.3's
    per-bucket form (``ZeroDataParallel.load_optimizer_state_dict``); the other keyword
    arguments are :class:`ZeroDataParallel`'s.
    """

    name = "zero"

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        mesh: DeviceMesh | None = None,
        process_group: dist.ProcessGroup | None = None,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype | None = None,
        prefetch: bool = True,
        prefetch_chunks: int | None = None,
        timeout_s: float = 600.0,
        on_event: EventHook | None = None,
        replicated_chunks: int = 0,
        state_upgrade: StateUpgrade | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._topology = _resolve_topology(mesh, process_group)
        self.process_group = self._topology.dp_group if mesh is not None else process_group
        self.timeout_s = timeout_s
        self.state_upgrade = state_upgrade
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
        self._norm_group: dist.ProcessGroup | None = None

    @property
    def topology(self) -> Topology:
        return self._topology

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
        tp = self._topology.tp_size
        mesh = self._topology.mesh
        state_mesh = mesh["dp", "tp"] if mesh is not None and tp > 1 else None
        self.zero = zero = ZeroDataParallel(model, group, state_mesh=state_mesh, **self.options)
        groups = zero.optimizer_param_groups(param_groups)
        if tp == 1:
            spec = ShardSpec(
                zero.group_param_ids(groups),
                zero.param_numels,
                zero.group,
                replicated=zero.group_replicated(groups),
            )
        else:
            assert mesh is not None
            self._norm_group = flat_group(mesh)
            ids = zero.group_param_ids(groups)
            params = [p for p in model.parameters()]
            whole_dp = set(zero.group_replicated(groups))
            dp = self._topology.dp_size
            spec = ShardSpec(
                ids,
                tuple(_logical_numel(p, tp) for p in params),
                self._norm_group,
                replicas=tuple(
                    (dp if i in whole_dp else 1)
                    * (1 if (sp := tp_spec(params[k])) is not None and sp.dim is not None else tp)
                    for i, k in enumerate(ids)
                ),
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
        if self._topology.tp_size == 1:
            norm = zero.clip_grad_norm_(_max_norm(max_norm))
        else:
            norm = self._tp_clip(zero, _max_norm(max_norm))
        zero.step(self.optimizer)  # chunk by chunk where that is the same update
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, norm)

    def _tp_clip(self, zero: ZeroDataParallel, max_norm: float) -> torch.Tensor:
        shards = zero.local_shards()
        partial = [grad for p, _, grad, _ in shards if _partial(p)]
        sum_partial_grads(partial, self._topology.tp_group, self.timeout_s)
        dp = self._topology.dp_size
        pieces = _tp_pieces(
            [(p, grad, dp if whole else 1) for p, _, grad, whole in shards],
            self._topology.tp_size,
        )
        norm = weighted_norm(pieces, self._norm_group, self.timeout_s, self.device)
        clip_(zero.shard_grads(), norm, max_norm)
        return norm

    def state(self) -> dict[str, Any]:
        zero = _set(self.zero, "state")
        return {
            "model": _ZeroModelState(zero, _set(self._model, "state")),
            "optim": _ZeroOptimState(zero, self.optimizer, self.state_upgrade),
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
    def __init__(
        self,
        zero: ZeroDataParallel,
        optimizer: torch.optim.Optimizer,
        upgrade: StateUpgrade | None,
    ) -> None:
        self.zero, self.optimizer, self.upgrade = zero, optimizer, upgrade

    def state_dict(self) -> dict[str, Any]:
        return self.zero.optimizer_state_dict(self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zero.load_optimizer_state_dict(self.optimizer, state, self.upgrade)


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
