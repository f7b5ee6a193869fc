"""ZeRO's optimizer state with replicated chunks: their buckets are ``Replicate()``
DTensors, the others ``Shard(0)``, and state saved with one ``replicated_chunks`` and DP
size resumes with another as if training had not stopped; the step engine's norm and
clipping count replicated buckets once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ms_testing.dist import run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _models import batches, make_net, reference  # noqa: E402

from ms_parallel import ZeroDataParallel, ZeroEngine  # noqa: E402

BATCH, TOTAL, DONE = 8, 6, 3
BUCKET_MB = 0.002  # many buckets, some parameters larger than one


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-2, weight_decay=0.1)


def _wrap(net, replicated):
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    zero = ZeroDataParallel(net, group, bucket_mb=BUCKET_MB, replicated_chunks=replicated)
    return zero, zero.attach_optimizer(adamw(zero.optimizer_param_groups()))


def _train(zero, opt, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = BATCH // world
    losses = []
    for tokens, targets in steps:
        mine = slice(rank * local, (rank + 1) * local)
        loss = zero(tokens[mine], targets[mine])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _rank_save(replicated: int):
    """Train DONE steps; the state as saved, whole, with each bucket's placement."""
    net = make_net()
    zero, opt = _wrap(net, replicated)
    losses = _train(zero, opt, batches(DONE, BATCH))
    state = zero.optimizer_state_dict(opt)
    placements = {}
    for b in zero.buckets:
        for s in b.layout.slots:
            for value in state["params"][s.name].values():
                if zero.group is None:
                    assert type(value) is torch.Tensor
                    continue
                assert isinstance(value, DTensor)
                placements[s.name] = (b.replicated, value.dim(), value.placements)
    whole = {
        n: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in e.items()}
        for n, e in state["params"].items()
    }
    zero.gather_params()
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return losses, {**state, "params": whole}, params, placements


def _rank_resume(replicated: int, saved, params):
    """Resume from ``saved`` three ways: whole tensors; DTensors placed as this run's
    own state is (what a resharding checkpointer hands back); and every parameter's as
    ``Shard(0)``, replicated chunks' included (each rank must gather those)."""
    out = {}
    for how in ("whole", "live", "sharded"):
        net = make_net(seed=123)  # other weights: everything must come from the checkpoint
        net.load_state_dict(params)
        zero, opt = _wrap(net, replicated)
        state = saved
        if how != "whole" and zero.group is not None:
            mesh = zero.device_mesh()
            live = zero.optimizer_state_dict(opt)  # created as a checkpointer would see it
            state = {
                **saved,
                "params": {
                    n: {
                        k: distribute_tensor(
                            v,
                            mesh,
                            live["params"][n][k].placements
                            if how == "live" or v.dim() == 0
                            else [Shard(0)],
                        )
                        for k, v in e.items()
                    }
                    for n, e in saved["params"].items()
                },
            }
        zero.load_optimizer_state_dict(opt, state)
        losses = _train(zero, opt, batches(TOTAL, BATCH)[DONE:])
        zero.gather_params()
        out[how] = (losses, {n: p.detach().clone() for n, p in net.named_parameters()})
    return out


@pytest.fixture(scope="module")
def uninterrupted():
    return reference(TOTAL, BATCH, lambda n: adamw(n.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after"),
    [
        # Fewer replicated chunks (2 -> 1) and more (1 -> 3), each with another DP size,
        # and more at the same DP size, where only the replicated count changes.
        ((2, 0), (2, 1)),
        ((2, 2), (4, 1)),  # and another DP size
        ((4, 1), (1, 3)),  # into one process
    ],
    ids=lambda c: f"dp{c[0]}-replicated{c[1]}",
)
def test_resume_with_other_replicated_chunks(before, after, uninterrupted):
    ref_losses, ref_params = uninterrupted
    losses, saved, params, placements = run_ranks(
        _rank_save, before[0], args=(before[1],), timeout=120
    )[0]
    assert losses == pytest.approx(ref_losses[:DONE], rel=1e-5)
    assert any(r for r, _, _ in placements.values()) == (before[1] > 0)
    for replicated, dim, placement in placements.values():
        # A replicated chunk's parameter (or a 0-dim one) is whole on every rank.
        assert placement == ((Replicate(),) if replicated or dim == 0 else (Shard(0),))
    for resumed in run_ranks(_rank_resume, after[0], args=(after[1], saved, params), timeout=180):
        for how, (rest, final) in resumed.items():
            assert rest == pytest.approx(ref_losses[DONE:], rel=1e-5), how
            for name, value in ref_params.items():
                torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _make(groups, shards):
    return adamw(groups)


def _loss(module, batch):
    return module(*batch)


def _rank_engine(replicated: int, accum: int, clip: float):
    rank, world = dist.get_rank(), dist.get_world_size()
    net = make_net()
    engine = ZeroEngine(bucket_mb=BUCKET_MB, replicated_chunks=replicated)
    engine.setup(net, [{"params": list(net.parameters())}], _make)
    local = BATCH // world
    micro = local // accum
    norms = []
    for tokens, targets in batches(4, BATCH):
        mine = tokens[rank * local : (rank + 1) * local], targets[rank * local : (rank + 1) * local]
        parts = iter(
            [
                (mine[0][m * micro : (m + 1) * micro], mine[1][m * micro : (m + 1) * micro])
                for m in range(accum)
            ]
        )
        out = engine.step(parts.__next__, _loss, grad_accum=accum, max_norm=clip)
        norms.append(out.grad_norm.item())
    state = engine.state()["model"].state_dict()
    return norms, {k: v.clone() for k, v in state.items()}


def _clipped_reference(clip):
    net = make_net()
    opt = adamw(net.parameters())
    norms = []
    for tokens, targets in batches(4, BATCH):
        net(tokens, targets).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms, {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("replicated", [2, 6])
def test_engine_clips_with_replicated_chunks_as_one_process(replicated):
    clip = 0.5
    ref_norms, ref_state = _clipped_reference(clip)
    assert min(ref_norms) > clip  # the clipping really acts
    for norms, state in run_ranks(_rank_engine, 2, args=(replicated, 2, clip), timeout=120):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
