"""Boxes: the region of a global tensor that one stored piece holds or one rank asks for,
as an offset and a size per dimension.

Pure arithmetic on ints, no torch: the stage-2 writer (which must not import torch)
checks with it that the saved pieces of a sharded tensor tile it, and the loader finds
with it which saved pieces overlap the region a live ``DTensor`` or ``Sharded`` holds.

Two kinds of records are pieces of a global tensor (docs/format.md): ``Sharded`` slices
(``"shard": {"global_shape", "dim", "offset"}``: one dimension cut, the others whole)
and ``DTensor`` pieces (``"dtensor": {"global_shape", "offset", "parts"}``: an offset
in every dimension). Both have the box ``(offset, shape)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset per dim, size per dim)


def intersect(a: Box, b: Box) -> Box | None:
    """The region two boxes of the same global tensor share, or None when they share no
    element (a box with a zero size shares nothing). Zero-dim boxes (a scalar) share it."""
    (a_lo, a_size), (b_lo, b_size) = a, b
    if not len(a_lo) == len(a_size) == len(b_lo) == len(b_size):
        raise ValueError(f"boxes must have the same number of dimensions, got {a} and {b}")
    lo: list[int] = []
    size: list[int] = []
    for al, an, bl, bn in zip(a_lo, a_size, b_lo, b_size, strict=True):
        start, end = max(al, bl), min(al + an, bl + bn)
        if end <= start:
            return None
        lo.append(start)
        size.append(end - start)
    return tuple(lo), tuple(size)


def volume(box: Box) -> int:
    return math.prod(box[1])


def tiling_error(global_shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``global_shape`` exactly once, or None.

    The pieces a DTensor's placements make form a grid: along each dimension the
    non-empty pieces' intervals split ``[0, size)`` into consecutive intervals, and every
    combination of one interval per dimension is exactly one piece. Empty pieces (a rank
    whose shard holds nothing) must lie inside the tensor and are otherwise ignored.
    """
    shape = tuple(global_shape)
    for lo, size in boxes:
        if len(lo) != len(shape) or len(size) != len(shape):
            return f"a piece at {list(lo)} of size {list(size)} has not {len(shape)} dimensions"
        if any(o < 0 or n < 0 or o + n > g for o, n, g in zip(lo, size, shape, strict=True)):
            return f"a piece at {list(lo)} of size {list(size)} lies outside {list(shape)}"
    full = [b for b in boxes if volume(b) > 0]
    if math.prod(shape) == 0:
        return None  # nothing to cover; every piece is empty (checked above)
    cells = 1
    for d, g in enumerate(shape):
        intervals = sorted({(lo[d], size[d]) for lo, size in full})
        end = 0
        for start, n in intervals:
            if start != end:
                what = "overlap" if start < end else "leave a gap"
                return f"along dim {d} the pieces {what} at {min(start, end)}"
            end = start + n
        if end != g:
            return f"along dim {d} the pieces cover [0, {end}) of {g}"
        cells *= len(intervals)
    distinct = {tuple(b) for b in full}
    if len(distinct) != len(full):
        return "two pieces hold the same region"
    if len(full) != cells:
        return f"the pieces cover {len(full)} of the {cells} cells of their grid"
    return None


def is_piece(rec: dict[str, Any]) -> bool:
    """A record that holds one piece of a global tensor (``Sharded`` or ``DTensor``)."""
    return "shard" in rec or "dtensor" in rec


def box_of(rec: dict[str, Any]) -> Box:
    """The region of its global tensor a piece record holds."""
    size = tuple(rec["shape"])
    if "dtensor" in rec:
        return tuple(rec["dtensor"]["offset"]), size
    lo = [0] * len(size)
    lo[rec["shard"]["dim"]] = rec["shard"]["offset"]
    return tuple(lo), size


def global_shape_of(rec: dict[str, Any]) -> tuple[int, ...]:
    info = rec["dtensor"] if "dtensor" in rec else rec["shard"]
    return tuple(info["global_shape"])


def parts_of(rec: dict[str, Any]) -> list[int]:
    """The parts whose state holds this piece's global tensor: a DTensor's mesh may span
    several (tensor-parallel ranks); a ``Sharded`` slice belongs to its writer's part."""
    if "dtensor" in rec:
        return list(rec["dtensor"]["parts"])
    return [rec["part"]]


def whole(shape: Sequence[int]) -> Box:
    return (0,) * len(shape), tuple(shape)
