"""The pp x dp x tp rank layout: sizes, coordinates and groups, with no process group.

Rank ``r`` sits at ``(pp_i, dp_i, tp_i)`` with ``r = (pp_i * dp + dp_i) * tp + tp_i``:
tp varies fastest, so the ranks of one TP group are consecutive. torchrun numbers
ranks node by node, so consecutive ranks share a node, and a tp that divides the
ranks per node keeps every TP group (the most communication-hungry dimension:
two collectives per layer) on one node's NVLink. This is the order of
``init_device_mesh(device_type, (pp, dp, tp))`` and of Megatron-LM's default
``tp-cp-ep-dp-pp`` order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import torch

__all__ = ["MESH_DIM_NAMES", "MeshShape"]

#: The mesh's dimension names, outermost first; every mesh has all three.
MESH_DIM_NAMES: Final = ("pp", "dp", "tp")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class MeshShape:
    """Sizes of a pp x dp x tp mesh over ``pp * dp * tp`` ranks (tp fastest)."""

    #: Pipeline stages.
    pp: int
    #: Data-parallel replicas (or ZeRO shards).
    dp: int
    #: Tensor-parallel ranks, consecutive, so on one node.
    tp: int

    def __post_init__(self) -> None:
        for name in MESH_DIM_NAMES:
            size = getattr(self, name)
            if not _is_int(size) or size < 1:
                raise ValueError(f"{name} must be an int >= 1, got {size!r}")

    @classmethod
    def resolve(
        cls,
        world_size: int,
        *,
        dp: int = -1,
        tp: int = 1,
        pp: int = 1,
        local_world_size: int | None = None,
    ) -> MeshShape:
        """The shape for ``world_size`` ranks; one size may be ``-1``: whatever is left.

        Raises ``ValueError`` when a size is not a positive int (or the one ``-1``), when
        the sizes do not multiply to ``world_size``, and, given ``local_world_size`` (the
        ranks per node), when tp does not divide it, which would put one TP group on two
        nodes.
        """
        if not _is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        for name, size in sizes.items():
            if not _is_int(size) or (size < 1 and size != -1):
                raise ValueError(
                    f"{name} must be an int >= 1, or -1 for what the world size leaves, "
                    f"got {size!r}"
                )
        free = [name for name, size in sizes.items() if size == -1]
        if len(free) > 1:
            raise ValueError(
                f"at most one of pp, dp, tp may be -1 (what the world size leaves), got "
                f"{_describe(sizes)}"
            )
        fixed = 1
        for size in sizes.values():
            if size != -1:
                fixed *= size
        if free:
            if world_size % fixed:
                rest = " x ".join(f"{n}={s}" for n, s in sizes.items() if s != -1)
                raise ValueError(
                    f"{free[0]}=-1 takes what the world size {world_size} leaves after "
                    f"{rest} = {fixed}, but {fixed} does not divide {world_size}"
                )
            sizes[free[0]] = world_size // fixed
        elif fixed != world_size:
            raise ValueError(
                f"the mesh {_describe(sizes)} holds {fixed} ranks but the world size is "
                f"{world_size}: pp * dp * tp must equal it (pass -1 for one size to fill it)"
            )
        shape = cls(**sizes)
        if local_world_size is not None:
            shape.check_node_size(local_world_size)
        return shape

    def check_node_size(self, local_world_size: int) -> None:
        """Raise ``ValueError`` unless tp divides the ranks per node (TP stays on a node)."""
        if not _is_int(local_world_size) or local_world_size < 1:
            raise ValueError(
                f"local_world_size (ranks per node) must be an int >= 1, got {local_world_size!r}"
            )
        if local_world_size % self.tp:
            where = "spans more than one node" if self.tp > local_world_size else "straddles nodes"
            raise ValueError(
                f"tp={self.tp} must divide the ranks per node, local_world_size="
                f"{local_world_size}: TP peers are consecutive ranks, so some TP group "
                f"{where}"
            )

    @property
    def sizes(self) -> tuple[int, int, int]:
        """``(pp, dp, tp)``, in ``MESH_DIM_NAMES`` order."""
        return (self.pp, self.dp, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank must be an int in [0, {self.world_size}) for the mesh {self}, got {rank!r}"
            )

    def _check_dim(self, dim: str) -> int:
        if dim not in MESH_DIM_NAMES:
            raise ValueError(f"dim must be one of {MESH_DIM_NAMES}, got {dim!r}")
        return MESH_DIM_NAMES.index(dim)

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        """``(pp_i, dp_i, tp_i)`` of ``rank``, like ``DeviceMesh.get_coordinate()``."""
        self._check_rank(rank)
        rest, tp_i = divmod(rank, self.tp)
        pp_i, dp_i = divmod(rest, self.dp)
        return (pp_i, dp_i, tp_i)

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        """The rank at coordinate ``(pp, dp, tp)``."""
        for name, i, size in zip(MESH_DIM_NAMES, (pp, dp, tp), self.sizes, strict=True):
            if not _is_int(i) or not 0 <= i < size:
                raise ValueError(f"{name} index must be an int in [0, {size}), got {i!r}")
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks of ``rank``'s group along ``dim``, ascending (its group rank order)."""
        d = self._check_dim(dim)
        coord = list(self.coordinate(rank))
        ranks = []
        for i in range(self.sizes[d]):
            coord[d] = i
            ranks.append(self.rank_at(*coord))
        return ranks

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim`` (each ascending), ordered by their lowest rank."""
        d = self._check_dim(dim)
        # Moving dim d last and flattening the others lists one group per row.
        return self.mesh_tensor().movedim(d, -1).reshape(-1, self.sizes[d]).tolist()

    def mesh_tensor(self) -> torch.Tensor:
        """The ranks as a ``(pp, dp, tp)`` int tensor, the ``mesh`` of a ``DeviceMesh``."""
        return torch.arange(self.world_size, dtype=torch.int).reshape(self.sizes)

    def __str__(self) -> str:
        return _describe(dict(zip(MESH_DIM_NAMES, self.sizes, strict=True)))


def _describe(sizes: dict[str, int]) -> str:
    return " x ".join(f"{name}={size}" for name, size in sizes.items())
