"""How a rank's local tensors map onto the logical (unsharded) parameters.

ZeRO stages 1-3 give each data-parallel rank a slice of every parameter (or of the
flat buffer that holds them all). LAMB's trust ratio needs ||w|| and ||u|| of the
whole logical parameter, so the optimizer must know, for every local tensor, which
logical parameter it is a slice of. The norms are then completed with one packed
all-reduce over the process group.

A tensor may be held, with the same values, by several ranks of the group: whole on
every rank (``replicated``: DeepSpeed keeps small parameters so, ms-parallel's ZeRO
its first chunks), or on some of them (``replicas``: in a data x tensor parallel
group, a ZeRO shard of a parameter that tensor parallelism replicates is held by
every tp rank of its dp rank). Summed over the ranks their squares would count
once per copy, so each copy counts 1/replicas of itself, and replicated tensors are
added after the all-reduce, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ms_optim._comm import all_reduce_sum

__all__ = ["ShardMap", "check_shards_across_ranks"]


@dataclass(frozen=True)
class ShardMap:
    """Which logical parameter each local tensor of this rank is a slice of.

    Every rank of the process group builds one. ``numels`` is the same on every
    rank; ``param_ids`` lists this rank's tensors. Each element of a logical
    parameter must be held exactly once, counting a tensor that ``replicas`` says
    ``r`` ranks hold as 1/r on each of them, and one that ``replicated`` names on
    every rank once.

    ``replicated`` and ``replicas`` describe the same thing at two grains:
    ``replicated`` position ``i`` means ``replicas[i]`` is the size of the group.
    Its squares are added after the all-reduce (exactly once) rather than divided
    by the group size before it. A position may be in both only with
    ``replicas[i]`` equal to the group size; ``Lamb`` refuses anything else.
    """

    #: For each local tensor, in the order the optimizer holds them (group after
    #: group, as given), the index of its logical parameter in ``numels``.
    param_ids: tuple[int, ...]
    #: Element count of every logical parameter, identical on all ranks.
    numels: tuple[int, ...]
    #: Positions in ``param_ids`` (ascending) of the local tensors that are
    #: replicated: every rank holds the same tensor, with the same values, so its
    #: squares count once in the norms, not once per rank. Every rank names
    #: tensors of the same sizes of the same logical parameters.
    replicated: tuple[int, ...] = ()
    #: For each local tensor (one entry per position in ``param_ids``), how many
    #: ranks of the process group hold exactly this tensor, with the same values,
    #: this rank included: 1 for a shard only this rank holds, the tensor-parallel
    #: degree for a ZeRO shard of a parameter that tensor parallelism replicates,
    #: the data-parallel degree for a tensor-parallel slice that ZeRO keeps whole.
    #: Each copy's squares count 1/replicas. Empty: 1 for every tensor.
    replicas: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_ids", tuple(self.param_ids))
        object.__setattr__(self, "numels", tuple(self.numels))
        object.__setattr__(self, "replicated", tuple(self.replicated))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        for i, n in enumerate(self.numels):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"ShardMap.numels[{i}] must be an int >= 0, got {n!r}")
        for i, k in enumerate(self.param_ids):
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(self.numels):
                raise ValueError(
                    f"ShardMap.param_ids[{i}] must be an int in [0, {len(self.numels)}), got {k!r}"
                )
        previous = -1
        for i, j in enumerate(self.replicated):
            if (
                isinstance(j, bool)
                or not isinstance(j, int)
                or not previous < j < len(self.param_ids)
            ):
                raise ValueError(
                    f"ShardMap.replicated[{i}] must be a position in param_ids, in "
                    f"[{previous + 1}, {len(self.param_ids)}) (ascending, each once), got {j!r}"
                )
            previous = j
        if self.replicas and len(self.replicas) != len(self.param_ids):
            raise ValueError(
                f"ShardMap.replicas must be empty or have one entry per entry of param_ids "
                f"({len(self.param_ids)}), got {len(self.replicas)} entries"
            )
        for i, r in enumerate(self.replicas):
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError(
                    f"ShardMap.replicas[{i}] must be an int >= 1 (the ranks holding local "
                    f"tensor {i}, this one included), got {r!r}"
                )

    @classmethod
    def from_flat_range(
        cls, numels: Sequence[int], start: int, stop: int
    ) -> tuple[ShardMap, list[tuple[int, int, int]]]:
        """The map for a rank that owns elements ``[start, stop)`` of the flat buffer
        holding all logical parameters back to back (DeepSpeed / Megatron ZeRO layout).

        Returns the map and, for each local tensor, ``(param_id, offset, length)``:
        the slice ``flat_param[offset : offset + length]`` of that parameter.
        Parameters the range does not touch get no local tensor.
        """
        total = sum(numels)
        if not 0 <= start <= stop <= total:
            raise ValueError(
                f"flat range must satisfy 0 <= start <= stop <= {total}, got [{start}, {stop})"
            )
        slices: list[tuple[int, int, int]] = []
        begin = 0
        for k, n in enumerate(numels):
            lo, hi = max(start, begin), min(stop, begin + n)
            if lo < hi:
                slices.append((k, lo - begin, hi - lo))
            begin += n
        return cls(param_ids=tuple(s[0] for s in slices), numels=tuple(numels)), slices

    def replica_counts(self, group_size: int) -> tuple[int, ...]:
        """How many ranks hold each local tensor: ``replicas``, with ``group_size``
        for the ``replicated`` positions (and 1 where neither says otherwise)."""
        counts = list(self.replicas) if self.replicas else [1] * len(self.param_ids)
        for i in self.replicated:
            counts[i] = group_size
        return tuple(counts)

    def check_local(self, params: Sequence[torch.Tensor], group_size: int | None = None) -> None:
        """Refuse a map that does not fit this rank's tensors; with ``group_size``
        (the size of the process group), also replica counts the group cannot have."""
        if len(self.param_ids) != len(params):
            raise ValueError(
                f"shards.param_ids must have one entry per parameter tensor of the optimizer "
                f"({len(params)}), got {len(self.param_ids)}"
            )
        for i, (k, p) in enumerate(zip(self.param_ids, params, strict=True)):
            if p.numel() > self.numels[k]:
                raise ValueError(
                    f"shards: local tensor {i} has {p.numel()} elements but its logical "
                    f"parameter {k} has only shards.numels[{k}] = {self.numels[k]}"
                )
        if group_size is None:
            return
        replicated = set(self.replicated)
        for i, r in enumerate(self.replicas):
            if i in replicated and r != group_size:
                raise ValueError(
                    f"shards.replicas[{i}] must be {group_size} (the size of process_group) "
                    f"since shards.replicated names position {i} (held by every rank), "
                    f"got {r}"
                )
            if r > group_size:
                raise ValueError(
                    f"shards.replicas[{i}] must be at most {group_size} (the size of "
                    f"process_group: no more ranks can hold a tensor), got {r}"
                )


def check_shards_across_ranks(
    shards: ShardMap, params: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> None:
    """Refuse a map that does not fit this rank's tensors, or whose slices do not
    cover each logical parameter exactly once (a tensor held by ``r`` ranks counting
    1/r on each, a replicated one once).

    Collective over ``group`` (two small all-reduces, three when a rank names
    replicated tensors). A rank whose own map is wrong still joins the first one,
    so every rank raises, and none is left waiting in a collective its peer will
    never reach; every later decision is taken from reduced values, the same on
    every rank.
    """
    world = dist.get_world_size(group)
    try:
        shards.check_local(params, world)
        local_error: ValueError | None = None
    except ValueError as e:
        local_error = e
    device = _comm_device(group, params)
    n = len(shards.numels)
    replicated = set(shards.replicated)
    counts = shards.replica_counts(world)
    # Which replica counts this rank's sharded tensors use (1 always, so that the
    # count of elements below has a column); a rank whose counts are out of range
    # has raised locally and only has to keep the shapes of the collectives.
    used = torch.zeros(world, dtype=torch.int64)
    used[0] = 1
    for i, r in enumerate(counts):
        if i not in replicated:
            used[min(r, world) - 1] = 1
    # Max of n and of -n: equal magnitudes iff every rank has the same n.
    flags = torch.cat(
        [
            torch.tensor(
                [n, -n, int(local_error is not None), int(bool(shards.replicated))],
                dtype=torch.int64,
            ),
            used,
        ]
    )
    all_reduce_sum(flags.to(device), group, op=dist.ReduceOp.MAX, out=flags)
    if local_error is not None:
        raise local_error
    if flags[2].item():
        raise ValueError(
            "shards: the ShardMap of another rank in process_group does not fit that rank's "
            "parameters (that rank's error says how)"
        )
    if flags[0].item() != -flags[1].item():
        raise ValueError(
            "shards.numels must list the same logical parameters on every rank; its "
            f"length ranges from {-int(flags[1].item())} to {int(flags[0].item())} across ranks"
        )
    # Elements of sharded tensors summed over the ranks, one column per replica count
    # in use: integers throughout, so that the check below is exact.
    columns = [r + 1 for r in torch.nonzero(flags[4:]).flatten().tolist()]
    column = {r: c for c, r in enumerate(columns)}
    held = torch.zeros(n, len(columns), dtype=torch.int64)
    copies = torch.zeros(n, dtype=torch.int64)  # in replicated ones, the same on every rank
    for i, (k, p) in enumerate(zip(shards.param_ids, params, strict=True)):
        if i in replicated:
            copies[k] += p.numel()
        else:
            held[k, column[counts[i]]] += p.numel()
    all_reduce_sum(held.to(device), group, out=held)
    if flags[3].item():
        # Max of the counts and of their negatives: equal magnitudes iff every rank
        # holds the same replicated elements of every parameter.
        both = torch.cat([copies, -copies])
        all_reduce_sum(both.to(device), group, op=dist.ReduceOp.MAX, out=both)
        most, least = both[:n], -both[n:]
        differ = torch.nonzero(most != least).flatten().tolist()
        if differ:
            k = differ[0]
            raise ValueError(
                f"shards.replicated must name, on every rank, tensors of the same sizes "
                f"of the same logical parameters; the ranks hold {least[k].item()} to "
                f"{most[k].item()} replicated elements of logical parameter {k}"
            )
        copies = most
    for k, (row, once, want) in enumerate(
        zip(held.tolist(), copies.tolist(), shards.numels, strict=True)
    ):
        # Each tensor held by r ranks appears r times in its column: a total that is
        # not a multiple of r means some rank's count for it is wrong.
        for r, total in zip(columns, row, strict=True):
            if total % r:
                raise ValueError(
                    f"shards.replicas: the local tensors of logical parameter {k} with "
                    f"replicas = {r} hold {total} elements summed over the ranks, not a "
                    f"multiple of {r}; each such tensor must be held, with the same values, "
                    f"by exactly {r} ranks of process_group"
                )
        have = sum(total // r for r, total in zip(columns, row, strict=True)) + once
        if have != want:
            raise ValueError(
                f"shards: logical parameter {k} has shards.numels[{k}] = {want} elements but "
                f"the ranks' local tensors hold {have} of them in total (sharded tensors "
                "summed over the ranks, each divided by its replicas count; replicated "
                "ones once)"
            )


def _comm_device(group: dist.ProcessGroup, params: Sequence[torch.Tensor]) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU ones.
    if params and params[0].is_cuda and dist.get_backend(group) == "nccl":
        return params[0].device
    return torch.device("cpu")
