"""ZeRO-sharded Lamb where some tensors are replicated (every rank holds them whole,
``ShardMap.replicated``) equals the unsharded optimizer, step for step.

The other parameters are laid flat and split over the ranks unevenly, as in
``test_sharded.py``. The replicated parameters are in both param groups; clipping
mixes their gradients with sharded ones in the global norm, so a norm that counted
them once per rank would move every parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ms_optim import Lamb, ShardMap
from ms_testing import run_ranks

SHAPES = [(7,), (3, 5), (), (16,), (2, 2), (9,), (1,)]
REPLICATED = (1, 2, 6)  # a matrix, a scalar and a 1-element vector, whole on every rank
SHARDED = tuple(k for k in range(len(SHAPES)) if k not in REPLICATED)
STEPS = 6
GROUP_KWARGS = [
    {"weight_decay": 0.1, "trust_ratio_bounds": (0.01, 10.0)},
    {"weight_decay": 0.0, "layer_adaptation": False, "bias_correction": False},
]
CASES = {
    "float64": {"dtype": torch.float64, "max_grad_norm": None},
    "float64-clipped": {"dtype": torch.float64, "max_grad_norm": 1.0},
    "float32-clipped": {"dtype": torch.float32, "max_grad_norm": 0.5},
}


def numel(k: int) -> int:
    return max(1, torch.Size(SHAPES[k]).numel())


def group_of(k: int) -> int:
    return 1 if k in (2, 6) else 0


def problem(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    grads = [
        [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)
    ]
    return weights, grads


def make_lamb(by_group: list[list[torch.Tensor]], case: dict[str, Any], **kw: Any) -> Lamb:
    groups = [{"params": ps, **GROUP_KWARGS[g]} for g, ps in enumerate(by_group) if ps]
    return Lamb(groups, lr=0.05, max_grad_norm=case["max_grad_norm"], impl="foreach", **kw)


def unsharded(case: dict[str, Any], seed: int) -> list[list[torch.Tensor]]:
    weights, grads = problem(seed)
    params = [w.to(case["dtype"]).requires_grad_() for w in weights]
    by_group: list[list[torch.Tensor]] = [[], []]
    for k, p in enumerate(params):
        by_group[group_of(k)].append(p)
    opt = make_lamb(by_group, case)
    history = []
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = g.to(case["dtype"])
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


def local_slices(cuts: list[int], rank: int) -> list[tuple[int, int, int]]:
    """``(param, offset, length)`` of this rank's tensors, group after group: its part
    of the flat buffer of the sharded parameters, and every replicated one whole."""
    _, parts = ShardMap.from_flat_range([numel(k) for k in SHARDED], cuts[rank], cuts[rank + 1])
    mine = [(SHARDED[j], o, n) for j, o, n in parts] + [(k, 0, numel(k)) for k in REPLICATED]
    return sorted(mine, key=lambda s: (group_of(s[0]), s[0]))


def shard_map(slices: list[tuple[int, int, int]]) -> ShardMap:
    return ShardMap(
        param_ids=[k for k, _, _ in slices],
        numels=[numel(k) for k in range(len(SHAPES))],
        replicated=[i for i, (k, _, _) in enumerate(slices) if k in REPLICATED],
    )


def rank_main(cuts: list[int], seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    group = dist.group.WORLD
    slices = local_slices(cuts, rank)
    shards = shard_map(slices)
    out: dict[str, Any] = {"slices": slices}
    for name, case in CASES.items():
        weights, grads = problem(seed)
        local = [
            weights[k].reshape(-1)[o : o + n].to(case["dtype"]).clone().requires_grad_()
            for k, o, n in slices
        ]
        by_group: list[list[torch.Tensor]] = [[], []]
        for (k, _, _), p in zip(slices, local, strict=True):
            by_group[group_of(k)].append(p)
        opt = make_lamb(by_group, case, shards=shards, process_group=group)
        history, collectives = [], []
        for row in grads:
            for (k, o, n), p in zip(slices, local, strict=True):
                p.grad = row[k].reshape(-1)[o : o + n].to(case["dtype"])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                opt.step()
            collectives.append(sum(1 for e in prof.events() if e.name.startswith("gloo:")))
            history.append([p.detach().clone() for p in local])
        out[name] = {"history": history, "collectives": collectives}

    def refused(shards: ShardMap) -> str:
        params = [torch.zeros(n, requires_grad=True) for _, _, n in slices]
        try:
            Lamb(params, shards=shards, process_group=group)
        except ValueError as e:
            return str(e)
        return "accepted"

    # Rank 0 leaves the scalar out of its replicated tensors (as if it were a shard):
    # every rank is refused, rank 0 holding one element fewer of it than the others.
    scalar = next(i for i, (k, _, _) in enumerate(slices) if k == 2)
    if rank == 0:
        uneven = ShardMap(
            shards.param_ids, shards.numels, [i for i in shards.replicated if i != scalar]
        )
    else:
        uneven = shards
    out["uneven_error"] = refused(uneven)
    # Without ``replicated`` the ranks hold every replicated element once per rank.
    out["unmarked_error"] = refused(ShardMap(shards.param_ids, shards.numels))
    return out


@pytest.mark.slow  # gloo ranks in fresh processes: seconds each
@pytest.mark.parametrize(
    "cuts",
    [pytest.param([0, 13, 36], id="2-ranks"), pytest.param([0, 1, 20, 20, 36], id="4-ranks")],
)
def test_replicated_tensors_count_once(cuts: list[int]) -> None:
    assert cuts[-1] == sum(numel(k) for k in SHARDED)
    results = run_ranks(rank_main, len(cuts) - 1, args=(cuts, 5), timeout=240)
    for name, case in CASES.items():
        want = unsharded(case, 5)
        tol = {"rtol": 1e-12, "atol": 1e-12} if case["dtype"] == torch.float64 else {}
        for rank, res in enumerate(results):
            for step in range(STEPS):
                for (k, o, n), got in zip(res["slices"], res[name]["history"][step], strict=True):
                    torch.testing.assert_close(
                        got,
                        want[step][k].reshape(-1)[o : o + n],
                        **tol,
                        msg=lambda m, c=name, s=step, k=k, r=rank: (
                            f"{c} step {s} rank {r} param {k}: {m}"
                        ),
                    )
            # Still one packed all-reduce of the norms, plus one for the clipping norm.
            per_step = 1 if case["max_grad_norm"] is None else 2
            assert res[name]["collectives"] == [per_step] * STEPS
    world = len(results)
    for res in results:
        assert (
            "the ranks hold 0 to 1 replicated elements of logical parameter 2"
            in res["uneven_error"]
        ), res["uneven_error"]
        assert (
            f"logical parameter 1 has shards.numels[1] = 15 elements but the ranks' local "
            f"tensors hold {15 * world} of them" in res["unmarked_error"]
        ), res["unmarked_error"]


def test_replicated_positions_are_validated() -> None:
    ShardMap(param_ids=(0, 1, 1), numels=(3, 4), replicated=(0, 2))
    for bad, got in [((3,), "3"), ((1, 1), "1"), ((2, 0), "0"), ((True,), "True")]:
        with pytest.raises(
            ValueError, match=rf"ShardMap.replicated\[\d\] must be a position .*got {got}"
        ):
            ShardMap(param_ids=(0, 1, 1), numels=(3, 4), replicated=bad)
