"""The one place where ms-optim communicates.

Every collective the optimizer issues goes through :func:`all_reduce_sum`, always
on an explicit process group, so that "one packed all-reduce per step" is a
property of this module's call sites, not of scattered ``dist`` calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum"]


def all_reduce_sum(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` (sum unless ``op`` says otherwise).

    ``out``, when given, receives the result (``tensor`` may live on the
    communication device while ``out`` lives where the caller computes).
    """
    dist.all_reduce(tensor, op=op, group=group)
    if out is not None and out is not tensor:
        out.copy_(tensor)
        return out
    return tensor
