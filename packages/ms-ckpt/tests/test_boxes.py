"""The box arithmetic behind DTensor and Sharded resharding, in one process: overlaps
against an element-by-element count, grid tilings that pass and broken ones that are
refused, assembling any region from any tiling, and the split of reads over a DP group."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ms_ckpt import _boxes
from ms_ckpt._boxes import Box
from ms_ckpt._plan import Layout, assign_readers, dtensor_scope
from ms_ckpt._reader import assemble, cut


def chunks(n: int, k: int) -> list[tuple[int, int]]:
    """(offset, size) of each of ``k`` shards of ``n`` rows, as torch.chunk splits them
    (the last ranks hold fewer rows, possibly none, sitting at ``n``)."""
    step = -(-n // k) if n else 0
    out = []
    for i in range(k):
        lo = min(i * step, n)
        out.append((lo, min(step, n - lo)))
    return out


@st.composite
def grids(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    """A global shape and the boxes of a grid split of it (each dim cut in ``k`` chunks)."""
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
    cuts = [chunks(n, draw(st.integers(1, 4))) for n in shape]
    boxes: list[Box] = [((), ())]
    for dim_cuts in cuts:
        boxes = [((*lo, o), (*size, s)) for lo, size in boxes for o, s in dim_cuts]
    return shape, boxes


def mask(shape: tuple[int, ...], box: Box) -> torch.Tensor:
    m = torch.zeros(shape, dtype=torch.bool)
    cut(m, *box).fill_(True)
    return m


@st.composite
def two_boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, Box]:
    shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))

    def box() -> Box:
        lo, size = [], []
        for n in shape:
            o = draw(st.integers(0, n))
            lo.append(o)
            size.append(draw(st.integers(0, n - o)))
        return tuple(lo), tuple(size)

    return shape, box(), box()


@given(two_boxes())
def test_intersect_is_the_elements_both_boxes_hold(case: tuple[tuple[int, ...], Box, Box]) -> None:
    shape, a, b = case
    both = mask(shape, a) & mask(shape, b)
    common = _boxes.intersect(a, b)
    if common is None:
        assert not both.any()
    else:
        assert torch.equal(mask(shape, common), both) and _boxes.volume(common) > 0
    assert common == _boxes.intersect(b, a)


@given(grids())
def test_a_grid_split_tiles_and_any_region_assembles_from_it(
    case: tuple[tuple[int, ...], list[Box]],
) -> None:
    shape, boxes = case
    assert _boxes.tiling_error(shape, boxes) is None
    # Box offsets and sizes come from the chunk arithmetic, not from tensor slicing.
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    pieces = [(b, cut(full, *b).clone()) for b in boxes]
    for want in [*boxes, _boxes.whole(shape)]:
        out = torch.full(want[1], -1.0, dtype=torch.float64)
        assert torch.equal(assemble(out, want, pieces), cut(full, *want))


@given(grids(), st.data())
def test_a_broken_tiling_is_refused(
    case: tuple[tuple[int, ...], list[Box]], data: st.DataObject
) -> None:
    shape, boxes = case
    full = [b for b in boxes if _boxes.volume(b) > 0]
    if not full:
        return  # nothing to break: an empty tensor has no non-empty piece
    i = data.draw(st.integers(0, len(full) - 1))
    how = data.draw(st.sampled_from(["drop", "twice", "grow"] if shape else ["drop", "twice"]))
    broken = [b for b in boxes if b != full[i]]
    if how == "twice":
        broken += [full[i], full[i]]
    elif how == "grow":  # one more row along a dim: out of bounds, or over a neighbour
        lo, size = full[i]
        d = data.draw(st.integers(0, len(shape) - 1))
        broken.append((lo, (*size[:d], size[d] + 1, *size[d + 1 :])))
    assert _boxes.tiling_error(shape, broken) is not None


def test_tiling_errors_say_what_is_wrong() -> None:
    assert "lies outside [4]" in str(_boxes.tiling_error((4,), [((2,), (3,))]))
    assert "along dim 0 the pieces cover [0, 2) of 4" in str(
        _boxes.tiling_error((4,), [((0,), (2,))])
    )
    assert "overlap at 1" in str(_boxes.tiling_error((4,), [((0,), (2,)), ((1,), (3,))]))
    assert "leave a gap at 1" in str(_boxes.tiling_error((4,), [((0,), (1,)), ((2,), (2,))]))
    # Both intervals of each dim are there, but one cell of the 2 x 2 grid is missing.
    three = [((0, 0), (1, 1)), ((1, 1), (1, 1)), ((0, 1), (1, 1))]
    assert "cover 3 of the 4 cells" in str(_boxes.tiling_error((2, 2), three))
    with pytest.raises(ValueError, match="same number of dimensions"):
        _boxes.intersect(((0,), (1,)), ((0, 0), (1, 1)))


@given(
    st.lists(
        st.tuples(st.integers(0, 1000), st.booleans(), st.sets(st.integers(0, 3), min_size=1)),
        max_size=30,
    )
)
def test_each_record_is_read_by_one_rank_that_needs_it(
    raw: list[tuple[int, bool, set[int]]],
) -> None:
    items = [(f"k{i}", size, tensor, tuple(sorted(js))) for i, (size, tensor, js) in enumerate(raw)]
    readers = assign_readers(items, 4)
    assert readers == assign_readers(items, 4)  # every rank computes the same split
    for (_, _, _, needers), j in zip(items, readers, strict=True):
        assert j in needers


def _layout(groups: tuple[tuple[int, ...], ...], rank: int) -> Layout:
    part = next(p for p, g in enumerate(groups) if rank in g)
    g = groups[part]
    return Layout(
        rank=rank,
        world_size=sum(map(len, groups)),
        part=part,
        parts=len(groups),
        dp_rank=g.index(rank),
        dp_size=len(g),
        dp_ranks=g,
        nonce="n",
        groups=groups,
    )


def test_dtensor_scope_by_how_the_mesh_meets_the_dp_group() -> None:
    groups = ((0, 2), (1, 3))  # 2 parts (tensor-parallel ranks) x DP 2
    part_of = {0: 0, 2: 0, 1: 1, 3: 1}
    lay = _layout(groups, 2)
    # ZeRO over the "dp" mesh dim: the mesh is this part's DP group.
    assert dtensor_scope("z", (0, 2), lay, part_of) == ([0], False)
    # The whole mesh: every part, the DP group inside it.
    assert dtensor_scope("f", (0, 1, 2, 3), lay, part_of) == ([0, 1], False)
    # Tensor parallel inside one DP replica: replicated across DP.
    assert dtensor_scope("w", (2, 3), lay, part_of) == ([0, 1], True)
    with pytest.raises(ValueError, match=r"state\['x'\]: the DTensor's mesh has ranks \[7\]"):
        dtensor_scope("x", (2, 7), lay, part_of)
    wide = _layout(((0, 1, 2, 3),), 1)
    with pytest.raises(ValueError, match=r"must contain this rank's whole data-parallel group"):
        dtensor_scope("h", (0, 1), wide, {r: 0 for r in range(4)})
