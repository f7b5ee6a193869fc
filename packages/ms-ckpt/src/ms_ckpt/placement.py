"""How state is placed across a data-parallel group, for a checkpoint.

Every value in the saved state is *replicated* across the DP group unless marked:

- ``per_rank(x)``: each DP rank has its own value (a data-loader position, an RNG
  state); each rank writes and reads back its own. ``rng_state()`` is per-rank already.
- ``Sharded(local, global_shape=..., offset=..., dim=0)``: this rank holds the slice
  ``[offset, offset + local.shape[dim])`` along ``dim`` of a tensor split across the DP
  group (ZeRO optimizer state). On load each rank gets the slice its live ``Sharded``
  asks for, so a checkpoint saved with DP 4 loads with DP 2; a plain tensor at that
  path gets the whole tensor.

New code should hold sharded state as PyTorch's own ``DTensor`` instead, which needs no
marking: its mesh and placements say which rank holds what, on any mesh and for any
tensor dimension. ``Sharded`` keeps working, and the two reshard into each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PerRank", "Sharded", "per_rank"]


class PerRank:
    """A value that differs across data-parallel ranks: each rank saves and loads its own.

    A load with a different data-parallel size refuses a checkpoint that holds one.
    """

    __slots__ = ("value",)
    value: Any

    def __init__(self, value: Any) -> None:
        if isinstance(value, PerRank):
            value = value.value
        self.value = value

    def __repr__(self) -> str:
        return f"per_rank({self.value!r})"


def per_rank(value: Any) -> PerRank:
    """Mark ``value`` (a tensor, a Stateful, any nested state) as per data-parallel rank."""
    return PerRank(value)


@dataclass(eq=False)
class Sharded:
    """The slice of a DP-sharded tensor this rank holds (see the module docstring).

    Args:
        local: this rank's slice; its shape equals ``global_shape`` except along ``dim``.
        global_shape: the whole tensor's shape.
        offset: where ``local`` starts along ``dim`` in the whole tensor.
        dim: the sharded dimension.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offset: int
    dim: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise TypeError(f"Sharded.local must be a tensor, got {type(self.local).__name__}")
        shape = tuple(self.global_shape)
        if not all(type(s) is int and s >= 0 for s in shape):
            raise ValueError(f"Sharded.global_shape must be ints >= 0, got {self.global_shape!r}")
        self.global_shape = shape
        if type(self.dim) is not int or not 0 <= self.dim < max(1, len(shape)) or not shape:
            raise ValueError(
                f"Sharded.dim must be in [0, {len(shape)}) for global_shape {shape}, "
                f"got {self.dim!r}"
            )
        local = tuple(self.local.shape)
        if len(local) != len(shape) or any(
            a != b for i, (a, b) in enumerate(zip(local, shape, strict=True)) if i != self.dim
        ):
            raise ValueError(
                f"Sharded.local has shape {local}; with global_shape {shape} it must match "
                f"every dimension but dim {self.dim}"
            )
        if (
            type(self.offset) is not int
            or not 0 <= self.offset <= shape[self.dim] - local[self.dim]
        ):
            raise ValueError(
                f"Sharded.offset must be an int in [0, {shape[self.dim] - local[self.dim]}] "
                f"(global size {shape[self.dim]} along dim {self.dim}, local "
                f"{local[self.dim]}), got {self.offset!r}"
            )

    @property
    def length(self) -> int:
        """How many rows along ``dim`` this rank holds."""
        return int(self.local.shape[self.dim])
