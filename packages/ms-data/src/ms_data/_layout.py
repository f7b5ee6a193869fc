"""Where a rank sits (node, TP group, DP rank) and the segment name its node agrees on.

``local_world_size = tp_size * dp_local`` with TP innermost: local rank ``l`` is TP
rank ``l % tp_size`` of dp slice ``l // tp_size``; the node's dp slices are the global
dp ranks ``dp_first .. dp_first + dp_local - 1``. Defaults come from torchrun's
environment (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE``), assuming no
pipeline parallelism: with it, pass ``dp_rank`` and ``dp_size``.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from dataclasses import dataclass

import numpy as np

__all__ = ["RankLayout", "check_int", "segment_namespace"]


@dataclass(frozen=True)
class RankLayout:
    """One rank's place; validated on construction."""

    #: This process's rank on its node.
    local_rank: int
    #: Ranks on the node: ``tp_size * dp_local``.
    local_world_size: int
    #: Tensor-parallel degree; a TP group stays on one node.
    tp_size: int
    #: Global data-parallel rank.
    dp_rank: int
    #: Global data-parallel degree.
    dp_size: int

    def __post_init__(self) -> None:
        for field in ("local_rank", "dp_rank"):
            check_int(field, getattr(self, field), minimum=0)
        for field in ("local_world_size", "tp_size", "dp_size"):
            check_int(field, getattr(self, field), minimum=1)
        lr, lws, tp = self.local_rank, self.local_world_size, self.tp_size
        if lr >= lws:
            raise ValueError(f"local_rank must be in [0, local_world_size={lws}), got {lr}")
        _check_tp(tp, lws)
        if self.dp_rank >= self.dp_size or self.dp_first < 0:
            raise ValueError(
                f"dp_rank must be in [{self.dp_index}, dp_size={self.dp_size}) for local rank "
                f"{lr} (dp slice {self.dp_index} of the node), got {self.dp_rank}"
            )
        if self.dp_first + self.dp_local > self.dp_size:
            raise ValueError(
                f"the node's dp ranks {self.dp_first}..{self.dp_first + self.dp_local - 1} "
                f"(local_world_size={lws} / tp_size={tp}) exceed dp_size={self.dp_size}"
            )

    @property
    def dp_local(self) -> int:
        """Data-parallel ranks on this node."""
        return self.local_world_size // self.tp_size

    @property
    def dp_index(self) -> int:
        """This rank's dp slice on the node."""
        return self.local_rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.local_rank % self.tp_size

    @property
    def dp_first(self) -> int:
        """The global dp rank of the node's first dp slice."""
        return self.dp_rank - self.dp_index

    @classmethod
    def resolve(
        cls,
        *,
        tp_size: int,
        dp_rank: int | None,
        dp_size: int | None,
        local_rank: int | None,
        local_world_size: int | None,
    ) -> RankLayout:
        """The explicit arguments, the rest from torchrun's environment (else one rank)."""
        check_int("tp_size", tp_size, minimum=1)
        lws = _arg_or_env("local_world_size", local_world_size, "LOCAL_WORLD_SIZE", 1, minimum=1)
        lr = _arg_or_env("local_rank", local_rank, "LOCAL_RANK", 0, minimum=0)
        _check_tp(tp_size, lws)  # before WORLD_SIZE: the more basic mistake
        if dp_size is None:
            world = _arg_or_env("WORLD_SIZE", None, "WORLD_SIZE", lws, minimum=1)
            if world % tp_size:
                raise ValueError(
                    f"tp_size must divide WORLD_SIZE={world} to derive dp_size, got "
                    f"tp_size={tp_size}; pass dp_size"
                )
            dp_size = world // tp_size
        if dp_rank is None:
            dp_rank = _arg_or_env("RANK", None, "RANK", lr, minimum=0) // tp_size
        return cls(lr, lws, tp_size, dp_rank, dp_size)


def segment_namespace(job_id: str | None, name: str, layout: RankLayout) -> str:
    """``<job>_<name>_d<dp_first>``: the same on every local rank, without talking.

    ``<job>`` is ``job_id``, else torchrun's ``TORCHELASTIC_RUN_ID`` joined with
    ``MASTER_ADDR:MASTER_PORT`` (the run id alone is ``"none"`` unless ``--rdzv-id`` is
    given, for every job); a single local rank needs none. ``dp_first`` tells apart the
    nodes that one host stands in for.
    """
    if job_id is None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id is not None:
            endpoint = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
            job_id = f"{run_id}@{endpoint}"
        elif layout.local_world_size == 1:
            job_id = uuid.uuid4().hex  # nobody else has to find this segment
        else:
            raise ValueError(
                "job_id is required outside torchrun when local_world_size > 1: the local "
                "ranks must agree on the shared-memory segment's name without talking to "
                "each other (under torchrun it comes from TORCHELASTIC_RUN_ID)"
            )
    elif not isinstance(job_id, str) or not job_id:
        raise ValueError(f"job_id must be a non-empty str, got {job_id!r}")
    readable = re.sub(r"[^A-Za-z0-9-]", "", job_id)[:24]
    digest = hashlib.blake2b(job_id.encode(), digest_size=4).hexdigest()
    return f"{readable}{digest}_{name}_d{layout.dp_first}"


def _check_tp(tp: int, lws: int) -> None:
    if lws % tp:
        raise ValueError(
            f"tp_size must divide local_world_size (a TP group stays on one node), got "
            f"tp_size={tp}, local_world_size={lws}"
        )


def _arg_or_env(arg: str, value: int | None, env: str, default: int, *, minimum: int) -> int:
    if value is not None:
        check_int(arg, value, minimum=minimum)
        return int(value)
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        parsed = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {env} must be an int, got {raw!r}") from None
    if parsed < minimum:
        raise ValueError(f"environment variable {env} must be >= {minimum}, got {parsed}")
    return parsed


def check_int(name: str, value: object, *, minimum: int) -> None:
    """``value`` is an int (not a bool) >= ``minimum``, or TypeError / ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
