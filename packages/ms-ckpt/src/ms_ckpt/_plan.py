"""Who writes and who reads what: the ranks' layout and the split of replicated records.

The ranks that save together (``group``) are split into data-parallel groups of equal
size. Ranks of one DP group hold the same replicated state; each DP group is one
*part* of the checkpoint (a model-parallel partition: a tensor- or pipeline-parallel
rank's share). Parts are numbered by their lowest rank.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    rank: int  # in ``group``
    world_size: int
    part: int
    parts: int
    dp_rank: int
    dp_size: int
    dp_ranks: tuple[int, ...]  # global ranks of this DP group, in DP-rank order
    nonce: str  # the same on every rank of one Checkpointer: names this job's saves
    group: Any = None
    dp_group: Any = None
    # Global ranks of every part's DP group, by part: which part a DTensor's mesh rank is in.
    groups: tuple[tuple[int, ...], ...] = ()

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    @property
    def global_rank(self) -> int:
        return self.dp_ranks[self.dp_rank]

    def describe(self) -> dict[str, int]:
        return {"world_size": self.world_size, "dp_size": self.dp_size, "parts": self.parts}


def single(global_rank: int = 0) -> Layout:
    """One process saving alone (``global_rank``: its rank when torch.distributed runs)."""
    me = (global_rank,)
    return Layout(0, 1, 0, 1, 0, 1, me, uuid.uuid4().hex, groups=(me,))


def discover(group: Any, dp_group: Any) -> Layout:
    """Collective over ``group``: every rank reports its DP group; check they tile it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    me = dist.get_rank()
    members = tuple(dist.get_process_group_ranks(dp_group))
    if me not in members:
        raise ValueError(f"dp_group must contain this rank ({me}), got ranks {list(members)}")
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (me, members, uuid.uuid4().hex), group=group)
    in_group = {g[0] for g in gathered}
    groups = sorted({g[1] for g in gathered}, key=min)
    seen: set[int] = set()
    for g in groups:
        if len(g) != len(members):
            raise ValueError(
                f"dp_group sizes differ across ranks: {[list(x) for x in groups]}; every "
                "rank's data-parallel group must have the same size"
            )
        if seen & set(g) or not set(g) <= in_group:
            raise ValueError(
                f"the dp_groups {[list(x) for x in groups]} must split group's ranks "
                f"{sorted(in_group)} into disjoint groups"
            )
        seen |= set(g)
    return Layout(
        rank=rank,
        world_size=world,
        part=groups.index(members),
        parts=len(groups),
        dp_rank=dist.get_rank(dp_group),
        dp_size=len(members),
        dp_ranks=members,
        nonce=gathered[0][2],
        group=group,
        dp_group=dp_group,
        groups=tuple(groups),
    )


def assign(sizes: list[tuple[str, int, bool]], n: int) -> dict[str, int]:
    """Split replicated records among ``n`` DP ranks: key -> the rank that handles it.

    ``sizes``: (key, bytes, is_tensor). Tensors go largest first to the least loaded
    rank (ties: the lower rank), so every rank writes and reads about 1/n of the bytes;
    pickled values (small, and their size could differ between processes) go by a hash
    of the key. Deterministic: every rank of a group computes the same split.
    """
    load = [0] * n
    out: dict[str, int] = {}
    tensors = sorted(((k, s) for k, s, t in sizes if t), key=lambda ks: (-ks[1], ks[0]))
    for key, size in tensors:
        j = min(range(n), key=lambda i: (load[i], i))
        out[key] = j
        load[j] += size
    for key, _, is_tensor in sizes:
        if not is_tensor:
            out[key] = zlib.crc32(key.encode()) % n
    return out


def assign_readers(items: list[tuple[str, int, bool, tuple[int, ...]]], n: int) -> list[int]:
    """For a load: which of ``n`` DP ranks reads each stored record from storage.

    ``items``: (key, bytes, is_tensor, the DP ranks that need it), in the same order on
    every rank. Tensors go largest first to the least loaded rank that needs them (ties:
    the lower rank, then the earlier item); pickled values (replicated, needed by all)
    by a hash of the key, as in ``assign``. Returns the reader of each item, in order.
    """
    load = [0] * n
    out = [0] * len(items)
    tensors = sorted((i for i, it in enumerate(items) if it[2]), key=lambda i: (-items[i][1], i))
    for i in tensors:
        _, size, _, needers = items[i]
        j = min(needers, key=lambda r: (load[r], r))
        out[i] = j
        load[j] += size
    for i, (key, _, is_tensor, needers) in enumerate(items):
        if not is_tensor:
            out[i] = needers[zlib.crc32(key.encode()) % len(needers)]
    return out


def dtensor_scope(
    path: str, mesh_ranks: tuple[int, ...], layout: Layout, part_of: dict[int, int]
) -> tuple[list[int], bool]:
    """For a save: the parts a DTensor's mesh spans, and whether its piece is also held
    outside the mesh by this rank's DP peers.

    A mesh that contains this rank's whole DP group (ZeRO or FSDP over the "dp" mesh
    dimension, or a mesh over every rank) holds all copies of a piece itself: its
    Replicate dimensions say who else holds it. A mesh that meets the DP group only at
    this rank (tensor parallelism inside one DP replica) is replicated across DP like any
    unmarked value: one DP rank writes each piece. Anything between is refused.
    ``part_of``: global rank -> part, from ``layout.groups``.
    """
    outside = sorted(r for r in mesh_ranks if r not in part_of)
    if outside:
        raise ValueError(
            f"state[{path!r}]: the DTensor's mesh has ranks {outside} outside the ranks that "
            f"save together ({sorted(part_of)}); save with a group that contains its mesh"
        )
    mesh, dp = set(mesh_ranks), set(layout.dp_ranks)
    if dp <= mesh:
        across = False
    elif mesh & dp == {layout.global_rank}:
        across = True
    else:
        raise ValueError(
            f"state[{path!r}]: the DTensor's mesh (ranks {sorted(mesh)}) must contain this "
            f"rank's whole data-parallel group (ranks {sorted(dp)}) or meet it only at this "
            f"rank; it holds {sorted(mesh & dp)} of it"
        )
    return sorted({part_of[r] for r in mesh}), across


def comm_device(group: Any) -> torch.device:
    """Where a collective's tensors must live for ``group``'s backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool, layout: Layout) -> bool:
    """Collective: True when ``flag`` is True on any rank."""
    if not layout.distributed:
        return flag
    t = torch.tensor([int(flag)], device=comm_device(layout.group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=layout.group)
    return bool(t.item())


def agree(error: Any, layout: Layout) -> list[tuple[int, Any]]:
    """Collective: every rank's error (rank, error) where not None, the same on all ranks."""
    if not layout.distributed:
        return [] if error is None else [(0, error)]
    if not any_rank(error is not None, layout):
        return []
    gathered: list[Any] = [None] * layout.world_size
    dist.all_gather_object(gathered, error, group=layout.group)
    return [(r, e) for r, e in enumerate(gathered) if e is not None]


def broadcast_object(obj: Any, layout: Layout) -> Any:
    """Collective: rank 0's ``obj`` on every rank."""
    if not layout.distributed:
        return obj
    box = [obj]
    src = dist.get_global_rank(layout.group, 0)
    dist.broadcast_object_list(box, src=src, group=layout.group)
    return box[0]


def layout_error(saved: dict[str, Any], layout: Layout, per_rank: list[str]) -> str | None:
    """Why the per-rank values ``per_rank`` of a checkpoint saved with world ``saved``
    cannot load into ``layout``, or None. Whether the rest can follow a changed number
    of parts is ``_parts.reshard_error``'s to say."""
    if not per_rank:
        return None
    keys = ", ".join(repr(k) for k in per_rank)
    why = (
        f"and {keys} is per-rank (one value per data-parallel rank of a part), which "
        "cannot be resharded; load with the same layout, or with per_rank='keep' to keep "
        "the live per-rank values"
    )
    if saved.get("parts", 1) != layout.parts:
        return f"{parts_changed(saved, layout)} {why}"
    if saved["dp_size"] != layout.dp_size:
        return f"the data-parallel size changed from {saved['dp_size']} to {layout.dp_size} {why}"
    return None


def parts_changed(saved: dict[str, Any], layout: Layout) -> str:
    """The start of an error about a checkpoint saved with world ``saved`` loading into
    another number of parts: what it has, what this job has."""
    return (
        f"the number of model-parallel parts changed from {saved.get('parts', 1)} (world "
        f"{saved['world_size']}, data-parallel size {saved['dp_size']}) to {layout.parts} "
        f"(world {layout.world_size}, data-parallel size {layout.dp_size})"
    )
