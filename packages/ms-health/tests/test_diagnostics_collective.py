"""The collective self-test on real gloo ranks: it passes healthy groups, and a peer that
does not join an op, or contributes wrong values, fails it within its timeout, naming
the op and the ranks. The faulty peers are plain ranks that skip or falsify their part."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ms_health.diagnostics import collective_check
from ms_testing.dist import launch, run_ranks

TIMEOUT_S = 3.0  # the check's bound on each op
NUMEL = 64


@pytest.fixture
def solo() -> Iterator[dist.ProcessGroup]:
    """A gloo group of this one process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        assert dist.group.WORLD is not None
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_passes(solo: dist.ProcessGroup) -> None:
    result = collective_check(solo, numel=NUMEL, timeout_s=TIMEOUT_S)
    assert result.ok, result.message
    assert result.evidence["all_reduce"]["ranks"] == [0]
    assert result.evidence["all_to_all"]["ranks"] == [0]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"device": "cuda"}, "group uses gloo: the check runs it on device 'cpu'"),
        ({"device": "tpu"}, "device must be 'cpu', 'cuda'"),
        ({"timeout_s": 0}, "timeout_s must be a finite number > 0"),
        ({"numel": 0}, "numel must be an int >= 1"),
        ({"repeats": 0}, "repeats must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused(
    solo: dist.ProcessGroup, kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        collective_check(solo, **kwargs)


def _healthy(nodes: int) -> dict[str, Any]:
    world = dist.group.WORLD
    assert world is not None
    rank, size = dist.get_rank(), dist.get_world_size()
    per = size // nodes
    node = world
    for n in range(nodes):  # every rank makes every node's group
        g = dist.new_group(list(range(n * per, (n + 1) * per)))
        if n == rank // per and g is not None:
            node = g
    return collective_check(world, node, numel=NUMEL, timeout_s=30.0).to_json()


@pytest.mark.slow
def test_two_ranks_pass_and_gloo_has_all_to_all() -> None:
    # torch 2.13's gloo implements all_to_all_single: the check needs no emulation.
    results = run_ranks(_healthy, 2, args=(1,), timeout=60)
    for r in results:
        assert r["ok"], r["message"]
        assert r["evidence"]["all_reduce"]["ranks"] == [0, 1]
        assert r["evidence"]["all_to_all"]["ranks"] == [0, 1]


@pytest.mark.slow
def test_four_ranks_on_two_nodes_reduce_across_and_exchange_inside() -> None:
    results = run_ranks(_healthy, 4, args=(2,), timeout=90)
    for rank, r in enumerate(results):
        assert r["ok"], r["message"]
        assert r["evidence"]["all_reduce"]["ranks"] == [0, 1, 2, 3]
        assert r["evidence"]["all_to_all"]["ranks"] == ([0, 1] if rank < 2 else [2, 3])


def _pattern(rank: int) -> torch.Tensor:
    # What a healthy rank contributes to the check's all-reduce (see collective.py).
    return torch.arange(NUMEL, dtype=torch.float64).remainder_(7).add_(1) * (rank + 1)


def _peer_fault(fault: str) -> dict[str, Any] | str:
    """Rank 0 runs the check; rank 1 plays a faulty peer."""
    world = dist.group.WORLD
    assert world is not None
    if dist.get_rank() == 0:
        return collective_check(world, numel=NUMEL, timeout_s=TIMEOUT_S).to_json()
    if fault == "no_all_reduce":
        time.sleep(TIMEOUT_S + 3)  # never joins; rank 0 gives up first
        return "absent"
    if fault == "wrong_all_reduce":
        dist.all_reduce(_pattern(1) * 3, group=world)
        return "wrong"
    for _ in range(2):  # both repeats of the all-reduce, as a healthy peer
        dist.all_reduce(_pattern(1), group=world)
    if fault == "no_all_to_all":
        time.sleep(TIMEOUT_S + 3)
        return "absent"
    # The all-to-all with garbage where rank 0's chunk belongs.
    out = torch.empty(NUMEL, dtype=torch.float64)
    dist.all_to_all_single(out, torch.full((NUMEL,), 123.0, dtype=torch.float64), group=world)
    return "wrong"


@pytest.mark.slow
@pytest.mark.parametrize("op", ["all_reduce", "all_to_all"])
def test_a_peer_that_never_joins_an_op_fails_it_within_the_timeout(op: str) -> None:
    report = launch(_peer_fault, 2, args=(f"no_{op}",), timeout=60)
    report.raise_for_failure()
    got = report.outcomes[0].value
    assert not got["ok"]
    assert got["evidence"]["op"] == op and got["evidence"]["timed_out"] is True
    # The check's bound ended the wait: gloo's own (the harness's 60 s) would have come
    # later, and the peer's exit would have shown as a closed connection, not a timeout.
    assert f"{op} over ranks [0, 1] did not complete within 3 s" in got["message"]


@pytest.mark.slow
def test_a_peer_that_sends_a_wrong_sum_fails_the_all_reduce() -> None:
    got = run_ranks(_peer_fault, 2, args=("wrong_all_reduce",), timeout=60)[0]
    assert not got["ok"] and got["evidence"]["op"] == "all_reduce"
    assert "all_reduce over ranks [0, 1] returned wrong values" in got["message"]


@pytest.mark.slow
def test_a_peer_that_sends_wrong_chunks_is_named_by_the_all_to_all() -> None:
    got = run_ranks(_peer_fault, 2, args=("wrong_all_to_all",), timeout=60)[0]
    assert not got["ok"] and got["evidence"]["op"] == "all_to_all"
    assert got["evidence"]["wrong_senders"] == [1]
    assert "the chunks from rank(s) [1] differ" in got["message"]


def _nccl_rank() -> dict[str, Any]:
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    world = dist.group.WORLD
    assert world is not None
    return collective_check(world, device=f"cuda:{rank}", timeout_s=60.0).to_json()


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_ranks_pass() -> None:
    size = min(2, torch.cuda.device_count())
    for r in run_ranks(_nccl_rank, size, backend="nccl", timeout=120):
        assert r["ok"], r["message"]
        assert r["evidence"]["device"].startswith("cuda:")
