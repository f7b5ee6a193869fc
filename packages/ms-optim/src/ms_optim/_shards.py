"""How a rank's local tensors map onto the logical (unsharded) parameters.

ZeRO stages 1-3 give each data-parallel rank a slice of every parameter (or of the
flat buffer that holds them all). LAMB's trust ratio needs ||w|| and ||u|| of the
whole logical parameter, so the optimizer must know, for every local tensor, which
logical parameter it is a slice of. The norms are then completed with one packed
all-reduce over the data-parallel group.

Some tensors may stay replicated instead (DeepSpeed keeps small parameters whole on
every rank; ms-parallel's ZeRO can keep its first chunks so, to skip their
all-gather): every rank holds the same tensor. Summed over the ranks their squares
would count once per rank, so they are added after the all-reduce, once.
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
    parameter must be held exactly once: by one rank's sharded tensor, or by a
    tensor that ``replicated`` names on every rank.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_ids", tuple(self.param_ids))
        object.__setattr__(self, "numels", tuple(self.numels))
        object.__setattr__(self, "replicated", tuple(self.replicated))
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

    def check_local(self, params: Sequence[torch.Tensor]) -> None:
        """Refuse a map that does not fit this rank's tensors."""
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


def check_shards_across_ranks(
    shards: ShardMap, params: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> None:
    """Refuse a map that does not fit this rank's tensors, or whose slices do not
    cover each logical parameter exactly once.

    Collective over ``group`` (two small all-reduces, three when a rank names
    replicated tensors). A rank whose own map is wrong still joins the first one,
    so every rank raises, and none is left waiting in a collective its peer will
    never reach; every later decision is taken from reduced values, the same on
    every rank.
    """
    try:
        shards.check_local(params)
        local_error: ValueError | None = None
    except ValueError as e:
        local_error = e
    device = _comm_device(group, params)
    n = len(shards.numels)
    # Max of n and of -n: equal magnitudes iff every rank has the same n.
    flags = torch.tensor(
        [n, -n, int(local_error is not None), int(bool(shards.replicated))], dtype=torch.int64
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
    replicated = set(shards.replicated)
    held = torch.zeros(n, dtype=torch.int64)  # in sharded tensors, summed over ranks
    copies = torch.zeros(n, dtype=torch.int64)  # in replicated ones, the same on every rank
    for i, (k, p) in enumerate(zip(shards.param_ids, params, strict=True)):
        (copies if i in replicated else held)[k] += p.numel()
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
    for k, (have, want) in enumerate(zip((held + copies).tolist(), shards.numels, strict=True)):
        if have != want:
            raise ValueError(
                f"shards: logical parameter {k} has shards.numels[{k}] = {want} elements but "
                f"the ranks' local tensors hold {have} of them in total (sharded tensors "
                "summed over the ranks, replicated ones once)"
            )


def _comm_device(group: dist.ProcessGroup, params: Sequence[torch.Tensor]) -> torch.device:
    # NCCL reduces CUDA tensors only; gloo reduces CPU ones.
    if params and params[0].is_cuda and dist.get_backend(group) == "nccl":
        return params[0].device
    return torch.device("cpu")
