"""build_mesh on real gloo ranks: the groups, their collectives, torch's own mesh, the errors.

Expected groups come from the layout's definition written out here (rank =
(pp_i * dp + dp_i) * tp + tp_i), not from MeshShape. Each group is also checked by a
collective: an all-reduce of ``2 ** rank`` over it yields the bit set of exactly the
ranks it connected. Where ``init_device_mesh`` builds the same layout, the two meshes
must agree. The store test counts every store request a rank makes while it builds
its mesh, through ``ms_testing.store.CountingStore`` wrapped around the real TCPStore.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ms_parallel.mesh import build_mesh
from ms_parallel.mesh_shape import MESH_DIM_NAMES, MeshShape
from ms_testing import run_ranks
from ms_testing.store import CountingStore

Shape = tuple[int, int, int]
SHAPES_4: list[Shape] = [(1, 4, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1), (4, 1, 1), (1, 1, 4)]
SHAPES_8: list[Shape] = [(2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 8, 1)]


def expected_group(shape: Shape, dim: str, rank: int) -> list[int]:
    pp, dp, tp = shape
    if dim == "tp":
        start = rank - rank % tp
        return list(range(start, start + tp))
    if dim == "dp":
        base = rank // (dp * tp) * dp * tp + rank % tp
        return [base + j * tp for j in range(dp)]
    return [i * dp * tp + rank % (dp * tp) for i in range(pp)]


def describe(mesh: DeviceMesh) -> dict[str, Any]:
    """What a rank sees of its mesh, each group exercised by an all-reduce."""
    rank = dist.get_rank()
    dims: dict[str, Any] = {}
    for dim in MESH_DIM_NAMES:
        group = mesh.get_group(dim)
        bits = torch.tensor([1 << rank], dtype=torch.int64)
        dist.all_reduce(bits, group=group)
        via_slice = torch.tensor([1 << rank], dtype=torch.int64)
        dist.all_reduce(via_slice, group=mesh[dim].get_group())
        dims[dim] = {
            "ranks": dist.get_process_group_ranks(group),
            "bits": int(bits.item()),
            "bits_via_slice": int(via_slice.item()),
            "local_rank": mesh.get_local_rank(dim),
            "size": mesh.size(MESH_DIM_NAMES.index(dim)),
            "is_world": group is dist.group.WORLD,
        }
    return {
        "names": mesh.mesh_dim_names,
        "mesh": mesh.mesh.tolist(),
        "coordinate": mesh.get_coordinate(),
        "dims": dims,
    }


def rank_build(shapes: list[Shape]) -> list[dict[str, Any]]:
    reports = []
    for pp, dp, tp in shapes:
        ours = describe(build_mesh(pp=pp, dp=dp, tp=tp))
        theirs = describe(init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=MESH_DIM_NAMES))
        reports.append({"ours": ours, "theirs": theirs})
    return reports


def check_reports(shapes: list[Shape], per_rank: list[list[dict[str, Any]]]) -> None:
    world = len(per_rank)
    for s, shape in enumerate(shapes):
        for rank in range(world):
            ours, theirs = per_rank[rank][s]["ours"], per_rank[rank][s]["theirs"]
            where = f"shape {shape}, rank {rank}"
            assert ours["names"] == ("pp", "dp", "tp"), where
            assert ours["mesh"] == torch.arange(world).reshape(shape).tolist(), where
            for d, dim in enumerate(MESH_DIM_NAMES):
                got, want = ours["dims"][dim], expected_group(shape, dim, rank)
                assert got["ranks"] == want, (where, dim, got)
                assert got["bits"] == got["bits_via_slice"] == sum(1 << r for r in want), where
                assert got["local_rank"] == want.index(rank) == ours["coordinate"][d], where
                assert got["size"] == shape[d], where
                # A dim spanning the world reuses the default group instead of a copy.
                assert got["is_world"] == (shape[d] == world), (where, dim)
            # torch's init_device_mesh builds the same layout for the same shape.
            assert ours["mesh"] == theirs["mesh"] and ours["coordinate"] == theirs["coordinate"]
            for dim in MESH_DIM_NAMES:
                assert ours["dims"][dim]["ranks"] == theirs["dims"][dim]["ranks"], (where, dim)
                assert ours["dims"][dim]["bits"] == theirs["dims"][dim]["bits"], (where, dim)


@pytest.mark.slow
def test_groups_at_world_size_4() -> None:
    check_reports(SHAPES_4, run_ranks(rank_build, 4, args=(SHAPES_4,), timeout=150))


@pytest.mark.slow
def test_groups_at_world_size_8() -> None:
    check_reports(SHAPES_8, run_ranks(rank_build, 8, args=(SHAPES_8,), timeout=240))


def rank_world_of_one() -> dict[str, Any]:
    return describe(build_mesh())


@pytest.mark.slow
def test_world_of_one_reuses_the_default_group_for_every_dim() -> None:
    (got,) = run_ranks(rank_world_of_one, 1, timeout=60)
    assert got["mesh"] == [[[0]]] and tuple(got["coordinate"]) == (0, 0, 0)
    assert all(d["is_world"] and d["ranks"] == [0] and d["bits"] == 1 for d in got["dims"].values())


def under_default_store(key: str) -> str:
    """The key below the prefix init_process_group gives the default group's store."""
    prefix, sep, rest = key.partition("//")
    assert sep and prefix.isdigit(), key
    return rest


def rank_store_requests(shape: Shape) -> dict[str, Any]:
    """build_mesh, then the textbook loop, each through a store that records requests."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    store = CountingStore(client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        store.clear()
        mesh = build_mesh(pp=shape[0], dp=shape[1], tp=shape[2])
        ours = list(store.requests)
        names = [mesh.get_group(dim).group_name for dim in MESH_DIM_NAMES]
        store.clear()
        for dim in MESH_DIM_NAMES:
            for ranks in MeshShape(*shape).groups(dim):
                dist.new_group(ranks)
        textbook = list(store.requests)
    finally:
        dist.destroy_process_group()
    return {"ours": ours, "names": names, "textbook": textbook}


@pytest.mark.slow
def test_each_rank_touches_only_its_own_groups_in_the_store() -> None:
    """With torch's per-group init barrier on (TORCH_DIST_INIT_BARRIER=1, the pre-2.1
    default), the textbook loop makes every rank join a world-wide store barrier per
    group; build_mesh's requests all fall under the rank's own three group names."""
    shape = (2, 2, 2)
    results = run_ranks(
        rank_store_requests,
        8,
        args=(shape,),
        init_process_group=False,
        env={"TORCH_DIST_INIT_BARRIER": "1"},
        timeout=240,
    )
    world_barrier = "store_based_barrier_key:"
    for rank, got in enumerate(results):
        assert len(set(got["names"])) == 3, got["names"]
        assert got["ours"], "no store request at all: the groups were not created"
        for op, key in got["ours"]:
            assert under_default_store(key).split("//", 1)[0] in got["names"], (rank, op, key)
        # One group-local barrier per group, on keys under the group's own prefix.
        local = {key for op, key in got["ours"] if op == "add" and world_barrier in key}
        assert len(local) == 3, (rank, sorted(local))
        # The textbook loop: one world-wide barrier per group (12), every rank joining each.
        joined = {
            key
            for op, key in got["textbook"]
            if op == "add" and under_default_store(key).startswith(world_barrier)
        }
        assert len(joined) == 12, (rank, sorted(joined))


def rank_errors() -> dict[str, str | None]:
    rank = dist.get_rank()
    messages: dict[str, str | None] = {}

    def expect_error(case: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, TypeError) as e:
            messages[case] = f"{type(e).__name__}: {e}"
        else:
            messages[case] = None

    expect_error("product", lambda: build_mesh(dp=3))
    expect_error("leftover", lambda: build_mesh(tp=3))
    expect_error("two free", lambda: build_mesh(tp=-1))
    expect_error("zero", lambda: build_mesh(dp=0, tp=4))
    expect_error("device index", lambda: build_mesh(device_type="cuda:0"))
    expect_error("timeout", lambda: build_mesh(timeout=30))
    # Each call is valid alone; together they disagree.
    expect_error("disagree", lambda: build_mesh(dp=2, tp=2) if rank == 0 else build_mesh(pp=4))
    # Nothing was created by the refused calls: a good mesh still builds and works.
    mesh = build_mesh(dp=2, tp=2)
    bits = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(bits, group=mesh.get_group("tp"))
    messages["after"] = str(int(bits.item()))
    # A group only rank 0 holds shifts the hashed names torch gives its next groups.
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    expect_error("group count", lambda: build_mesh(dp=2, tp=2))
    return messages


@pytest.mark.slow
def test_errors_name_the_numbers_on_every_rank() -> None:
    results = run_ranks(rank_errors, 4, timeout=150)
    expected = {
        "product": r"ValueError: the mesh pp=1 x dp=3 x tp=1 holds 3 ranks but the world size is 4",
        "leftover": r"dp=-1 takes what the world size 4 leaves after pp=1 x tp=3 = 3, but 3 does",
        "two free": r"at most one of pp, dp, tp may be -1 .* got pp=1 x dp=-1 x tp=-1",
        "zero": r"dp must be an int >= 1, or -1 for what the world size leaves, got 0",
        "device index": r"device_type must be a device type without an index .* got 'cuda:0'",
        "timeout": r"TypeError: timeout must be a datetime.timedelta or None, got 30",
        "disagree": r"different sizes on different ranks \(rank 0: pp=1 x dp=2 x tp=2; "
        r"rank 1: pp=4 x dp=1 x tp=1\)",
        "group count": r"different numbers of process groups \(rank 1: 4, rank 0: 5\)",
    }
    for rank, messages in enumerate(results):
        for case, pattern in expected.items():
            assert messages[case] is not None, f"rank {rank}: {case} was accepted"
            assert re.search(pattern, messages[case]), (rank, case, messages[case])
        assert messages["after"] == str(0b11 if rank < 2 else 0b1100)


def rank_node_size() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        build_mesh(tp=4)
    except ValueError as e:
        out["tp4"] = str(e)
    out["tp2"] = dist.get_process_group_ranks(build_mesh(tp=2).get_group("tp"))
    # An explicit node size wins over the environment.
    out["tp4 given 4"] = dist.get_process_group_ranks(
        build_mesh(tp=4, local_world_size=4).get_group("tp")
    )
    os.environ["LOCAL_WORLD_SIZE"] = "two"
    try:
        build_mesh(tp=2)
    except ValueError as e:
        out["garbage"] = str(e)
    return out


@pytest.mark.slow
def test_tp_must_fit_the_node_size_from_the_environment() -> None:
    """4 ranks that torchrun would have placed 2 per node (LOCAL_WORLD_SIZE=2)."""
    results = run_ranks(rank_node_size, 4, env={"LOCAL_WORLD_SIZE": "2"}, timeout=150)
    for rank, got in enumerate(results):
        assert "tp=4 must divide the ranks per node, local_world_size=2" in got["tp4"], got
        assert got["tp2"] == ([0, 1] if rank < 2 else [2, 3])
        assert got["tp4 given 4"] == [0, 1, 2, 3]
        assert "LOCAL_WORLD_SIZE (ranks per node, set by the launcher)" in got["garbage"], got
        assert "got 'two'" in got["garbage"]


def test_without_a_process_group_it_says_what_to_call() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group\(\) first"):
        build_mesh(dp=1)
