"""ms-parallel's ZeRO-2 with ms-optim's sharded LAMB (the two leaves meet through a
plain ShardSpec -> ShardMap), against LAMB on the same model in one process; also with
ZeRO's first chunks kept replicated (``ShardMap.replicated``), and through ms-train's
optimizer factory.

Also bf16 parameters with gradients reduced in fp32, against the same bf16 model whose
gradients are averaged in fp32 by hand.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ms_optim import Lamb, ShardMap, lamb_param_groups
from ms_parallel import ZeroDataParallel, ZeroEngine
from ms_testing.dist import run_ranks
from ms_train.config import OptimConfig
from ms_train.trainer import build_optimizer, optimizer_factory, optimizer_groups

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


def _rank_lamb(
    bucket_mb: float, replicated: int, accum: int
) -> tuple[dict[str, torch.Tensor], int]:
    rank, world = dist.get_rank(), dist.get_world_size()
    net = Net()
    zero = ZeroDataParallel(
        net, dist.group.WORLD, bucket_mb=bucket_mb, replicated_chunks=replicated
    )
    groups = zero.optimizer_param_groups(lamb_param_groups(net, 0.01))
    shards = ShardMap(
        param_ids=zero.group_param_ids(groups),
        numels=zero.param_numels,
        replicated=zero.group_replicated(groups),
    )
    opt = zero.attach_optimizer(lamb(groups, shards=shards, process_group=zero.group))
    local = BATCH // world
    micro = local // accum
    for tokens, targets in data():
        mine = tokens[rank * local : (rank + 1) * local], targets[rank * local : (rank + 1) * local]
        for m in range(accum):
            part = slice(m * micro, (m + 1) * micro)
            with zero.no_sync() if m < accum - 1 else contextlib.nullcontext():
                (zero(mine[0][part], mine[1][part]) / accum).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    zero.gather_params()
    return {k: v.clone() for k, v in net.state_dict().items()}, len(shards.replicated)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "bucket_mb", "replicated", "accum"),
    [
        (2, 25.0, 0, 1),
        (4, 0.001, 0, 1),
        (2, 25.0, 1, 2),  # the embedding replicated
        (2, 0.001, 2, 1),  # and the first block
        (4, 0.001, 2, 2),
    ],
)
def test_sharded_lamb_under_zero_matches_one_process(
    world: int, bucket_mb: float, replicated: int, accum: int
) -> None:
    ref = one_process()
    args = (bucket_mb, replicated, accum)
    for state, n_replicated in run_ranks(_rank_lamb, world, args=args, timeout=120):
        assert (n_replicated > 0) == (replicated > 0)
        for name, value in ref.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


CONFIG = OptimConfig(name="lamb", lr=2e-2, weight_decay=0.01)
CLIP = 0.5


def _loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return module(*batch)


def _rank_factory(replicated: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """ms-train's optimizer factory on ZeroEngine: the ShardSpec's replicated tensors
    reach LAMB's ShardMap."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = Net()
    engine = ZeroEngine(bucket_mb=0.001, replicated_chunks=replicated)
    engine.setup(net, optimizer_groups(net, CONFIG), optimizer_factory(CONFIG))
    assert isinstance(engine.optimizer, Lamb) and engine.optimizer.shards is not None
    assert engine.optimizer.shards.replicated
    local = BATCH // world
    norms = []
    for tokens, targets in data():
        mine = iter(
            [
                (
                    tokens[rank * local : (rank + 1) * local],
                    targets[rank * local : (rank + 1) * local],
                )
            ]
        )
        norms.append(
            engine.step(mine.__next__, _loss, grad_accum=1, max_norm=CLIP).grad_norm.item()
        )
    return {k: v.clone() for k, v in engine.state()["model"].state_dict().items()}, norms


@pytest.mark.slow
def test_trainer_factory_passes_replicated_tensors_to_lamb() -> None:
    net = Net()
    opt = build_optimizer(net, CONFIG)
    ref_norms = []
    for tokens, targets in data():
        net(tokens, targets).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert min(ref_norms) > CLIP  # the clipping acts
    for state, norms in run_ranks(_rank_factory, 2, args=(2,), timeout=120):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for name, value in net.state_dict().items():
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
