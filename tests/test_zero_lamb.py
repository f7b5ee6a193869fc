"""ms-parallel's ZeRO-2 with ms-optim's sharded LAMB (the two leaves meet through a
plain ShardSpec -> ShardMap), against LAMB on the same model in one process.

Also bf16 parameters with gradients reduced in fp32, against the same bf16 model whose
gradients are averaged in fp32 by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ms_optim import Lamb, ShardMap, lamb_param_groups
from ms_parallel import ZeroDataParallel
from ms_testing.dist import run_ranks

BATCH, STEPS, SEQ, VOCAB = 8, 4, 6, 29


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 20, dtype=dtype)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(20, dtype=dtype), nn.Linear(20, 20, dtype=dtype))
            for _ in range(3)
        )
        self.head = nn.Linear(20, VOCAB, dtype=dtype)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        logits = self.head(x).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def lamb(groups, **kwargs):
    return Lamb(groups, lr=2e-2, weight_decay=0.01, max_grad_norm=1.0, **kwargs)


def one_process() -> dict[str, torch.Tensor]:
    net = Net()
    opt = lamb(lamb_param_groups(net, 0.01))
    for tokens, targets in data():
        net(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.clone() for k, v in net.state_dict().items()}


def _rank_lamb(bucket_mb: float) -> dict[str, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    net = Net()
    zero = ZeroDataParallel(net, dist.group.WORLD, bucket_mb=bucket_mb)
    groups = zero.optimizer_param_groups(lamb_param_groups(net, 0.01))
    shards = ShardMap(param_ids=zero.group_param_ids(groups), numels=zero.param_numels)
    opt = zero.attach_optimizer(lamb(groups, shards=shards, process_group=zero.group))
    local = BATCH // world
    for tokens, targets in data():
        mine = slice(rank * local, (rank + 1) * local)
        zero(tokens[mine], targets[mine]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    zero.gather_params()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize(("world", "bucket_mb"), [(2, 25.0), (4, 0.001)])
def test_sharded_lamb_under_zero_matches_one_process(world: int, bucket_mb: float) -> None:
    ref = one_process()
    for state in run_ranks(_rank_lamb, world, args=(bucket_mb,), timeout=120):
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _rank_bf16() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The reduced fp32 gradients ZeRO hands the optimizer, and the fp32 mean of every
    rank's bf16 gradients computed by hand."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = data()[0]
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    plain = Net(torch.bfloat16)
    plain(tokens[mine], targets[mine]).backward()
    by_hand = []
    for p in plain.parameters():
        g = p.grad.float()
        dist.all_reduce(g)
        by_hand.append(g / world)
    net = Net(torch.bfloat16)
    zero = ZeroDataParallel(net, dist.group.WORLD, reduce_dtype=torch.float32)
    zero.attach_optimizer(torch.optim.SGD(zero.optimizer_param_groups(), lr=0.0))
    zero(tokens[mine], targets[mine]).backward()
    reduced = [b.grad_shard for b in zero.buckets]
    expected = []
    for b in zero.buckets:
        flat = torch.cat([by_hand[s.index].reshape(-1) for s in b.layout.slots])
        expected.append(flat[b.lo : b.lo + b.shard])
    return reduced, expected


@pytest.mark.slow
def test_bf16_parameters_reduce_in_fp32() -> None:
    for reduced, expected in run_ranks(_rank_bf16, 2, timeout=120):
        for got, want in zip(reduced, expected, strict=True):
            assert got.dtype == torch.float32
            # bf16 gradients summed in fp32: equal up to the order of one addition.
            torch.testing.assert_close(got[: want.numel()], want, rtol=1e-6, atol=1e-7)
