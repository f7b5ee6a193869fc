"""Property: however the logical parameters are cut into pieces and the pieces spread
over the ranks, with any number of copies each, Lamb with ``ShardMap.replicas`` takes
the norms of the whole parameters, so it steps as one process does; and a map that
misstates one rank's count for one tensor is refused on every rank.

Hypothesis draws the layouts in the test process; each example runs a batch of
them on one set of gloo ranks (starting ranks costs seconds, a layout milliseconds).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_optim import Lamb, ShardMap
from ms_testing import run_ranks

WORLD = 4
EVERY_RANK = (1 << WORLD) - 1
STEPS = 2
# (param, start, stop, holders as a bit mask of ranks, named in ``replicated``)
Piece = tuple[int, int, int, int, bool]
# (numels, pieces, the wrong count: (piece, rank holding it, count) )
Layout = tuple[list[int], list[Piece], tuple[int, int, int]]


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    numels = draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    pieces: list[Piece] = []
    for k, n in enumerate(numels):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            holders = draw(st.integers(1, EVERY_RANK))
            pieces.append((k, lo, hi, holders, holders == EVERY_RANK and draw(st.booleans())))
    # Every rank holds something (an optimizer needs a parameter): the first piece
    # gains the ranks left without one.
    idle = EVERY_RANK & ~functools.reduce(operator.or_, (p[3] for p in pieces))
    if idle:
        k, lo, hi, holders, _ = pieces[0]
        pieces[0] = (k, lo, hi, holders | idle, False)
    j = draw(st.integers(0, len(pieces) - 1))
    holders = pieces[j][3]
    rank = draw(st.sampled_from([r for r in range(WORLD) if holders >> r & 1]))
    count = draw(st.sampled_from([c for c in range(1, WORLD + 1) if c != holders.bit_count()]))
    return numels, pieces, (j, rank, count)


def mine(pieces: list[Piece], rank: int) -> list[int]:
    return [j for j, p in enumerate(pieces) if p[3] >> rank & 1]


def problem(numels: list[int], seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, generator=gen, dtype=torch.float64) for n in numels]
    grads = [
        [torch.randn(n, generator=gen, dtype=torch.float64) for n in numels] for _ in range(STEPS)
    ]
    return weights, grads


def lamb(params: list[torch.Tensor], **kw: Any) -> Lamb:
    # Clipping on, so that the global gradient norm is weighted too; a large eps makes
    # the clipping factor show in the update (m / sqrt(v) is blind to a gradient's scale).
    return Lamb(
        params, lr=0.1, eps=1e-3, weight_decay=0.01, max_grad_norm=0.5, impl="foreach", **kw
    )


def one_process(numels: list[int], seed: int) -> list[torch.Tensor]:
    weights, grads = problem(numels, seed)
    params = [w.clone().requires_grad_() for w in weights]
    opt = lamb(params)
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def rank_main(batch: list[Layout], seed: int) -> list[dict[str, Any]]:
    rank = dist.get_rank()
    out = []
    for numels, pieces, (wrong_piece, wrong_rank, wrong_count) in batch:
        js = mine(pieces, rank)
        shards = ShardMap(
            param_ids=[pieces[j][0] for j in js],
            numels=numels,
            replicated=[i for i, j in enumerate(js) if pieces[j][4]],
            replicas=[pieces[j][3].bit_count() for j in js],
        )
        weights, grads = problem(numels, seed)
        local = [
            weights[k][lo:hi].clone().requires_grad_()
            for k, lo, hi, _, _ in map(pieces.__getitem__, js)
        ]
        opt = lamb(local, shards=shards, process_group=dist.group.WORLD)
        for row in grads:
            for j, p in zip(js, local, strict=True):
                k, lo, hi, _, _ = pieces[j]
                p.grad = row[k][lo:hi]
            opt.step()
        replicas = list(shards.replicas)
        if rank == wrong_rank:
            replicas[js.index(wrong_piece)] = wrong_count
        try:
            Lamb(
                [torch.zeros(len(p)) for p in local],
                shards=ShardMap(shards.param_ids, numels, shards.replicated, replicas),
                process_group=dist.group.WORLD,
            )
            error = "accepted"
        except ValueError as e:
            error = str(e)
        out.append({"pieces": js, "weights": [p.detach() for p in local], "error": error})
    return out


@pytest.mark.slow  # gloo ranks in fresh processes: seconds per example
@settings(max_examples=3)
@given(batch=st.lists(layouts(), min_size=8, max_size=8), seed=st.integers(0, 2**16))
def test_any_layout_steps_as_one_process_and_any_wrong_count_is_refused(
    batch: list[Layout], seed: int
) -> None:
    results = run_ranks(rank_main, WORLD, args=(batch, seed), timeout=120)
    for b, (numels, pieces, wrong) in enumerate(batch):
        want = one_process(numels, seed)
        for rank, res in enumerate(results):
            got = res[b]
            for j, w in zip(got["pieces"], got["weights"], strict=True):
                k, lo, hi, _, _ = pieces[j]
                torch.testing.assert_close(
                    w,
                    want[k][lo:hi],
                    rtol=1e-12,
                    atol=1e-12,
                    msg=lambda m, b=b, r=rank, j=j: f"layout {b} rank {r} piece {j}: {m}",
                )
            assert got["error"] != "accepted", (b, rank, wrong)
