"""ZeRO's optimizer state as DTensor, keyed by parameter name: saved at one DP size (or
bucket size), loaded at another, training continues as if uninterrupted; 0.3's
per-bucket form still loads; and the step engines agree with one process."""

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

from ms_parallel import DDPEngine, ZeroDataParallel, ZeroEngine  # noqa: E402

BATCH = 8


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-2, weight_decay=0.1)


def _train(zero, opt, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    local = BATCH // world
    losses = []
    for tokens, targets in steps:
        loss = zero(
            tokens[rank * local : (rank + 1) * local], targets[rank * local : (rank + 1) * local]
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _rank_save(steps: int, bucket_mb: float, single: bool = False):
    net = make_net()
    zero = ZeroDataParallel(net, None if single else dist.group.WORLD, bucket_mb=bucket_mb)
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    losses = _train(zero, opt, batches(steps, BATCH))
    state = zero.optimizer_state_dict(opt)
    assert state["format"] == 2
    shapes = dict((n, p.shape) for n, p in net.named_parameters())
    assert set(state["params"]) == set(shapes)
    for name, entries in state["params"].items():
        assert set(entries) == {"exp_avg", "exp_avg_sq"}, name
        for value in entries.values():
            assert value.shape == shapes[name], name  # the parameter's own shape
            if single:  # no mesh: plain tensors
                assert type(value) is torch.Tensor
            else:
                want = (Shard(0),) if value.dim() else (Replicate(),)
                assert isinstance(value, DTensor) and value.placements == want, name
    full = {
        **state,
        "params": {
            n: {k: v if single else v.full_tensor() for k, v in e.items()}
            for n, e in state["params"].items()
        },
    }
    zero.gather_params()
    return losses, full, {n: p.detach().clone() for n, p in net.named_parameters()}


def _rank_resume(total: int, done: int, bucket_mb: float, saved, params, as_dtensor: bool):
    net = make_net(seed=123)  # other weights: everything must come from the checkpoint
    net.load_state_dict(params)
    zero = ZeroDataParallel(net, dist.group.WORLD, bucket_mb=bucket_mb)
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    if as_dtensor and saved["format"] == 2:  # as a resharding checkpointer hands it back
        mesh = zero.device_mesh()
        saved = {
            **saved,
            "params": {
                n: {
                    k: distribute_tensor(v, mesh, [Shard(0) if v.dim() else Replicate()])
                    for k, v in e.items()
                }
                for n, e in saved["params"].items()
            },
        }
    zero.load_optimizer_state_dict(opt, saved)
    losses = _train(zero, opt, batches(total, BATCH)[done:])
    zero.gather_params()
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


@pytest.fixture(scope="module")
def whole_run():
    """Six uninterrupted steps at DP 2."""
    return run_ranks(_rank_save, 2, args=(6, 0.002), timeout=120)[0]


@pytest.mark.slow
# Grow and shrink, each with one process on one side (plain tensors, no group), and a
# shrink across 4 ranks, where each new shard gathers from two old ones.
@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 1), (1, 2)])
def test_resume_at_another_dp_size(before, after, whole_run):
    """``1`` saves from one process without a group (plain tensors)."""
    bucket_mb = 0.002
    whole = whole_run
    first = run_ranks(_rank_save, before, args=(3, bucket_mb, before == 1), timeout=120)[0]
    losses, saved, params = first
    assert losses == pytest.approx(whole[0][:3], rel=1e-5)
    for as_dtensor in (False, True):
        rest = run_ranks(
            _rank_resume, after, args=(6, 3, bucket_mb, saved, params, as_dtensor), timeout=120
        )[0]
        assert rest[0] == pytest.approx(whole[0][3:], rel=1e-5)
        for name, value in whole[2].items():
            torch.testing.assert_close(rest[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _rank_layout_free():
    zero = ZeroDataParallel(make_net(), dist.group.WORLD, bucket_mb=0.002)
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    _train(zero, opt, batches(2, BATCH))
    state = zero.optimizer_state_dict(opt)
    # Another bucket size is another layout: the state, keyed by name, loads anyway.
    other = ZeroDataParallel(make_net(), dist.group.WORLD, bucket_mb=25.0)
    other_opt = other.attach_optimizer(adamw(other.optimizer_param_groups()))
    assert len(other.buckets) < len(zero.buckets)
    other.load_optimizer_state_dict(other_opt, state)
    again = other.optimizer_state_dict(other_opt)
    for name, entries in state["params"].items():
        for key, value in entries.items():
            assert torch.equal(again["params"][name][key].full_tensor(), value.full_tensor())
    with pytest.raises(ValueError, match="format"):
        other.load_optimizer_state_dict(other_opt, {"format": 99})
    renamed = {**state, "params": {**state["params"], "gone.weight": {}}}
    with pytest.raises(ValueError, match=r"parameters this model does not have: \['gone.weight'\]"):
        other.load_optimizer_state_dict(other_opt, renamed)
    fresh = ZeroDataParallel(make_net(), dist.group.WORLD, bucket_mb=0.002)
    fresh_opt = fresh.attach_optimizer(adamw(fresh.optimizer_param_groups()))
    before = fresh.optimizer_state_dict(fresh_opt)  # created before any step: zeros, step 0
    return sorted(next(iter(before["params"].values())))


def test_state_is_layout_free_and_refusals():
    keys = run_ranks(_rank_layout_free, 2, timeout=60)
    assert keys[0] == keys[1] == ["exp_avg", "exp_avg_sq"]


@pytest.mark.slow
def test_a_format_1_state_from_0_3_resumes_as_if_uninterrupted(whole_run):
    # Written by ms-parallel 0.3.0 after 3 steps of _rank_save at DP 2 (bucket_mb 0.002):
    # its per-bucket optimizer state (whole tensors) and the model's parameters.
    saved = torch.load(HERE / "data" / "zero_state_format1.pt", weights_only=False)
    assert saved["optim"]["format"] == 1
    for bucket_mb in (0.002, 25.0):  # its own layout, and another
        rest = run_ranks(
            _rank_resume,
            2,
            args=(6, 3, bucket_mb, saved["optim"], saved["model"], False),
            timeout=120,
        )[0]
        assert rest[0] == pytest.approx(whole_run[0][3:], rel=1e-5)
        for name, value in whole_run[2].items():
            torch.testing.assert_close(rest[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _make(groups, shards):
    return adamw(groups)


def _loss(module, batch):
    return module(*batch)


def _rank_engine(kind: str, accum: int, clip: float | None):
    rank, world = dist.get_rank(), dist.get_world_size()
    net = make_net()
    engine = ZeroEngine(bucket_mb=0.002) if kind == "zero" else DDPEngine()
    engine.setup(net, [{"params": list(net.parameters())}], _make)
    local = BATCH // world
    micro = local // accum
    losses, norms = [], []
    for tokens, targets in batches(4, BATCH):
        mine = (
            tokens[rank * local : (rank + 1) * local],
            targets[rank * local : (rank + 1) * local],
        )
        parts = iter(
            [
                (mine[0][m * micro : (m + 1) * micro], mine[1][m * micro : (m + 1) * micro])
                for m in range(accum)
            ]
        )
        out = engine.step(parts.__next__, _loss, grad_accum=accum, max_norm=clip)
        losses.append(out.loss.item())
        norms.append(out.grad_norm.item())
    state = engine.state()["model"].state_dict()
    return losses, norms, {k: v.clone() for k, v in state.items()}


def _clipped_reference(clip):
    def make(net):
        return adamw(net.parameters())

    # The reference clips too: run it by hand.
    net = make_net()
    opt = make(net)
    norms = []
    for tokens, targets in batches(4, BATCH):
        net(tokens, targets).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), clip).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms, {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zero", "ddp"])
def test_engines_match_one_process_with_clipping(kind):
    clip = 0.5
    ref_norms, ref_state = _clipped_reference(clip)
    for out in run_ranks(_rank_engine, 2, args=(kind, 2, clip), timeout=120):
        _, norms, state = out
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert min(ref_norms) > clip  # the clipping really acted
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_reference_helper_is_unclipped_training():
    # Guards the helper the other tests lean on: it trains (the loss falls).
    losses, _ = reference(4, BATCH, lambda n: adamw(n.parameters()))
    assert losses[-1] < losses[0]
