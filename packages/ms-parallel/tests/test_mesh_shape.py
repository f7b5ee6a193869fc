"""MeshShape: the pp x dp x tp rank layout and its validation, with no process group.

The layout is checked against properties stated independently of the formula: every
dim's groups partition the ranks, a group holds exactly the ranks whose other
coordinates agree, TP groups are runs of consecutive ranks, and the mesh tensor is
the one ``init_device_mesh`` builds for the same shape (``arange().reshape()``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from ms_parallel.mesh_shape import MESH_DIM_NAMES, MeshShape

sizes = st.integers(min_value=1, max_value=6)


@given(pp=sizes, dp=sizes, tp=sizes)
def test_layout_properties(pp: int, dp: int, tp: int) -> None:
    shape = MeshShape(pp=pp, dp=dp, tp=tp)
    world = pp * dp * tp
    assert shape.world_size == world and shape.sizes == (pp, dp, tp)
    coords = [shape.coordinate(r) for r in range(world)]
    # A bijection between ranks and the coordinate box, inverted by rank_at.
    assert sorted(coords) == list(itertools.product(range(pp), range(dp), range(tp)))
    assert all(shape.rank_at(*c) == r for r, c in enumerate(coords))
    # The DeviceMesh tensor puts each rank at its coordinate.
    mesh = shape.mesh_tensor()
    assert mesh.shape == (pp, dp, tp) and mesh.dtype == torch.int
    assert all(int(mesh[c]) == r for r, c in enumerate(coords))
    for d, dim in enumerate(MESH_DIM_NAMES):
        groups = shape.groups(dim)
        # The groups of one dim partition the ranks into groups of that dim's size.
        assert sorted(r for g in groups for r in g) == list(range(world))
        assert len(groups) == world // shape.sizes[d]
        assert [g[0] for g in groups] == sorted(g[0] for g in groups)
        for g in groups:
            assert g == sorted(g) and len(g) == shape.sizes[d]
            # Members agree on every other coordinate and cover this one.
            others = {tuple(c for i, c in enumerate(coords[r]) if i != d) for r in g}
            assert len(others) == 1
            assert sorted(coords[r][d] for r in g) == list(range(shape.sizes[d]))
            for r in g:
                assert shape.group_ranks(dim, r) == g
    for g in shape.groups("tp"):
        assert g == list(range(g[0], g[0] + tp)), "TP peers must be consecutive ranks"


@given(pp=sizes, dp=sizes, tp=sizes, data=st.data())
def test_resolve_fills_the_one_free_size(pp: int, dp: int, tp: int, data: st.DataObject) -> None:
    world = pp * dp * tp
    args = {"pp": pp, "dp": dp, "tp": tp}
    assert MeshShape.resolve(world, **args) == MeshShape(pp, dp, tp)
    free = data.draw(st.sampled_from(MESH_DIM_NAMES))
    assert MeshShape.resolve(world, **{**args, free: -1}) == MeshShape(pp, dp, tp)


@given(world=st.integers(1, 64), tp=st.integers(1, 8), lws=st.integers(1, 16))
def test_node_check_accepts_exactly_the_tp_that_divide_the_node(
    world: int, tp: int, lws: int
) -> None:
    assume(world % tp == 0)
    if lws % tp == 0:
        shape = MeshShape.resolve(world, tp=tp, local_world_size=lws)
        # Every TP group then lies inside one node of lws consecutive ranks.
        assert all(g[0] // lws == g[-1] // lws for g in shape.groups("tp"))
    else:
        with pytest.raises(ValueError, match=f"tp={tp} must divide .*local_world_size={lws}"):
            MeshShape.resolve(world, tp=tp, local_world_size=lws)


def test_defaults_put_every_rank_in_dp() -> None:
    assert MeshShape.resolve(8) == MeshShape(pp=1, dp=8, tp=1)
    assert str(MeshShape(2, 2, 2)) == "pp=2 x dp=2 x tp=2"


def test_layout_by_hand() -> None:
    shape = MeshShape(pp=2, dp=2, tp=2)
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.coordinate(6) == (1, 1, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 3}, r"pp=1 x dp=3 x tp=1 holds 3 ranks but the world size is 8"),
        ({"dp": 2, "tp": 2, "pp": 3}, r"pp=3 x dp=2 x tp=2 holds 12 ranks .* world size is 8"),
        ({"tp": 3}, r"dp=-1 takes what the world size 8 leaves after pp=1 x tp=3 = 3"),
        ({"dp": 4, "tp": -1, "pp": 3}, r"tp=-1 .* after pp=3 x dp=4 = 12, but 12 does not"),
        ({"tp": -1}, r"at most one of pp, dp, tp may be -1 .* dp=-1 x tp=-1"),
        ({"dp": 0}, r"dp must be an int >= 1, or -1 .* got 0"),
        ({"tp": -2}, r"tp must be an int >= 1, or -1 .* got -2"),
        ({"pp": 2.0}, r"pp must be an int >= 1, or -1 .* got 2.0"),
        ({"tp": True}, r"tp must be an int >= 1, or -1 .* got True"),
        ({"tp": 4, "local_world_size": 2}, r"tp=4 must divide .* local_world_size=2"),
        ({"tp": 4, "local_world_size": 6}, r"tp=4 must divide .* local_world_size=6"),
        ({"local_world_size": 0}, r"local_world_size \(ranks per node\) must be .* got 0"),
    ],
)
def test_resolve_refuses_with_the_numbers(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeshShape.resolve(8, **kwargs)  # type: ignore[arg-type]


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 0"):
        MeshShape.resolve(0)
    with pytest.raises(ValueError, match=r"tp must be an int >= 1, got 0"):
        MeshShape(pp=1, dp=1, tp=0)
    shape = MeshShape(2, 2, 2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 8\) .* got 8"):
        shape.coordinate(8)
    with pytest.raises(ValueError, match=r"dim must be one of \('pp', 'dp', 'tp'\), got 'ep'"):
        shape.groups("ep")
    with pytest.raises(ValueError, match=r"dp index must be an int in \[0, 2\), got 2"):
        shape.rank_at(0, 2, 0)
