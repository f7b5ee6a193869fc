"""ZeRO's sharded optimizer state as PyTorch's own ``DTensor``, keyed by parameter name.

The optimizer holds state per shard view: a 1-D slice of one parameter, cut wherever
the data-parallel (DP) boundaries of its flat bucket fall. That cut moves with the DP
size, the bucket size, the chunks and, under tensor parallelism (TP), with the TP size,
which changes every parameter's local shape. What stays is the parameter: for every
parameter and every per-element state key (``exp_avg``, ``exp_avg_sq``, an fp32
master...), the state is saved as one ``DTensor`` of the parameter's unsplit shape (the
TP 1 model's, without vocabulary padding):

- along the TP mesh dimension it is placed as the parameter is (``Shard(d)`` for a
  split parameter, ``Replicate()`` for one whole on every TP rank);
- along the DP mesh dimension it is ``Shard`` on another tensor dimension (the first one
  TP does not split), so that each rank's piece is a plain box; ``Replicate()`` for a
  replicated chunk's parameter, and for a 1-D parameter that TP splits.

A checkpointer that understands ``DTensor`` (ms-ckpt, ``torch.distributed.checkpoint``)
reshards it to any DP size, TP size, bucket layout or ``replicated_chunks``. Building it
all-gathers one bucket at a time over DP (a bucket's state, transiently, on every rank);
loading redistributes one parameter at a time.

Per-parameter scalars (a ``step`` count) are saved once per parameter by name;
hyperparameters of the param groups without their ``params`` lists. Format 1 (0.3's,
per bucket, checked against the bucket layout) still loads: its buckets are cut back
into parameters by its saved layout, and an optional ``upgrade`` callable may rename
them (a model whose parameter names changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ms_parallel.tensor_parallel import TPSpec, contiguous_strides, shard_range, tp_spec

# DTensor is imported where state is built or read (half a second of imports, sympy's
# among them), so that a process that never saves or loads does not pay for it.
if TYPE_CHECKING:
    from ms_parallel.zero import ZeroDataParallel, _Bucket

__all__ = ["FORMAT", "StateUpgrade", "load_optimizer_state_dict", "optimizer_state_dict"]

FORMAT = 2

#: ``upgrade(name, flat)``: a parameter's name in an older state, and one of its state
#: tensors flattened (None for its scalars), to today's name and tensor (a model whose
#: parameter names or row order changed).
StateUpgrade = Callable[[str, torch.Tensor | None], tuple[str, torch.Tensor | None]]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def layout_of(zero: ZeroDataParallel) -> list[list[list[Any]]]:
    """Per bucket, ``[name, offset, numel]`` of each parameter (format 1's check)."""
    return [[[s.name, s.offset, s.numel] for s in b.layout.slots] for b in zero.buckets]


class _Placer:
    """Where each parameter's state lives: its global shape, this rank's box in it, and the
    DTensor placements on the state mesh."""

    def __init__(self, zero: ZeroDataParallel) -> None:
        self.zero = zero
        self.mesh = zero.state_device_mesh() if zero.group is not None else None
        self.two_d = self.mesh is not None and self.mesh.ndim == 2

    def spec(self, param: torch.Tensor) -> TPSpec | None:
        spec = tp_spec(param)
        return spec if spec is not None and self.two_d and spec.comm.size > 1 else None

    def global_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        spec = self.spec(param)
        return tuple(param.shape) if spec is None else spec.global_shape

    def real(self, param: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """``t`` (shaped like this rank's TP part) without its padded rows."""
        spec = self.spec(param)
        if spec is None or spec.dim is None:
            return t
        lo, hi = spec.local_range()
        return t.narrow(spec.dim, 0, hi - lo)

    def dp_dim(self, param: torch.Tensor, replicated: bool) -> int | None:
        """The tensor dimension DP splits the saved state along (None: replicated)."""
        if replicated or param.dim() == 0:
            return None
        spec = self.spec(param)
        taken = None if spec is None else spec.dim
        return next((d for d in range(param.dim()) if d != taken), None)

    def placements(self, param: torch.Tensor, replicated: bool) -> list[Any]:
        from torch.distributed.tensor import Replicate, Shard

        d = self.dp_dim(param, replicated)
        out: list[Any] = [Replicate() if d is None else Shard(d)]
        if self.two_d:
            spec = self.spec(param)
            out.append(Replicate() if spec is None or spec.dim is None else Shard(spec.dim))
        return out

    def to_state(self, param: torch.Tensor, local: torch.Tensor, replicated: bool) -> Any:
        """This rank's whole TP part ``local`` of a state tensor, as its saved form."""
        from torch.distributed.tensor import DTensor

        real = self.real(param, local)
        if self.mesh is None:
            return real.clone()
        d = self.dp_dim(param, replicated)
        if d is not None:
            lo, hi = shard_range(real.shape[d], self.zero.world, self.zero.rank)
            real = real.narrow(d, lo, hi - lo)
        shape = torch.Size(self.global_shape(param))
        return DTensor.from_local(
            real.contiguous(),
            self.mesh,
            self.placements(param, replicated),
            run_check=False,
            shape=shape,
            stride=contiguous_strides(shape),
        )

    def from_state(self, param: torch.Tensor, value: Any, key: str) -> torch.Tensor:
        """The whole TP part (padded like ``param``) of a saved state tensor ``value``."""
        from torch.distributed.tensor import DTensor

        shape = self.global_shape(param)
        if tuple(value.shape) != shape:
            raise ValueError(
                f"saved ZeRO state {key} has shape {tuple(value.shape)}, expected {shape} "
                "(the parameter's unsplit shape)"
            )
        spec = self.spec(param)
        if isinstance(value, DTensor):
            if self.mesh is not None and value.device_mesh == self.mesh:
                want = self.placements(param, True)  # whole over DP, TP as the parameter
                part = value.redistribute(self.mesh, want).to_local()
            else:
                part = _local(value.full_tensor(), spec)
        else:
            part = _local(value, spec)
        if spec is not None and spec.dim is not None and part.shape != param.shape:
            padded = torch.zeros(param.shape, dtype=part.dtype, device=part.device)
            padded.narrow(spec.dim, 0, part.shape[spec.dim]).copy_(part)
            return padded
        return part


def _bucket_keys(
    zero: ZeroDataParallel, optimizer: torch.optim.Optimizer
) -> tuple[dict[int, dict[str, torch.dtype]], dict[str, dict[str, Any]]]:
    """Per bucket, its per-element state keys; per parameter, its scalar state: the
    union over the DP group (a rank may hold nothing of a bucket)."""
    per_param: dict[str, dict[str, Any]] = {}
    keys: dict[int, dict[str, torch.dtype]] = {}
    for b in zero.buckets:
        for s, *_, view, _ in b.local:
            for key, value in optimizer.state.get(view, {}).items():
                if _is_elementwise(value, view):
                    keys.setdefault(b.layout.index, {})[key] = value.dtype
                else:
                    per_param.setdefault(s.name, {})[key] = _plain(value)
    everyone: list[Any] = [(keys, per_param)]
    if zero.group is not None:
        everyone = [None] * zero.world
        dist.all_gather_object(everyone, (keys, per_param), group=zero.group)
    all_keys: dict[int, dict[str, torch.dtype]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for their_keys, their_params in everyone:
        for i, ks in their_keys.items():
            all_keys.setdefault(i, {}).update(ks)
        for name, values in their_params.items():
            scalars.setdefault(name, {}).update(values)
    return all_keys, scalars


def _whole_bucket(
    zero: ZeroDataParallel, b: _Bucket, optimizer: torch.optim.Optimizer, key: str, dtype: Any
) -> torch.Tensor:
    """The bucket's state ``key`` over the whole (padded) bucket: this rank's shard,
    all-gathered over DP unless the bucket is whole on every rank."""
    local = torch.zeros(b.shard, dtype=dtype, device=zero.device)
    for s, lo, hi, view, _ in b.local:
        st = optimizer.state.get(view, {})
        if key not in st:
            raise ValueError(
                f"optimizer state {key!r} exists for some parameters of bucket "
                f"{b.layout.index} but not for {s.name!r}: ZeRO saves a bucket's "
                "per-element state alike"
            )
        a = s.offset + lo - b.lo
        local[a : a + hi - lo].copy_(st[key].reshape(-1))
    if b.replicated or zero.group is None:
        return local
    whole = torch.empty(b.shard * zero.world, dtype=dtype, device=zero.device)
    _all_gather(whole, local, group=zero.group)
    return whole


def optimizer_state_dict(
    zero: ZeroDataParallel, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer``'s state in the layout-free form (collective over the DP group)."""
    placer = _Placer(zero)
    keys, scalars = _bucket_keys(zero, optimizer)
    params: dict[str, dict[str, Any]] = {}
    for b in zero.buckets:
        for key, dtype in sorted(keys.get(b.layout.index, {}).items()):
            whole = _whole_bucket(zero, b, optimizer, key, dtype)
            for s in b.layout.slots:
                param = zero._params[s.index]
                local = whole[s.offset : s.offset + s.numel].view(s.shape)
                params.setdefault(s.name, {})[key] = placer.to_state(param, local, b.replicated)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"format": FORMAT, "params": params, "scalars": scalars, "param_groups": groups}


def load_optimizer_state_dict(
    zero: ZeroDataParallel,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    upgrade: StateUpgrade | None = None,
) -> None:
    """Put ``state`` (from :func:`optimizer_state_dict`, saved at any DP or TP size, any
    bucket layout; or format 1) into ``optimizer``.

    A parameter's entries may be DTensors on this run's state mesh (a resharding
    checkpointer filled them) or whole tensors of the parameter's unsplit shape.
    """
    if not isinstance(state, dict) or state.get("format") not in (1, FORMAT):
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"ZeRO optimizer state must have format 1 or {FORMAT}, got {got!r}")
    if state["format"] == 1:
        state = _from_format1(zero, state, upgrade)
    if len(state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the saved state has {len(state['param_groups'])} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    saved, names = state["params"], set(zero.param_names)
    unknown = sorted(set(saved) - names)
    if unknown:
        raise ValueError(
            f"the saved ZeRO optimizer state holds parameters this model does not have: "
            f"{unknown[:3]}{' ...' if len(unknown) > 3 else ''}"
        )
    placer = _Placer(zero)
    loaded: dict[int, dict[str, torch.Tensor]] = {}  # slot index -> key -> flat TP part
    for b in zero.buckets:
        for s in b.layout.slots:
            param = zero._params[s.index]
            for key, value in saved.get(s.name, {}).items():
                part = placer.from_state(param, value, f"{s.name}/{key}")
                loaded.setdefault(s.index, {})[key] = part.reshape(-1)
    for g, saved_g in zip(optimizer.param_groups, state["param_groups"], strict=True):
        g.update({k: v for k, v in saved_g.items() if k != "params"})
    for b in zero.buckets:
        for s, lo, hi, view, _ in b.local:
            entry = optimizer.state.setdefault(view, {})
            for key, flat in loaded.get(s.index, {}).items():
                entry[key] = flat[lo:hi].to(zero.device).clone()
            for key, value in state["scalars"].get(s.name, {}).items():
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value


def _from_format1(
    zero: ZeroDataParallel, state: dict[str, Any], upgrade: StateUpgrade | None
) -> dict[str, Any]:
    """Format 1 (per bucket) cut into whole parameters by its saved layout."""
    from torch.distributed.tensor import DTensor

    flat: dict[str, dict[str, torch.Tensor]] = {}
    for i, slots in enumerate(state["layout"]):
        for key, value in state["buckets"].get(f"bucket{i}", {}).items():
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            for name, offset, numel in slots:
                part = whole[offset : offset + numel]
                if upgrade is not None:
                    name, converted = upgrade(name, part)
                    assert converted is not None
                    part = converted
                flat.setdefault(name, {})[key] = part
    scalars = {
        (name if upgrade is None else upgrade(name, None)[0]): values
        for name, values in state["params"].items()
    }
    placer = _Placer(zero)
    shapes = {
        s.name: placer.global_shape(zero._params[s.index])
        for b in zero.buckets
        for s in b.layout.slots
    }
    missing = sorted(set(shapes) - set(flat))
    if flat and missing:
        raise ValueError(
            "the saved ZeRO optimizer state (format 1) has another set of parameters than "
            f"this model: it lacks {missing[:3]}"
        )
    params = {
        name: {key: t.reshape(shapes[name]) for key, t in entries.items()}
        for name, entries in flat.items()
    }
    return {
        "format": FORMAT,
        "params": params,
        "scalars": scalars,
        "param_groups": state["param_groups"],
    }


def _is_elementwise(value: Any, view: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == view.shape


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() > 0:
            raise ValueError(
                f"ZeRO can save per-element and scalar optimizer state; got a tensor of "
                f"shape {tuple(value.shape)}"
            )
        return value.detach().cpu().clone()
    return value


def _local(whole: torch.Tensor, spec: TPSpec | None) -> torch.Tensor:
    return whole if spec is None else spec.narrow_local(whole)
