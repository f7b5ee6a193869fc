"""ZeroDataParallel against the same model trained in one process (gloo ranks)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ms_testing.dist import launch, run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _models import OPTIMIZERS, adamw, batches, make_net, reference  # noqa: E402

from ms_parallel import CollectiveTimeout, ZeroDataParallel  # noqa: E402

STEPS = 4


def _rank_train(opt_name: str, global_batch: int, accum: int, bucket_mb: float, prefetch: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    net = make_net()
    zero = ZeroDataParallel(net, dist.group.WORLD, bucket_mb=bucket_mb, prefetch=prefetch)
    opt = zero.attach_optimizer(OPTIMIZERS[opt_name](zero.optimizer_param_groups()))
    local = global_batch // world
    micro = local // accum
    losses = []
    for tokens, targets in batches(STEPS, global_batch):
        tokens = tokens[rank * local : (rank + 1) * local]
        targets = targets[rank * local : (rank + 1) * local]
        total = torch.zeros(())
        for m in range(accum):
            part = slice(m * micro, (m + 1) * micro)
            last = m == accum - 1
            ctx = zero.no_sync() if not last else _null()
            with ctx:
                loss = zero(tokens[part], targets[part])
                (loss / accum).backward()
            total += loss.detach() / accum
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    zero.gather_params()
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}, len(zero.buckets)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "accum", "bucket_mb", "opt_name"),
    [
        (2, 1, 25.0, "adamw"),
        (2, 2, 0.002, "adamw"),  # buckets of ~500 floats: many, uneven, some params larger
        (4, 1, 0.002, "sgd"),
        (4, 2, 25.0, "adamw"),
    ],
)
def test_matches_one_process(world, accum, bucket_mb, opt_name):
    global_batch = 8
    ref_losses, ref_params = reference(
        STEPS, global_batch, lambda n: OPTIMIZERS[opt_name](n.parameters())
    )
    out = run_ranks(
        _rank_train, world, args=(opt_name, global_batch, accum, bucket_mb, True), timeout=120
    )
    for losses, params, _ in out:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    if bucket_mb < 1:
        assert out[0][2] > 6  # the small cap really split the chunks


@pytest.mark.slow
def test_serialized_mode_is_the_same_training():
    a = run_ranks(_rank_train, 2, args=("adamw", 8, 1, 0.002, False), timeout=120)
    b = run_ranks(_rank_train, 2, args=("adamw", 8, 1, 0.002, True), timeout=120)
    assert a[0][0] == b[0][0]
    for name in a[0][1]:
        assert torch.equal(a[0][1][name], b[0][1][name])


def _rank_events(prefetch_chunks):
    rank = dist.get_rank()
    events: list[tuple[str, str, dict]] = []
    net = make_net()
    zero = ZeroDataParallel(
        net,
        dist.group.WORLD,
        prefetch_chunks=prefetch_chunks,
        on_event=lambda name, kind, t, **a: events.append((name, kind, a)),
    )
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    for tokens, targets in batches(2, 4):
        zero(tokens[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
        opt.step()
    return events, len(zero._chunks)


@pytest.mark.slow
@pytest.mark.parametrize("prefetch_chunks", [None, 1])
def test_events_show_chained_prefetch(prefetch_chunks):
    events, n_chunks = run_ranks(_rank_events, 2, args=(prefetch_chunks,), timeout=60)[0]
    # Step 1 needs no gather (the weights start equal); step 2's begin after the first step.
    first_ag = next(i for i, e in enumerate(events) if e[0] == "all_gather")
    step2 = events[first_ag:]

    def index(name, kind, chunk):
        return next(
            i for i, e in enumerate(step2) if e[:2] == (name, kind) and e[2]["chunk"] == chunk
        )

    for k in range(n_chunks - 1):
        # The next chunk's gather is issued before this chunk computes...
        assert index("all_gather", "issue", k + 1) < index("chunk", "compute_begin", k)
        # ...and waited only when that next chunk is about to compute.
        assert index("chunk", "compute_begin", k) < index("all_gather", "wait_begin", k + 1)
    for k in range(n_chunks - 2):
        ahead = index("all_gather", "issue", k + 2) < index("chunk", "compute_begin", k)
        # All gathers go out as the step ends by default; a chain of 1 issues chunk
        # k + 2's only when chunk k + 1 starts.
        assert ahead == (prefetch_chunks is None)
    # Reduce-scatters start during backward, before the last one is waited.
    issues = [i for i, e in enumerate(events) if e[:2] == ("reduce_scatter", "issue")]
    waits = [i for i, e in enumerate(events) if e[:2] == ("reduce_scatter", "wait_begin")]
    assert len(issues) == len(waits) > 1
    assert issues[1] < waits[0]


def _rank_stuck(timeout_s: float, prefetch_chunks):
    rank = dist.get_rank()
    net = make_net()
    zero = ZeroDataParallel(
        net, dist.group.WORLD, timeout_s=timeout_s, prefetch_chunks=prefetch_chunks
    )
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    tokens, targets = batches(1, 4)[0]
    zero(tokens[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
    opt.step()
    if rank == 1:
        import time

        time.sleep(timeout_s * 4)  # stops participating
        return "slept"
    try:
        zero(tokens[:2], targets[:2]).backward()
    except CollectiveTimeout as e:
        return str(e)
    return "no error"


# Rank 1's optimizer step issued the gathers of chunks 0 and 1 (a chain of 1 ahead of
# the first) before it stopped: chunk 2's is the first it never joined. (By default its
# step issues every gather, and the first collective it misses is a reduce-scatter;
# gloo's emulated reduce-scatter ignores wait(timeout), so there only the group's own
# timeout bounds the wait: ms-train sets it to parallel.collective_timeout_s.)
@pytest.mark.slow
@pytest.mark.parametrize(("prefetch_chunks", "op", "chunk"), [(1, "all_gather", "chunk 2")])
def test_a_rank_that_stops_participating_is_named(prefetch_chunks, op, chunk):
    report = launch(_rank_stuck, 2, args=(2.0, prefetch_chunks), timeout=60)
    message = report.outcomes[0].value
    assert isinstance(message, str), report.outcomes[0].error
    assert message.startswith(f"{op} ({chunk}, bucket "), message
    assert "rank 0" in message
    assert "ranks 0, 1" in message
    assert "within 2 s" in message
    assert report.outcomes[1].value == "slept"


def _rank_errors():
    net = make_net()
    with pytest.raises(ValueError, match="bucket_mb"):
        ZeroDataParallel(net, dist.group.WORLD, bucket_mb=0)
    with pytest.raises(TypeError, match="group must be"):
        ZeroDataParallel(net, "world")  # type: ignore[arg-type]
    zero = ZeroDataParallel(make_net(), dist.group.WORLD)
    with pytest.raises(ValueError, match="not a trainable parameter"):
        zero.optimizer_param_groups([{"params": [torch.zeros(3, requires_grad=True)]}])
    with pytest.raises(ValueError, match="not one of this wrapper's shard views"):
        zero.attach_optimizer(adamw(make_net().parameters()))
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    tokens, targets = batches(1, 4)[0]
    with zero.no_sync():
        zero(tokens[:2], targets[:2]).backward()
    with pytest.raises(RuntimeError, match="before the gradients were reduced"):
        opt.step()
    return True


@pytest.mark.slow
def test_errors():
    assert run_ranks(_rank_errors, 2, timeout=60) == [True, True]


def test_needs_an_initialized_group():
    with pytest.raises(RuntimeError, match=r"torch\.distributed to be initialized"):
        ZeroDataParallel(make_net(), object())  # type: ignore[arg-type]


@pytest.mark.parametrize("accum", [1, 2])
def test_one_process_without_a_group_matches_plain_training(accum):
    ref_losses, ref_params = reference(STEPS, 8, lambda n: adamw(n.parameters()))
    net = make_net()
    zero = ZeroDataParallel(net, None, bucket_mb=0.002)
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    losses = []
    for tokens, targets in batches(STEPS, 8):
        total = 0.0
        for m in range(accum):
            part = slice(m * 8 // accum, (m + 1) * 8 // accum)
            with zero.no_sync() if m < accum - 1 else _null():
                loss = zero(tokens[part], targets[part])
                (loss / accum).backward()
            total += loss.item() / accum
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name], rtol=1e-5, atol=1e-6)
    state = zero.optimizer_state_dict(opt)
    assert all(type(v) is torch.Tensor for e in state["params"].values() for v in e.values())
    assert set(state["params"]) == {n for n, _ in net.named_parameters()}


def _dropped_wrapper_is_freed(distributed: bool) -> tuple[bool, bool]:
    """Build, train a step, drop: is anything of the wrapper or its model left?"""
    import gc
    import weakref

    group = dist.group.WORLD if distributed else None
    rank = dist.get_rank() if distributed else 0
    net = make_net()
    zero = ZeroDataParallel(net, group, replicated_chunks=1)
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    tokens, targets = batches(1, 4)[0]
    zero(tokens[rank * 2 : rank * 2 + 2], targets[rank * 2 : rank * 2 + 2]).backward()
    zero.step(opt)
    wrapper, model = weakref.ref(zero), weakref.ref(net)
    del zero, net, opt
    gc.collect()
    return wrapper() is None, model() is None


@pytest.mark.slow
def test_a_dropped_wrapper_frees_its_model_and_buffers():
    # torch holds post-accumulate-grad hooks out of the garbage collector's sight: a
    # hook holding the wrapper made every dropped wrapper and its model immortal.
    assert _dropped_wrapper_is_freed(False) == (True, True)
    assert run_ranks(_dropped_wrapper_is_freed, 2, args=(True,), timeout=60) == [
        (True, True),
        (True, True),
    ]
