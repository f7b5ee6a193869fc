"""A peer that stops participating in a reduce-scatter: gloo ignores ``wait(timeout)``
for that op, so the process group's own timeout ends the wait; the error still names
the op, the chunk, the group and the rank, and says how long the wait really lasted."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ms_testing.dist import launch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _models import batches, make_net  # noqa: E402

from ms_parallel import CollectiveTimeout, ZeroDataParallel  # noqa: E402

GROUP_TIMEOUT_S = 4.0  # the process group's own bound, as ms-train sets it
WAIT_S = 1.0  # ZeroDataParallel's, which gloo's reduce-scatter does not honour


def _rank_stops_before_backward() -> tuple[str, float | None]:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    rank = int(os.environ["RANK"])
    store = TCPStore(
        "127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=GROUP_TIMEOUT_S)
    )
    zero = ZeroDataParallel(make_net(), dist.group.WORLD, timeout_s=WAIT_S)
    opt = zero.attach_optimizer(torch.optim.AdamW(zero.optimizer_param_groups(), lr=1e-3))
    tokens, targets = batches(1, 4)[0]
    zero(tokens[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
    opt.step()  # issues every gather of the next step; both ranks join them
    if rank == 1:
        time.sleep(GROUP_TIMEOUT_S * 2)  # joins no reduce-scatter of the second step
        return ("slept", None)
    try:
        zero(tokens[:2], targets[:2]).backward()
    except CollectiveTimeout as e:
        return (str(e), e.waited_s)
    return ("no error", None)


@pytest.mark.slow
def test_a_reduce_scatter_without_its_peer_is_named_with_how_long_it_waited() -> None:
    report = launch(_rank_stops_before_backward, 2, init_process_group=False, timeout=90)
    assert report.outcomes[0].value is not None, report.describe()
    message, waited = report.outcomes[0].value
    assert waited is not None and waited >= GROUP_TIMEOUT_S * 0.9, (waited, message)
    assert message.startswith("reduce_scatter (chunk "), message
    assert ", bucket " in message and "ranks 0, 1" in message and "on rank 0" in message
    assert f"within {WAIT_S:g} s" in message
    assert "gave up only after" in message and "process group's own timeout" in message
    assert report.outcomes[1].value == ("slept", None)
