"""``build_mesh``: a pp x dp x tp ``DeviceMesh`` whose groups cost no world-wide barrier each.

What torch does per group. ``dist.new_group(ranks)`` must be called by every rank for
every group, members or not: groups are named from a per-process counter that only
stays in step if every rank makes the same calls. ``init_device_mesh`` does exactly
that on gloo (and on NCCL without a bound device): one ``new_group`` per group, on
every rank. Before torch 2.1, and today with ``TORCH_DIST_INIT_BARRIER=1``, each call
then ends in ``_store_based_barrier`` over the whole world: every rank adds to one
store key and polls it until the last rank arrives. A mesh with G groups so costs G
world-wide barriers, each O(world) requests on the one TCPStore, with every rank
waiting for the slowest; at 2,048 GPUs MegaScale measured 1,047 s of group init and
got under 5 s with fewer global barriers and a non-blocking store. (The store half is
torch's now: its TCPStore server has run on a libuv event loop by default since 2.4.)
With the barrier off (the default since 2.1) a non-member's call returns without a
store request, and what is left per group is a call on every rank: O(groups), 576 per
rank for pp 8 x dp 32 x tp 8 at 2,048 ranks.

What this does instead. Each rank creates only its own three groups, pp then dp then
tp on every rank (one order, so no two ranks wait on each other crosswise), with
``new_group(..., use_local_synchronization=True)``: non-members never call, the group
is named by hashing its ranks, and only its members touch the store (gloo's pairwise
connect; the barrier, when enabled, is group-local). A dimension that spans the
whole world reuses the default group. The only world-wide step is one all-gather of
four ints before any group exists, which turns the two ways this could hang (ranks
passing different sizes; ranks that disagree on how many groups they hold, from which
torch derives the hashed names) into an error on every rank.

On NCCL with a device bound to the default group (``init_process_group(device_id=)``),
torch creates a member's communicator with ``ncclCommSplit`` from the world's, which
every world rank must join, so a local-synchronization group would hang there
(pytorch#129965); this case takes ``dist.split_group`` instead: one split per
dimension over the world (three world-wide steps), no store traffic, no new bootstrap.
Without a bound device, NCCL groups take the local path and connect lazily.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from ms_parallel.mesh_shape import MESH_DIM_NAMES, MeshShape

__all__ = ["build_mesh"]


def build_mesh(
    *,
    dp: int = -1,
    tp: int = 1,
    pp: int = 1,
    device_type: str | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    local_world_size: int | None = None,
) -> DeviceMesh:
    """A ``DeviceMesh`` with dims ``("pp", "dp", "tp")`` over the default group's ranks.

    Every rank must call it with the same arguments, like ``init_device_mesh``. The
    layout is ``init_device_mesh(device_type, (pp, dp, tp))``'s: tp fastest, so TP peers
    are consecutive ranks, on one node under torchrun; size-1 dims are kept, so
    ``mesh["dp"]`` and ``mesh.get_group("tp")`` always work.

    Args:
        dp, tp, pp: sizes; one of them may be -1 for what the world size leaves (dp by
            default). Their product must equal the world size.
        device_type: the mesh's device type; by default ``"cuda"`` when the default
            group's backend is NCCL, else ``"cpu"``. On CUDA, call
            ``torch.cuda.set_device`` first, as for ``init_device_mesh``.
        backend: backend of the new groups (``dist.new_group``'s ``backend``); by
            default the default group's.
        timeout: timeout of the new groups; by default torch's for the backend.
        local_world_size: ranks per node, to check that tp divides it; by default
            ``LOCAL_WORLD_SIZE`` when the launcher (torchrun) sets it, else unchecked.

    Raises:
        RuntimeError: the default process group is not initialised.
        ValueError: bad sizes, a product other than the world size, a tp that does not
            divide the ranks per node, or ranks that called with different sizes.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs the default process group: call "
            "torch.distributed.init_process_group() first (under torchrun it reads "
            "RANK, WORLD_SIZE and MASTER_ADDR from the environment)"
        )
    if local_world_size is None:
        local_world_size = _local_world_size_from_env()
    shape = MeshShape.resolve(
        dist.get_world_size(), dp=dp, tp=tp, pp=pp, local_world_size=local_world_size
    )
    if device_type is None:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    elif not isinstance(device_type, str) or not device_type.isalpha():
        raise ValueError(
            f"device_type must be a device type without an index such as 'cuda' or 'cpu', "
            f"got {device_type!r}"
        )
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")

    _check_same_on_every_rank(shape, device_type)
    groups = _create_groups(shape, backend, timeout)
    return DeviceMesh.from_group(
        groups, device_type, mesh=shape.mesh_tensor(), mesh_dim_names=MESH_DIM_NAMES
    )


def _local_world_size_from_env() -> int | None:
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"LOCAL_WORLD_SIZE (ranks per node, set by the launcher) must be an int >= 1, "
            f"got {raw!r}"
        )
    return value


def _registered_group_count() -> int:
    """How many groups this process holds, which torch mixes into hashed group names.

    ``use_local_synchronization=True`` and ``split_group`` name a group
    ``sha1(ranks, len(_world.pg_names))`` (``_hash_ranks_to_str``); -1 where a torch
    release no longer keeps that registry, and the check is skipped.
    """
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    return len(names) if isinstance(names, dict) else -1


def _check_same_on_every_rank(shape: MeshShape, device_type: str) -> None:
    """One all-gather over the world: same sizes, same group count, or ValueError everywhere."""
    mine = [*shape.sizes, _registered_group_count()]
    # A CPU tensor when the default group has a CPU backend (gloo, or cpu:gloo,cuda:nccl):
    # no NCCL communicator is started just for this check.
    has_cpu = "cpu:" in dist.get_backend_config()
    device = torch.device("cpu") if has_cpu else _accelerator(device_type)
    gathered = [
        torch.zeros(len(mine), dtype=torch.int64, device=device)
        for _ in range(dist.get_world_size())
    ]
    dist.all_gather(gathered, torch.tensor(mine, dtype=torch.int64, device=device))
    rows = [tuple(int(x) for x in t.tolist()) for t in gathered]
    first_rank: dict[tuple[int, ...], int] = {}
    for r, row in enumerate(rows):
        first_rank.setdefault(row[:3], r)
    if len(first_rank) > 1:
        seen = "; ".join(f"rank {r}: {MeshShape(*s)}" for s, r in first_rank.items())
        raise ValueError(
            f"build_mesh was called with different sizes on different ranks ({seen}); "
            f"every rank must pass the same pp, dp and tp"
        )
    counts = [row[3] for row in rows]
    if -1 not in counts and len(set(counts)) > 1:
        low, high = counts.index(min(counts)), counts.index(max(counts))
        raise ValueError(
            f"ranks hold different numbers of process groups (rank {low}: {counts[low]}, "
            f"rank {high}: {counts[high]}); torch names the groups build_mesh creates from "
            f"that number, so their members would not find each other. Create earlier "
            f"groups on every rank, or build the mesh first"
        )


def _accelerator(device_type: str) -> torch.device:
    bound = _world_group().bound_device_id
    if bound is not None:
        return bound
    module = getattr(torch, device_type, None)
    current = getattr(module, "current_device", None)
    if current is None:
        raise ValueError(
            f"the default group ({dist.get_backend()}) has no CPU backend, and device_type "
            f"{device_type!r} has no current device to run the mesh check on"
        )
    return torch.device(device_type, current())


def _create_groups(
    shape: MeshShape, backend: str | None, timeout: timedelta | None
) -> list[ProcessGroup]:
    """This rank's group along each dim, pp then dp then tp (the same order on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    world_group = _world_group()
    split = _splits_from_world(world_group, backend)
    groups: list[ProcessGroup] = []
    for dim, size in zip(MESH_DIM_NAMES, shape.sizes, strict=True):
        if size == world and backend is None:
            # The same ranks and backend as the default group: nothing to create.
            groups.append(world_group)
            continue
        desc = f"mesh_{dim}"
        if split:
            extra = {} if backend is None else {"backend": backend}
            group = dist.split_group(
                world_group, shape.groups(dim), timeout=timeout, group_desc=desc, **extra
            )
        else:
            group = dist.new_group(
                shape.group_ranks(dim, rank),
                timeout=timeout,
                backend=backend,
                use_local_synchronization=True,
                group_desc=desc,
            )
        if not isinstance(group, ProcessGroup):
            raise RuntimeError(f"creating rank {rank}'s {dim} group returned {group!r}")
        groups.append(group)
    return groups


def _world_group() -> ProcessGroup:
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("the default process group went away while building the mesh")
    return group


def _splits_from_world(world_group: ProcessGroup, backend: str | None) -> bool:
    """Whether new NCCL groups would be split from the world's communicator (see above)."""
    if world_group.bound_device_id is None:
        return False
    target = backend if backend is not None else dist.get_backend_config()
    return "nccl" in str(target).lower()
