"""The chunk count of each collective matmul, measured on the job's own group and shapes.

How many pieces pay off depends on the GEMM's size, the link's latency and bandwidth,
and how the backend overlaps: too few leave the first piece's communication exposed,
too many make GEMMs too small and collectives too many. :class:`ChunkTuner` therefore
measures: the first time a layer meets a shape, every candidate count runs that
layer's fused forward and backward on random inputs of the shape a few times, the
slowest rank's median decides (so every rank of the TP group picks the same count), and
the choice is kept for the shape. A plan is ``Stateful``: saved with a checkpoint, a
resumed run uses the same counts (they change the order of floating-point sums, so the
resume stays bit for bit), and a plan can be measured once and given to later jobs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ms_parallel._tp_comm import TPComm
from ms_parallel._wait import wait_bounded

__all__ = ["DEFAULT_CANDIDATES", "ChunkTuner"]

#: The chunk counts tried by default.
DEFAULT_CANDIDATES = (1, 2, 4, 8)
_FORMAT = 1


class ChunkTuner:
    """Chooses, per shape, the chunk count of the collective matmuls that ask it.

    Args:
        candidates: the counts tried (ints >= 1).
        reps: timed forward-and-backward passes per candidate (after one untimed).
        group: the ranks that agree on every count: by default each TP group decides
            for itself; a data-parallel job's replicas must agree too (their plans go
            into one checkpoint), so pass the group of all of them (every rank of it
            meets each shape at the same point, as its layers run in lockstep).
    """

    def __init__(
        self,
        candidates: Sequence[int] = DEFAULT_CANDIDATES,
        reps: int = 3,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        cands = tuple(candidates)
        if not cands or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in cands):
            raise ValueError(f"candidates must be ints >= 1, got {candidates!r}")
        if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
            raise ValueError(f"reps must be an int >= 1, got {reps!r}")
        self.candidates = cands
        self.reps = reps
        self.group = group
        #: shape key -> chosen chunks
        self.plan: dict[str, int] = {}
        #: shape key -> {candidate: slowest rank's median seconds}, for what was measured here
        self.timings: dict[str, dict[int, float]] = {}

    def choose(self, key: str, comm: TPComm, run: Callable[[int], None]) -> int:
        """The count for ``key``: from the plan, else measured with ``run(chunks)`` (one
        forward and backward at that count) on every rank of ``comm``'s group."""
        if key in self.plan:
            return self.plan[key]
        rows = self._rows(key)
        tried = [c for c in self.candidates if c <= max(1, rows)] or [1]
        seconds = []
        for c in tried:
            run(c)  # untimed: first-call allocations and caches
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                run(c)
                times.append(time.perf_counter() - t0)
            seconds.append(statistics.median(times))
        slowest = torch.tensor(seconds, dtype=torch.float64)
        group = self.group if self.group is not None else comm.group
        if group is not None and dist.get_world_size(group) > 1:
            work = dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group, async_op=True)
            wait_bounded(
                work, op="all_reduce", group=group, where="chunk tuning", timeout_s=comm.timeout_s
            )
        self.timings[key] = dict(zip(tried, slowest.tolist(), strict=True))
        best = tried[int(torch.argmin(slowest).item())]
        self.plan[key] = best
        return best

    @staticmethod
    def _rows(key: str) -> int:
        try:
            return int(key.split("rows=")[1].split(",")[0])
        except (IndexError, ValueError):
            return 1

    def state_dict(self) -> dict[str, Any]:
        return {"format": _FORMAT, "plan": dict(self.plan)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            got = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"a ChunkTuner state must have format {_FORMAT}, got {got!r}")
        plan = state.get("plan")
        if not isinstance(plan, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 1 for k, v in plan.items()
        ):
            raise ValueError(f"a ChunkTuner plan maps shape keys to ints >= 1, got {plan!r}")
        self.plan = dict(plan)


def shape_key(kind: str, x: torch.Tensor, weights: Sequence[torch.Tensor], size: int) -> str:
    """What a chunk count depends on: the op, the rows split, the GEMMs' sizes, the dtype
    and the group's size."""
    rows = x.numel() // x.shape[-1]
    ws = ";".join(f"{w.shape[0]}x{w.shape[1]}" for w in weights)
    return (
        f"{kind}:rows={rows},k={x.shape[-1]},w={ws},{str(x.dtype).removeprefix('torch.')},tp={size}"
    )
