"""What ms-ckpt needs of a ``torch.distributed.tensor.DTensor``: its box, its mesh's ranks,
whether this rank writes its piece for the replicas, its local shard, and a new DTensor
laid out like a live one.

A DTensor is this rank's piece of a global tensor on a ``DeviceMesh``. Only ``Shard(d)``
and ``Replicate()`` placements give a piece that is a box of the global tensor; the
others are refused, naming the path: ``Partial`` holds a pending reduction (its pieces
are addends, not regions), and ``_StridedShard`` (FSDP2 over tensor parallelism) and a
non-default shard order interleave rows across ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ms_ckpt._boxes import Box


@functools.cache
def _dtensor_type() -> type | None:
    # Imported on first use: torch builds without distributed support have no DTensor,
    # and then no state can hold one.
    if not dist.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(x: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


@dataclass(frozen=True)
class Piece:
    """This rank's piece of a DTensor, for a save."""

    local: torch.Tensor  # the local shard, detached (no copy)
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    mesh_ranks: tuple[int, ...]  # global ranks of the DTensor's mesh
    # Coordinate 0 along every Replicate mesh dimension: of the mesh ranks that hold this
    # same piece, this one writes it.
    replica_writer: bool


def _check_placements(x: Any, path: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    for i, p in enumerate(x.placements):
        if type(p) is Shard or type(p) is Replicate:
            continue
        if p.is_partial():
            why = (
                "a pending reduction: each rank holds an addend, not a region; "
                "redistribute it to Replicate() or Shard(d) first"
            )
        elif type(p).__name__ == "_StridedShard":
            why = "strided sharding interleaves rows across ranks; redistribute it first"
        else:
            why = "only Shard(d) and Replicate() are supported"
        raise TypeError(
            f"state[{path!r}]: DTensor placement {p} on mesh dim {i} is not supported ({why}); "
            f"placements {tuple(x.placements)}"
        )
    spec = getattr(x, "_spec", None)
    order = getattr(spec, "shard_order", None)
    default = getattr(type(spec), "compute_default_shard_order", None)
    if order is not None and default is not None and tuple(order) != tuple(default(x.placements)):
        raise TypeError(
            f"state[{path!r}]: the DTensor shards a dimension over several mesh dimensions "
            f"in a non-default order {order}; redistribute it to the default order first"
        )


def region(x: Any, path: str) -> Box:
    """The box of the global tensor this rank's local shard of ``x`` covers.

    Raises TypeError for placements without a box (see the module docstring) and
    ValueError when this rank is not in the mesh or the local shard's shape is not the
    one the placements give (a ``DTensor.from_local`` with a wrong ``shape``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _check_placements(x, path)
    mesh = x.device_mesh
    if mesh.get_coordinate() is None:
        raise ValueError(f"state[{path!r}]: this rank is not in the DTensor's mesh {mesh}")
    shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, x.placements)
    held = tuple(local(x).shape)
    if tuple(shape) != held:
        raise ValueError(
            f"state[{path!r}]: the DTensor's local shard has shape {held}, but its "
            f"placements {tuple(x.placements)} on a mesh of shape {tuple(mesh.shape)} give "
            f"{tuple(shape)} for a global shape {tuple(x.shape)} (shards split as "
            "torch.chunk does)"
        )
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def piece(x: Any, path: str) -> Piece:
    """This rank's piece of ``x``, for a save (the local shard only, never the whole)."""
    from torch.distributed.tensor import Replicate

    offset, _ = region(x, path)
    coord = x.device_mesh.get_coordinate()
    writer = all(c == 0 for c, p in zip(coord, x.placements, strict=True) if type(p) is Replicate)
    return Piece(
        local=local(x).detach(),
        global_shape=tuple(x.shape),
        offset=offset,
        mesh_ranks=tuple(int(r) for r in x.device_mesh.mesh.flatten().tolist()),
        replica_writer=writer,
    )


def local(x: Any) -> torch.Tensor:
    """The local shard itself (not a copy): what a load writes into."""
    with torch.no_grad():  # to_local() outside no_grad returns an autograd view
        out: torch.Tensor = x.to_local()
    return out


def like(value: torch.Tensor, live: Any) -> Any:
    """A DTensor with ``value`` as its local shard, on ``live``'s mesh and placements: what
    a ``Stateful``'s ``load_state_dict`` gets where its live state holds a DTensor."""
    cls = _dtensor_type()
    assert cls is not None  # a live DTensor exists
    return cls.from_local(  # type: ignore[attr-defined]
        value.to(local(live).device),
        live.device_mesh,
        live.placements,
        run_check=False,
        shape=live.shape,
        stride=live.stride(),
    )
