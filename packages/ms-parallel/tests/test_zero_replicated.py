"""ZeroDataParallel with its first chunks kept replicated (``replicated_chunks``): the
same training as one process, all-reduces instead of reduce-scatters for those chunks
and no all-gather, and norms that count them once.

The test model's chunks (``default_chunks`` plus the root's own parameter): 0 the
root's ``scale``, 1 the tied embedding, 2-4 the blocks, 5 the final norm.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ms_testing.dist import launch, run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _models import OPTIMIZERS, accumulate, adamw, batches, make_net, reference  # noqa: E402

from ms_parallel import CollectiveTimeout, EventLog, ZeroDataParallel, ZeroEngine  # noqa: E402

STEPS = 4
BATCH = 8
N_CHUNKS = 6


def _issued(log: EventLog) -> dict[str, Counter]:
    """Per collective, how many were issued for each chunk."""
    out: dict[str, Counter] = {}
    for e in log.select(kind="issue"):
        out.setdefault(e.name, Counter())[e.attrs["chunk"]] += 1
    return out


def _rank_train(opt_name: str, accum: int, bucket_mb: float, replicated: int, prefetch: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    log = EventLog()
    net = make_net()
    zero = ZeroDataParallel(
        net,
        dist.group.WORLD,
        bucket_mb=bucket_mb,
        prefetch=prefetch,
        replicated_chunks=replicated,
        on_event=log,
    )
    opt = zero.attach_optimizer(OPTIMIZERS[opt_name](zero.optimizer_param_groups()))
    local = BATCH // world
    losses = []
    for tokens, targets in batches(STEPS, BATCH):
        mine = slice(rank * local, (rank + 1) * local)
        total = accumulate(zero, tokens[mine], targets[mine], accum)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    zero.gather_params()
    buckets = Counter(b.layout.chunk for b in zero.buckets if b.replicated)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return losses, params, _issued(log), buckets, len(zero.buckets)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "accum", "bucket_mb", "opt_name", "replicated"),
    [
        (2, 1, 25.0, "adamw", 1),
        (2, 2, 0.002, "adamw", 2),  # ~500-float buckets: many, some parameters larger
        (2, 2, 25.0, "sgd", N_CHUNKS),  # every chunk replicated: DDP's communication
        (4, 2, 0.002, "adamw", 2),
    ],
)
def test_matches_one_process(world, accum, bucket_mb, opt_name, replicated):
    ref_losses, ref_params = reference(STEPS, BATCH, lambda n: OPTIMIZERS[opt_name](n.parameters()))
    out = run_ranks(
        _rank_train, world, args=(opt_name, accum, bucket_mb, replicated, True), timeout=120
    )
    for losses, params, issued, buckets, n_buckets in out:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)
            # Never re-synchronized, the replicated parameters stay bit-identical.
            assert torch.equal(params[name], out[0][1][name]), name
        # One all-reduce per replicated bucket and step (accumulation defers it), the
        # replicated chunks are never gathered nor reduce-scattered.
        assert sorted(buckets) == list(range(replicated))
        assert issued.get("all_reduce", Counter()) == Counter(
            {c: n * STEPS for c, n in buckets.items()}
        )
        assert all(c >= replicated for c in issued.get("reduce_scatter", ()))
        assert all(c >= replicated for c in issued.get("all_gather", ()))
        sharded = n_buckets - sum(buckets.values())
        assert sum(issued.get("reduce_scatter", Counter()).values()) == sharded * STEPS
        if replicated < N_CHUNKS:
            assert issued["all_gather"]  # the rest is still ZeRO
        if bucket_mb < 1:
            assert n_buckets > N_CHUNKS  # the small cap really split the chunks


@pytest.mark.slow
def test_serialized_mode_is_the_same_training():
    a = run_ranks(_rank_train, 2, args=("adamw", 2, 0.002, 2, False), timeout=120)
    b = run_ranks(_rank_train, 2, args=("adamw", 2, 0.002, 2, True), timeout=120)
    assert a[0][0] == b[0][0]
    for name in a[0][1]:
        assert torch.equal(a[0][1][name], b[0][1][name]), name
    assert a[0][2] == b[0][2]  # the same collectives, only waited at once


def _rank_events(replicated: int):
    rank = dist.get_rank()
    log = EventLog()
    zero = ZeroDataParallel(
        make_net(), dist.group.WORLD, replicated_chunks=replicated, on_event=log
    )
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    steps = []
    for tokens, targets in batches(2, 4):
        steps.append(len(log))
        zero(tokens[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
        opt.step()
    return [(e.name, e.kind, e.attrs.get("chunk")) for e in log.events], steps


@pytest.mark.slow
def test_events_show_all_reduce_and_no_gather_for_replicated_chunks():
    replicated = 2
    events, (_, step2) = run_ranks(_rank_events, 2, args=(replicated,), timeout=60)[0]
    assert {c for name, _, c in events if name == "all_gather"} == set(range(2, N_CHUNKS))
    assert {c for name, _, c in events if name == "reduce_scatter"} == set(range(2, N_CHUNKS))
    for c in range(replicated):
        kinds = [k for name, k, chunk in events if name == "all_reduce" and chunk == c]
        assert kinds == ["issue", "wait_begin", "wait_end"] * 2, (c, kinds)
    # Issued asynchronously during backward, like the reduce-scatters: every reduction
    # of the step is issued before the first is waited.
    first_wait = next(i for i, e in enumerate(events) if e[1] == "wait_begin")
    reductions = ("all_reduce", "reduce_scatter")
    issues = [i for i, e in enumerate(events[:step2]) if e[1] == "issue" and e[0] in reductions]
    assert len(issues) == N_CHUNKS and max(issues) < first_wait  # a bucket per chunk
    # After the optimizer step, the replicated chunks compute before anything is waited.
    later = events[step2:]
    computed = [later.index(("chunk", "compute_begin", c)) for c in range(replicated)]
    waited = min(i for i, e in enumerate(later) if e[1] == "wait_begin")
    assert max(computed) < waited
    assert later[waited] == ("all_gather", "wait_begin", replicated)


def _rank_norms(configs):
    rank = dist.get_rank()
    tokens, targets = batches(1, BATCH)[0]
    mine = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    out = []
    for replicated, bucket_mb in configs:
        zero = ZeroDataParallel(
            make_net(), dist.group.WORLD, bucket_mb=bucket_mb, replicated_chunks=replicated
        )
        zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
        zero(tokens[mine], targets[mine]).backward()
        before = zero.grad_norm().item()
        after = zero.clip_grad_norm_(0.1)  # returns the norm before clipping
        out.append((before, after.item(), zero.grad_norm().item()))
    return out


@pytest.mark.slow
def test_grad_norm_counts_replicated_buckets_once():
    net = make_net()
    tokens, targets = batches(1, BATCH)[0]
    net(tokens, targets).backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in net.parameters()]))
    configs = [(1, 25.0), (2, 0.002), (N_CHUNKS, 25.0)]
    for norms in run_ranks(_rank_norms, 2, args=(configs,), timeout=60):
        for before, returned, clipped in norms:
            assert before == pytest.approx(want.item(), rel=1e-5)
            assert returned == before
            assert clipped == pytest.approx(0.1, rel=1e-4)


@pytest.mark.parametrize("bad", [-1, N_CHUNKS + 1, True, 1.5, "1"])
def test_replicated_chunks_is_validated(bad):
    match = (
        rf"replicated_chunks must be an int in \[0, {N_CHUNKS}\] \(this module has "
        rf"{N_CHUNKS} chunks\), got {bad!r}"
    )
    with pytest.raises(ValueError, match=match):
        ZeroDataParallel(make_net(), None, replicated_chunks=bad)
    engine = ZeroEngine(replicated_chunks=bad)
    net = make_net()
    with pytest.raises(ValueError, match=match):
        engine.setup(net, [{"params": list(net.parameters())}], lambda g, s: adamw(g))


@pytest.mark.parametrize("accum", [1, 2])
def test_one_process_without_a_group_matches_plain_training(accum):
    ref_losses, ref_params = reference(STEPS, BATCH, lambda n: adamw(n.parameters()))
    net = make_net()
    zero = ZeroDataParallel(net, None, bucket_mb=0.002, replicated_chunks=3)
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    losses = []
    for tokens, targets in batches(STEPS, BATCH):
        total = accumulate(zero, tokens, targets, accum)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name], rtol=1e-5, atol=1e-6)
    assert [b.replicated for b in zero.buckets].count(True) > 1


def _rank_bf16():
    """The reduced fp32 gradients of every bucket, and the fp32 mean of every rank's bf16
    gradients computed by hand."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = batches(1, BATCH)[0]
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    plain = make_net().to(torch.bfloat16)
    plain(tokens[mine], targets[mine]).backward()
    by_hand = []
    for p in plain.parameters():
        g = p.grad.float()
        dist.all_reduce(g)
        by_hand.append(g / world)
    zero = ZeroDataParallel(
        make_net().to(torch.bfloat16),
        dist.group.WORLD,
        reduce_dtype=torch.float32,
        replicated_chunks=2,
    )
    zero.attach_optimizer(torch.optim.SGD(zero.optimizer_param_groups(), lr=0.0))
    zero(tokens[mine], targets[mine]).backward()
    zero.shard_grads()  # waits for the replicated chunks' all-reduces, still in flight
    out = []
    for b in zero.buckets:
        flat = torch.cat([by_hand[s.index].reshape(-1) for s in b.layout.slots])
        n = min(b.shard, b.layout.numel - b.lo)
        out.append((b.replicated, b.grad_shard[:n], flat[b.lo : b.lo + n], b.opt_grad.dtype))
    return out


@pytest.mark.slow
def test_bf16_parameters_all_reduce_in_fp32():
    for buckets in run_ranks(_rank_bf16, 2, timeout=60):
        assert any(r for r, *_ in buckets) and not all(r for r, *_ in buckets)
        for replicated, got, want, opt_dtype in buckets:
            assert got.dtype == torch.float32 and opt_dtype == torch.bfloat16
            if replicated:
                assert got.numel() == want.numel() > 0
            # bf16 gradients summed in fp32: equal up to the order of one addition.
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def _rank_skipped_step():
    """A backward whose step is skipped (as a trainer skips a step with a NaN loss),
    then 3 steps, against the same 3 steps alone: the skipped backward's all-reduces,
    left in flight, are waited by the next forward and change nothing."""
    rank = dist.get_rank()
    data = batches(4, BATCH)
    mine = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    out = []
    for skip_first in (True, False):
        net = make_net()
        zero = ZeroDataParallel(net, dist.group.WORLD, replicated_chunks=2, bucket_mb=0.002)
        opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
        if skip_first:
            zero(data[0][0][mine], data[0][1][mine]).backward()
        for tokens, targets in data[1:]:
            zero(tokens[mine], targets[mine]).backward()
            zero.step(opt)
            opt.zero_grad(set_to_none=True)
        zero.gather_params()
        out.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return out


@pytest.mark.slow
def test_a_skipped_step_leaves_no_reduction_behind():
    for skipped, plain in run_ranks(_rank_skipped_step, 2, timeout=60):
        for name, p in plain.items():
            assert torch.equal(skipped[name], p), name


def _rank_norm_stuck(timeout_s: float):
    rank = dist.get_rank()
    zero = ZeroDataParallel(make_net(), dist.group.WORLD, replicated_chunks=1, timeout_s=timeout_s)
    tokens, targets = batches(1, 4)[0]
    zero(tokens[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
    if rank == 1:
        import time

        zero.shard_grads()  # joins every reduction, then no norm
        time.sleep(timeout_s * 4)
        return "slept"
    try:
        zero.grad_norm()
    except CollectiveTimeout as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_a_gradient_norm_without_its_peer_is_named():
    report = launch(_rank_norm_stuck, 2, args=(2.0,), timeout=60)
    message = report.outcomes[0].value
    assert isinstance(message, str), report.describe()
    assert message.startswith("all_reduce (gradient norm) on process group "), message
    assert "ranks 0, 1" in message and "on rank 0" in message and "within 2 s" in message
    assert report.outcomes[1].value == "slept"
