"""Bounded waits under a process group whose works refuse ``wait(timeout)``: ZeRO trains
on it as on gloo, and a peer that stops participating is a timeout only once the bound
has passed (before the fix the refusal itself was read as a timeout, at once)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ms_testing.dist import launch, run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _future_group  # noqa: E402
from _models import batches, make_net  # noqa: E402

from ms_parallel import CollectiveTimeout, ZeroDataParallel  # noqa: E402

WAIT_S = 2.0


def _train(steps: int, future_group: bool) -> list[float]:
    if future_group:
        _future_group.init()
    rank = dist.get_rank()
    zero = ZeroDataParallel(make_net(), dist.group.WORLD, bucket_mb=0.002, timeout_s=30.0)
    opt = zero.attach_optimizer(torch.optim.AdamW(zero.optimizer_param_groups(), lr=1e-2))
    losses = []
    for tokens, targets in batches(steps, 4):
        loss = zero(tokens[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2])
        loss.backward()
        zero.clip_grad_norm_(1.0)
        zero.step(opt)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    zero.gather_params()
    dist.destroy_process_group()
    return losses


@pytest.mark.slow
def test_zero_trains_on_a_group_of_future_works_as_on_gloo() -> None:
    on_gloo = run_ranks(_train, 2, args=(3, False), timeout=120)
    report = launch(_train, 2, args=(3, True), init_process_group=False, timeout=120)
    assert report.ok, report.describe()
    assert [o.value for o in report.outcomes] == on_gloo


def _peer_stops() -> tuple[str, float]:
    _future_group.init()
    rank = dist.get_rank()
    zero = ZeroDataParallel(make_net(), dist.group.WORLD, timeout_s=WAIT_S)
    tokens, targets = batches(1, 4)[0]
    if rank == 1:
        time.sleep(WAIT_S * 3)  # joins no reduce-scatter
        return ("slept", 0.0)
    start = time.monotonic()
    try:
        zero(tokens[:2], targets[:2]).backward()
    except CollectiveTimeout as e:
        return (str(e), time.monotonic() - start)
    return ("no error", time.monotonic() - start)


@pytest.mark.slow
def test_a_stopped_peer_times_out_after_the_bound_not_at_once() -> None:
    report = launch(_peer_stops, 2, init_process_group=False, timeout=90)
    message, waited = report.outcomes[0].value
    assert message.startswith("reduce_scatter (chunk "), message
    assert f"within {WAIT_S:g} s on rank 0" in message, message
    assert waited >= WAIT_S * 0.95, (waited, message)
    assert report.outcomes[1].value == ("slept", 0.0)
