"""Where a rank sits in a ``("pp", "dp", "tp")`` mesh, and the gradient bookkeeping that
tensor parallelism adds to a data-parallel engine.

With TP, some parameters are split over the TP group (each rank holds a different part)
and the others are whole on every TP rank. The sequence-parallel ones among the latter
(LayerNorms, row-parallel biases, position embeddings) get on each rank the gradient of
its own tokens only: :func:`sum_partial_grads` sums them over the TP group, after which
they are equal on every TP rank. A global norm then counts each element once:
:func:`weighted_norm` divides every local square by how many ranks of its reduction
group hold the same element, and sums over that group with one all-reduce.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ms_parallel._wait import wait_bounded

__all__ = ["Topology", "flat_group", "sum_partial_grads", "weighted_norm"]


@dataclass(frozen=True)
class Topology:
    """What a trainer needs to know about this rank's place in the job.

    Every field is this rank's; ``None`` groups mean one rank along that dimension
    without a process group.
    """

    #: The ``("pp", "dp", "tp")`` mesh, or None without ``torch.distributed``.
    mesh: DeviceMesh | None
    #: This rank's data-parallel coordinate and the DP size: which samples it trains on.
    dp_rank: int
    dp_size: int
    #: The data-parallel group: a mean over it is a mean over the global batch.
    dp_group: dist.ProcessGroup | None
    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup | None
    #: Whether this rank reads batches (every TP rank of a DP replica reads the same ones).
    feeds_data: bool = True
    #: Whether this rank's loss is its replica's (the same on every TP rank; one of them
    #: logs it).
    holds_loss: bool = True

    @classmethod
    def single(cls) -> Topology:
        """One process, no process group."""
        return cls(None, 0, 1, None, 0, 1, None)

    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None) -> Topology:
        """Data parallelism over ``group`` (None: the world, or one process)."""
        if not dist.is_available() or not dist.is_initialized():
            return cls.single()
        group = group if group is not None else dist.group.WORLD
        return cls(None, dist.get_rank(group), dist.get_world_size(group), group, 0, 1, None)

    @classmethod
    def of_mesh(cls, mesh: DeviceMesh) -> Topology:
        """This rank's coordinates in a ``build_mesh`` mesh (``pp`` must be 1 here)."""
        names = mesh.mesh_dim_names or ()
        if tuple(names) != ("pp", "dp", "tp"):
            raise ValueError(
                f"mesh must have the dims ('pp', 'dp', 'tp') of ms_parallel.build_mesh, got {names}"
            )
        if mesh["pp"].size() != 1:
            raise ValueError(
                f"these engines run without pipeline parallelism: mesh['pp'] must have size "
                f"1, got {mesh['pp'].size()}"
            )
        dp, tp = mesh["dp"], mesh["tp"]
        return cls(
            mesh,
            dp.get_local_rank(),
            dp.size(),
            dp.get_group(),
            tp.get_local_rank(),
            tp.size(),
            tp.get_group(),
        )


def flat_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The group of this rank's ``dp x tp`` ranks: the world when they are all of it, else
    a new group of the members only (no world-wide call)."""
    ranks = sorted(int(r) for r in mesh["dp", "tp"].mesh.flatten().tolist())
    if len(ranks) == dist.get_world_size():
        world = dist.group.WORLD
        assert world is not None
        return world
    group = dist.new_group(ranks, use_local_synchronization=True, group_desc="mesh_dp_tp")
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"creating the dp x tp group of ranks {ranks} returned {group!r}")
    return group


def sum_partial_grads(
    grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None, timeout_s: float
) -> None:
    """Sum ``grads`` over ``group`` in place, with one all-reduce of them packed."""
    grads = [g for g in grads if g.numel()]
    if group is None or dist.get_world_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, group=group, async_op=True)
    wait_bounded(
        work,
        op="all_reduce",
        group=group,
        where="sequence-parallel partial gradients",
        timeout_s=timeout_s,
    )
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def weighted_norm(
    pieces: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None,
    timeout_s: float,
    device: torch.device,
) -> torch.Tensor:
    """The L2 norm of every element once: ``pieces`` are (local gradient, how many ranks of
    ``group`` hold that same tensor); one all-reduce over ``group``."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g, copies in pieces:
        if g.numel():
            sq.add_(g.float().pow(2).sum(), alpha=1.0 / copies)
    if group is not None and dist.get_world_size(group) > 1:
        work = dist.all_reduce(sq, group=group, async_op=True)
        wait_bounded(work, op="all_reduce", group=group, where="gradient norm", timeout_s=timeout_s)
    return sq.sqrt()


def clip_(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` so that their global ``norm`` is at most ``max_norm``."""
    if math.isinf(max_norm):
        return
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
