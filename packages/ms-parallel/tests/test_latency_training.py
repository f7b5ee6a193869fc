"""torch's own data parallelism runs on the latency backend and computes the same thing:
DDP (its C++ reducer's bucketed all-reduces) gives the parameters DDP over plain gloo
gives, and FSDP2 (``fully_shard`` on a 1-D DeviceMesh made from a latency group, ZeRO-2
form, explicit prefetching) gives the parameters of the same training in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from ms_parallel.events import EventLog
from ms_parallel.latency import register_latency_backend
from ms_testing import run_ranks

pytestmark = pytest.mark.slow  # each test starts 2 rank processes

NAME = "mstest_latency"
WORLD = 2
STEPS = 3
BATCH = 4  # per rank
WIDTH = 16


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, 2 * WIDTH),
        nn.Tanh(),
        nn.Linear(2 * WIDTH, 2 * WIDTH),
        nn.Tanh(),
        nn.Linear(2 * WIDTH, WIDTH),
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def train_ddp(group: dist.ProcessGroup, rank: int) -> dict[str, torch.Tensor]:
    model = make_model()
    # A small bucket, so that the reducer issues several all-reduces per backward.
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        loss_of(ddp, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank_ddp() -> dict[str, Any]:
    rank = dist.get_rank()
    log = EventLog()
    register_latency_backend(NAME, latency={"all_reduce": 0.01, "broadcast": 0.01}, on_event=log)
    latency_group = dist.new_group(backend=NAME)
    world = dist.group.WORLD
    assert latency_group is not None and world is not None
    over_gloo = train_ddp(world, rank)
    over_latency = train_ddp(latency_group, rank)
    issued = [e.attrs["method"] for e in log.select(kind="issue")]
    return {"gloo": over_gloo, "latency": over_latency, "issued": issued}


def test_ddp_over_latency_trains_like_ddp_over_gloo() -> None:
    results = run_ranks(rank_ddp, WORLD, timeout=180)
    for r in results:
        assert r["gloo"].keys() == r["latency"].keys()
        for k in r["gloo"]:
            assert torch.equal(r["gloo"][k], r["latency"][k]), k
        # the reducer really went through the latency group: its bucketed all-reduces
        # (with the small buckets, more than one per step once DDP has rebuilt them after
        # step 1), after DDP's start-up broadcasts
        assert r["issued"].count("allreduce") > STEPS, " ".join(r["issued"])
        assert "broadcast" in r["issued"]
    first = results[0]["latency"]
    assert not torch.equal(first["0.weight"], make_model().state_dict()["0.weight"])  # it trained
    for k in first:  # and the replicas agree
        assert torch.equal(first[k], results[1]["latency"][k]), k


def rank_fsdp2() -> dict[str, Any]:
    rank = dist.get_rank()
    log = EventLog()
    register_latency_backend(NAME, latency=0.005, on_event=log)
    group = dist.new_group(backend=NAME)
    assert group is not None
    mesh = DeviceMesh.from_group(group, "cpu")
    model = make_model()
    blocks = [m for m in model if isinstance(m, nn.Linear)]
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    fsdp_blocks = [b for b in blocks if isinstance(b, FSDPModule)]
    assert len(fsdp_blocks) == len(blocks)
    for i, block in enumerate(fsdp_blocks):
        if i + 1 < len(fsdp_blocks):
            block.set_modules_to_forward_prefetch([fsdp_blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([fsdp_blocks[i - 1]])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, *batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    local = {k: v.to_local().shape for k, v in model.state_dict().items()}
    ops = {e.name for e in log.select(kind="issue")}
    return {"params": full, "local_shapes": local, "losses": losses, "ops": ops}


def train_one_process() -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same steps in one process: each step's batch is every rank's batch together."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)), strict=True)
        loss = loss_of(model, torch.cat(xs), torch.cat(ys))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def test_fsdp2_over_latency_trains_like_one_process() -> None:
    results = run_ranks(rank_fsdp2, WORLD, timeout=180)
    expected, expected_losses = train_one_process()
    for r in results:
        assert r["params"].keys() == expected.keys()
        for k, v in expected.items():
            torch.testing.assert_close(r["params"][k], v, rtol=1e-5, atol=1e-6, msg=k)
            # sharded: each rank holds half of the first dimension
            assert r["local_shapes"][k][0] == v.shape[0] // WORLD, k
        # FSDP2's collectives ran on the latency group
        assert {"all_gather", "reduce_scatter"} <= r["ops"], r["ops"]
    # the mean of the ranks' losses is the one-process loss of the same step
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / WORLD
        assert mean == pytest.approx(expected_losses[step], rel=1e-5)
    assert not torch.equal(expected["0.weight"], make_model().state_dict()["0.weight"])
