"""Where every parameter lives in ZeRO's flat buffers, and which slice a rank owns.

Parameters are packed back to back into flat buckets, one chunk's parameters per
bucket (a chunk is gathered as a unit before its forward), one dtype per bucket,
each bucket up to a size cap. A parameter larger than the cap gets a bucket of its
own. The layout depends only on the module, the chunks and the cap, never on the
data-parallel size, so that a checkpoint of the sharded state reshards across DP
sizes by plain offsets.

A bucket of ``n`` elements is split over ``world`` ranks as ``torch.chunk`` splits a
tensor, which is also how a ``DTensor`` with ``Shard(0)`` places an uneven dimension:
every rank gets ``ceil(n / world)`` elements but the last ranks may get fewer or none.
Collectives need equal parts, so the buffers are padded to ``world * ceil(n / world)``
and the padding is never read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["BucketLayout", "ParamSlot", "plan_buckets", "shard_range"]


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in a bucket."""

    #: Position in the wrapped module's ``named_parameters()`` (shared ones once).
    index: int
    #: Its name there.
    name: str
    #: First element in the bucket's flat buffer.
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BucketLayout:
    """The parameters of one bucket and how its elements split across ranks."""

    index: int
    #: The chunk the bucket belongs to (its all-gather comes before the chunk's forward).
    chunk: int
    dtype: torch.dtype
    slots: tuple[ParamSlot, ...]

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def padded(self, world: int) -> int:
        """The length of the bucket's buffers for ``world`` ranks."""
        return world * shard_size(self.numel, world)

    def overlaps(self, rank: int, world: int) -> list[tuple[ParamSlot, int, int]]:
        """The parameters rank ``rank`` holds a slice of, each with the slice
        ``[lo, hi)`` in the parameter's own flat elements."""
        start, stop = shard_range(self.numel, rank, world)
        out = []
        for s in self.slots:
            lo, hi = max(start, s.offset), min(stop, s.offset + s.numel)
            if lo < hi:
                out.append((s, lo - s.offset, hi - s.offset))
        return out


def shard_size(numel: int, world: int) -> int:
    """Elements per rank in the padded buffer: ``ceil(numel / world)``."""
    _check_world(world)
    return math.ceil(numel / world)


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """The elements ``[start, stop)`` of ``numel`` that ``rank`` of ``world`` owns, as
    ``torch.chunk`` (and ``DTensor``'s ``Shard(0)``) split them; may be empty."""
    c = shard_size(numel, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    start = min(rank * c, numel)
    return start, min(start + c, numel)


def plan_buckets(
    chunks: Sequence[Sequence[nn.Module]],
    named: Sequence[tuple[str, nn.Parameter]],
    *,
    bucket_bytes: int,
) -> list[BucketLayout]:
    """Pack the trainable parameters of ``chunks`` (in order) into buckets.

    ``named`` is the wrapped module's ``named_parameters()``; a parameter shared by
    several chunks belongs to the first that holds it. Parameters of no chunk are
    refused: the caller puts the leftovers in a chunk of their own. A bucket closes
    before the parameter that would take it past ``bucket_bytes``.
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    index = {id(p): (i, name) for i, (name, p) in enumerate(named)}
    seen: set[int] = set()
    buckets: list[BucketLayout] = []
    for c, modules in enumerate(chunks):
        # One open bucket per dtype: its slots and its fill in elements.
        open_: dict[torch.dtype, list[ParamSlot]] = {}
        for module in modules:
            for p in module.parameters():
                if id(p) in seen or not p.requires_grad:
                    continue
                if id(p) not in index:
                    raise ValueError(
                        "chunks must hold submodules of the wrapped module; a parameter of "
                        f"shape {tuple(p.shape)} in chunk {c} is not one of its parameters"
                    )
                seen.add(id(p))
                i, name = index[id(p)]
                cap = max(1, bucket_bytes // p.element_size())
                slots = open_.setdefault(p.dtype, [])
                fill = slots[-1].offset + slots[-1].numel if slots else 0
                if fill and fill + p.numel() > cap:
                    buckets.append(BucketLayout(len(buckets), c, p.dtype, tuple(slots)))
                    slots = open_[p.dtype] = []
                    fill = 0
                slots.append(ParamSlot(i, name, fill, p.numel(), tuple(p.shape)))
        for dtype, slots in open_.items():
            if slots:
                buckets.append(BucketLayout(len(buckets), c, dtype, tuple(slots)))
    missing = [name for name, p in named if p.requires_grad and id(p) not in seen]
    if missing:
        raise ValueError(
            f"every trainable parameter must belong to a chunk; {len(missing)} do not, "
            f"e.g. {missing[:3]}"
        )
    return buckets


def _check_world(world: int) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
