"""ZeroDataParallel.step: an element-wise optimizer stepped chunk by chunk, each chunk's
all-gather issued as soon as its shard is updated, is the same training as one step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ms_testing.dist import run_ranks

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _models import OPTIMIZERS, accumulate, adamw, batches, make_net, reference  # noqa: E402

from ms_parallel import ZeroDataParallel  # noqa: E402

STEPS = 4


def _train(zero, opt, rank, world, accum, mode):
    """STEPS steps on this rank's part of the global batch of 8; ``mode``: "plain"
    (``opt.step()``), "default" (``zero.step(opt)``), "chunks" (``by_chunk=True``) or
    "one" (``by_chunk=False``). Returns the losses and the optimizer calls per step."""
    calls: list[int] = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    local = 8 // world
    losses, per_step = [], []
    for tokens, targets in batches(STEPS, 8):
        mine = slice(rank * local, (rank + 1) * local)
        total = accumulate(zero, tokens[mine], targets[mine], accum)
        before = len(calls)
        if mode == "plain":
            opt.step()
        elif mode == "default":
            zero.step(opt)
        else:
            zero.step(opt, by_chunk=mode == "chunks")
        per_step.append(len(calls) - before)
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    zero.gather_params()
    return losses, per_step


def _run(opt_name, accum, bucket_mb, replicated, chain, mode, group, on_event=None):
    rank = 0 if group is None else dist.get_rank()
    world = 1 if group is None else dist.get_world_size()
    net = make_net()
    zero = ZeroDataParallel(
        net,
        group,
        bucket_mb=bucket_mb,
        replicated_chunks=replicated,
        prefetch_chunks=chain,
        on_event=on_event,
    )
    opt = zero.attach_optimizer(OPTIMIZERS[opt_name](zero.optimizer_param_groups()))
    losses, calls = _train(zero, opt, rank, world, accum, mode)
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    return losses, params, calls, len(zero._chunks)


def _calls(n_chunks, replicated, chain):
    """Optimizer calls of a by-chunk step: one per sharded chunk whose gather the step
    issues (all, or those up to chunk ``chain``), one for the other sharded chunks, one
    for all the replicated ones."""
    sharded = range(replicated, n_chunks)
    alone = [k for k in sharded if chain is None or k <= chain]
    return len(alone) + (len(alone) < len(sharded)) + (replicated > 0)


def _rank_both(opt_name, accum, bucket_mb, replicated, chain):
    group = dist.group.WORLD
    return {
        mode: _run(opt_name, accum, bucket_mb, replicated, chain, mode, group)
        for mode in ("plain", "default")
    }


CASES = [
    ("adamw", 1, 25.0, 0, None),
    ("adamw", 2, 0.002, 0, None),  # many uneven buckets, a parameter larger than one
    ("sgd", 1, 0.002, 1, None),  # the first chunk replicated
    ("adamw", 2, 0.002, 2, None),  # two replicated, stepped after the sharded ones
    ("adamw", 1, 25.0, 0, 1),  # the paper's chain of 1
    ("adamw", 1, 25.0, 2, 1),  # a chain of 1 whose first chunks are replicated
]


@pytest.mark.slow
@pytest.mark.parametrize(("opt_name", "accum", "bucket_mb", "replicated", "chain"), CASES)
def test_by_chunk_is_the_same_training(opt_name, accum, bucket_mb, replicated, chain):
    """zero.step(opt), by chunk for these optimizers, against opt.step() (one call, every
    gather after it) bit for bit, and against one process on the whole batch."""
    ref_losses, ref_params = reference(STEPS, 8, lambda n: OPTIMIZERS[opt_name](n.parameters()))
    out = run_ranks(
        _rank_both, 2, args=(opt_name, accum, bucket_mb, replicated, chain), timeout=120
    )
    for runs in out:
        plain, chunked = runs["plain"], runs["default"]
        n_chunks = chunked[3]
        assert plain[2] == [1] * STEPS
        # One optimizer call per sharded chunk (with a chain of 1, those up to chunk 1
        # and the rest), and one for the replicated ones.
        assert chunked[2] == [_calls(n_chunks, replicated, chain)] * STEPS
        assert chunked[0] == plain[0]
        for name, p in plain[1].items():
            assert torch.equal(chunked[1][name], p), name
        assert chunked[0] == pytest.approx(ref_losses, rel=1e-5)
        for name, ref in ref_params.items():
            torch.testing.assert_close(chunked[1][name], ref, rtol=1e-5, atol=1e-6, msg=name)


def _rank_events(chain, replicated=0):
    events: list[tuple[str, str, dict]] = []
    _, _, calls, n_chunks = _run(
        "adamw",
        1,
        0.002,
        replicated,
        chain,
        "default",
        dist.group.WORLD,
        on_event=lambda name, kind, t, **a: events.append((name, kind, a)),
    )
    return events, calls, n_chunks


@pytest.mark.slow
@pytest.mark.parametrize("chain", [None, 1])
def test_events_show_each_gather_issued_as_its_chunk_is_stepped(chain):
    for events, calls, n_chunks in run_ranks(_rank_events, 2, args=(chain,), timeout=60):
        # Chunks 0 and 1 on their own with a chain of 1, the rest in one last call.
        assert calls == [n_chunks if chain is None else 3] * STEPS
        # The first optimizer step's events, up to the second step's first forward.
        start = next(i for i, e in enumerate(events) if e[0] == "optimizer")
        end = next(i for i, e in enumerate(events) if i > start and e[0] == "chunk")
        step = events[start:end]

        def index(name, kind, chunk, step=step):
            return next(
                i for i, e in enumerate(step) if e[:2] == (name, kind) and e[2]["chunk"] == chunk
            )

        chunks = sorted({e[2]["chunk"] for e in step if e[0] == "optimizer"})
        assert chunks == list(range(n_chunks)) and n_chunks > 2
        gathered = sorted(e[2]["chunk"] for e in step if e[:2] == ("all_gather", "issue"))
        # Every chunk's gather during the step by default; with a chain of 1, only the
        # first two chunks' (forward issues the others' one chunk ahead).
        assert sorted(set(gathered)) == (chunks if chain is None else [0, 1])
        for k in sorted(set(gathered)):
            # Chunk k's gather goes out once its shard is updated, before the next chunk
            # is stepped: the rest of the optimizer step hides it.
            issued = index("all_gather", "issue", k)
            assert index("optimizer", "compute_end", k) < issued
            if k + 1 < n_chunks:
                assert issued < index("optimizer", "compute_begin", k + 1)
        # Nothing of it is waited inside the step: the first wait is the next forward's.
        last_end = index("optimizer", "compute_end", chunks[-1])
        waits = [i for i, e in enumerate(step) if e[:2] == ("all_gather", "wait_begin")]
        assert waits and min(waits) > last_end


class FailingAdamW(torch.optim.AdamW):
    """Raises in its second call of a step (a chunk after the first)."""

    calls = 0

    def step(self, closure=None):
        FailingAdamW.calls += 1
        if FailingAdamW.calls == 2:
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


def _rank_failure():
    rank = dist.get_rank()
    net = make_net()
    zero = ZeroDataParallel(net, dist.group.WORLD, bucket_mb=0.002)
    opt = zero.attach_optimizer(FailingAdamW(zero.optimizer_param_groups(), lr=3e-2))
    tokens, targets = batches(2, 4)[0]
    mine = slice(rank * 2, rank * 2 + 2)
    zero(tokens[mine], targets[mine]).backward()
    views = [v for g in opt.param_groups for v in g["params"]]
    with pytest.raises(RuntimeError, match="injected optimizer failure"):
        zero.step(opt, by_chunk=True)
    assert all(v.grad is not None for v in views)  # every gradient put back
    with pytest.raises(RuntimeError, match="before the gradients were reduced"):
        zero.step(opt, by_chunk=True)  # chunk 0 must not be stepped twice
    # The next step runs: the failed chunks are gathered as they are, and the ranks
    # agree on the parameters.
    zero(tokens[mine], targets[mine]).backward()
    zero.step(opt, by_chunk=True)
    zero.gather_params()
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat)
    return bool(torch.equal(both[0], both[1]))


@pytest.mark.slow
def test_a_failing_chunk_leaves_no_step_to_repeat_and_the_ranks_agreeing():
    assert run_ranks(_rank_failure, 2, timeout=60) == [True, True]


@pytest.mark.parametrize("mode", ["default", "chunks", "one"])
def test_one_process_steps_in_one_call_and_matches_plain_training(mode):
    """Without a group there is nothing to gather: every mode is one call."""
    plain = _run("adamw", 2, 0.002, 0, None, "plain", None)
    out = _run("adamw", 2, 0.002, 0, None, mode, None)
    assert out[2] == [1] * STEPS
    assert out[0] == plain[0]
    for name, p in plain[1].items():
        assert torch.equal(out[1][name], p), name


class OwnAdamW(torch.optim.AdamW):
    """A subclass: it may override step, so it is not taken for element-wise."""


def test_other_optimizers_step_in_one_call_by_default():
    net = make_net()
    zero = ZeroDataParallel(net, None, bucket_mb=0.002)
    opt = zero.attach_optimizer(OwnAdamW(zero.optimizer_param_groups(), lr=3e-2, weight_decay=0.1))
    losses, calls = _train(zero, opt, 0, 1, 1, "default")
    assert calls == [1] * STEPS
    plain = _run("adamw", 1, 0.002, 0, None, "plain", None)
    assert losses == plain[0]


def test_step_refuses_an_unattached_optimizer_a_foreign_tensor_and_a_step_before_backward():
    zero = ZeroDataParallel(make_net(), None)
    loose = adamw(zero.optimizer_param_groups())
    with pytest.raises(ValueError, match=r"attached to this wrapper first.*AdamW"):
        zero.step(loose)
    opt = zero.attach_optimizer(adamw(zero.optimizer_param_groups()))
    with pytest.raises(RuntimeError, match="before the gradients were reduced"):
        zero.step(opt)
    tokens, targets = batches(1, 2)[0]
    zero(tokens, targets).backward()
    zero.step(opt)
    with pytest.raises(RuntimeError, match="before the gradients were reduced"):
        zero.step(opt)  # a second step on the same gradients
    opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})
    with pytest.raises(ValueError, match="not one of this wrapper's shard views"):
        zero.step(opt)


@pytest.mark.slow
def test_replicated_chunks_are_stepped_last_while_their_all_reduce_flies():
    """The replicated chunks' all-reduces are the step's last reductions. Backward ends
    without waiting for them: the sharded chunks are stepped and their gathers issued
    first, and the all-reduces are waited only when the replicated chunks are stepped."""
    replicated = 2
    for events, calls, n_chunks in run_ranks(_rank_events, 2, args=(None, replicated), timeout=60):
        assert calls == [_calls(n_chunks, replicated, None)] * STEPS
        start = next(i for i, e in enumerate(events) if e[0] == "optimizer")
        end = next(i for i, e in enumerate(events) if i > start and e[0] == "chunk")
        step = events[start:end]
        # Both all-reduces (one bucket per chunk here) are waited inside the step.
        waited = [e[2]["chunk"] for e in step if e[:2] == ("all_reduce", "wait_begin")]
        assert sorted(set(waited)) == list(range(replicated)), step
        first_wait = min(i for i, e in enumerate(step) if e[:2] == ("all_reduce", "wait_begin"))
        order = [e[2]["chunk"] for e in step if e[:2] == ("optimizer", "compute_begin")]
        assert order == [*range(replicated, n_chunks), *range(replicated)]
        for k in range(replicated, n_chunks):  # every sharded chunk stepped and gathered
            for what in (("optimizer", "compute_end"), ("all_gather", "issue")):
                assert any(e[:2] == what and e[2]["chunk"] == k for e in step[:first_wait])
        for k in range(replicated):  # the replicated ones only after their all-reduce
            begin = next(
                i
                for i, e in enumerate(step)
                if e[:2] == ("optimizer", "compute_begin") and e[2]["chunk"] == k
            )
            assert begin > first_wait
