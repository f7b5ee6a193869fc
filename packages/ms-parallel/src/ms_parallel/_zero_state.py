"""ZeRO's sharded optimizer state as PyTorch's own ``DTensor``, for any optimizer.

The optimizer holds state per shard view (a 1-D slice of one parameter). A checkpoint
wants something that reshards across DP sizes, and a view's slice boundaries move with
the DP size. The bucket is what stays: for every bucket and every per-element state key
(``exp_avg``, ``exp_avg_sq``, an fp32 master...) the state of the whole bucket is one
1-D ``DTensor`` with ``Shard(0)`` on the data-parallel mesh, each rank's local part
being exactly its shard (``torch.chunk`` placement, as ``_layout`` splits buckets).
A checkpointer that understands DTensor (ms-ckpt, torch.distributed.checkpoint)
reshards it to any DP size by offsets. A bucket of a replicated chunk is whole on
every rank and saved as a DTensor with ``Replicate()``: the global tensor is the same
either way, so state saved with one ``replicated_chunks`` loads with another.

Per-parameter scalars (a ``step`` count) are gathered to every rank and saved once per
parameter by name; hyperparameters of the param groups are saved without their
``params`` lists. The layout (parameter names, offsets and sizes per bucket) is saved
too and must match on load: it depends on the model, the chunks and ``bucket_mb``,
never on the DP size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# DTensor is imported where state is built or read (half a second of imports, sympy's
# among them), so that a process that never saves or loads does not pay for it.
if TYPE_CHECKING:
    from ms_parallel.zero import ZeroDataParallel

__all__ = ["load_optimizer_state_dict", "optimizer_state_dict"]

FORMAT = 1


def layout_of(zero: ZeroDataParallel) -> list[list[list[Any]]]:
    """Per bucket, ``[name, offset, numel]`` of each parameter: what must match."""
    return [[[s.name, s.offset, s.numel] for s in b.layout.slots] for b in zero.buckets]


def optimizer_state_dict(
    zero: ZeroDataParallel, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """``optimizer``'s state in the DP-size independent form (collective over the group)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = zero.device_mesh() if zero.group is not None else None
    per_param: dict[str, dict[str, Any]] = {}
    keys: dict[int, dict[str, torch.dtype]] = {}
    for b in zero.buckets:
        for s, *_, view, _ in b.local:
            st = optimizer.state.get(view, {})
            for key, value in st.items():
                if _is_elementwise(value, view):
                    keys.setdefault(b.layout.index, {})[key] = value.dtype
                else:
                    per_param.setdefault(s.name, {})[key] = _plain(value)
    # Every rank must agree on the keys, also ranks that hold nothing of a bucket, and
    # every rank needs every parameter's scalars: one small object all-gather.
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
    buckets: dict[str, dict[str, torch.Tensor]] = {}
    for b in zero.buckets:
        n = b.layout.numel
        local_n = max(0, min(b.shard, n - b.lo))
        for key, dtype in sorted(all_keys.get(b.layout.index, {}).items()):
            local = torch.zeros(local_n, dtype=dtype, device=zero.device)
            for s, lo, hi, view, _ in b.local:
                st = optimizer.state.get(view, {})
                if key not in st:
                    raise ValueError(
                        f"optimizer state {key!r} exists for some parameters of bucket "
                        f"{b.layout.index} but not for {s.name!r}: ZeRO saves a bucket's "
                        "per-element state as one tensor"
                    )
                a = s.offset + lo - b.lo
                local[a : a + hi - lo].copy_(st[key].reshape(-1))
            placement = Replicate() if b.replicated else Shard(0)
            buckets.setdefault(f"bucket{b.layout.index}", {})[key] = (
                local  # one process: the whole bucket
                if mesh is None
                else DTensor.from_local(
                    local, mesh, [placement], run_check=False, shape=torch.Size([n]), stride=(1,)
                )
            )
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {
        "format": FORMAT,
        "layout": layout_of(zero),
        "buckets": buckets,
        "params": scalars,
        "param_groups": groups,
    }


def load_optimizer_state_dict(
    zero: ZeroDataParallel, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put ``state`` (from :func:`optimizer_state_dict`, at any DP size) into ``optimizer``.

    Bucket entries may be DTensors on this run's mesh (a resharding checkpointer
    filled them), sharded or replicated, or full tensors; either way this rank takes
    its shard, or the whole of a replicated bucket.
    """
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"ZeRO optimizer state must have format {FORMAT}, got {got!r}")
    saved, here = state["layout"], layout_of(zero)
    if [[list(x) for x in b] for b in saved] != here:
        raise ValueError(
            "the saved ZeRO optimizer state has another bucket layout than this run "
            f"({len(saved)} buckets saved, {len(here)} here): the model, the chunks or "
            "bucket_mb changed"
        )
    if len(state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"the saved state has {len(state['param_groups'])} param groups, the optimizer "
            f"{len(optimizer.param_groups)}"
        )
    for g, saved_g in zip(optimizer.param_groups, state["param_groups"], strict=True):
        g.update({k: v for k, v in saved_g.items() if k != "params"})
    for b in zero.buckets:
        entries = state["buckets"].get(f"bucket{b.layout.index}", {})
        n = b.layout.numel
        stop = max(b.lo, min(b.lo + b.shard, n))
        for key, value in entries.items():
            local = _local_part(value, b.lo, stop, n, key, b.layout.index, b.replicated)
            for s, lo, hi, view, _ in b.local:
                a = s.offset + lo - b.lo
                optimizer.state.setdefault(view, {})[key] = (
                    local[a : a + hi - lo].to(zero.device).clone()
                )
        for s, *_, view, _ in b.local:
            for key, value in state["params"].get(s.name, {}).items():
                optimizer.state.setdefault(view, {})[key] = (
                    value.clone() if isinstance(value, torch.Tensor) else value
                )


def _local_part(
    value: torch.Tensor, start: int, stop: int, n: int, key: str, bucket: int, whole: bool
) -> torch.Tensor:
    """Elements ``[start, stop)`` of the saved bucket (all ``n`` when ``whole``)."""
    from torch.distributed.tensor import DTensor, Replicate

    if tuple(value.shape) != (n,):
        raise ValueError(
            f"saved ZeRO state bucket{bucket}/{key} has shape {tuple(value.shape)}, expected ({n},)"
        )
    if isinstance(value, DTensor):
        if all(isinstance(p, Replicate) for p in value.placements):
            return value.to_local()[start:stop]
        if whole:
            # A replicated bucket handed over sharded: every rank gathers it (every
            # rank replicates the same buckets, so all of them take this branch).
            return value.full_tensor()
        local = value.to_local()
        if local.numel() != stop - start:
            raise ValueError(
                f"saved ZeRO state bucket{bucket}/{key} is placed as {value.placements} "
                f"with {local.numel()} local elements; this rank owns {stop - start}"
            )
        return local
    return value[start:stop]


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
