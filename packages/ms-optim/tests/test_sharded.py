"""ZeRO-sharded Lamb on gloo ranks equals the unsharded optimizer, step for step.

Every rank owns an uneven slice of the flat buffer of all parameters (the
DeepSpeed / Megatron layout) and gets the matching slice of each gradient. The
collectives of each step are counted with torch's profiler, which records every
gloo operation, independently of ms-optim's code.
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
STEPS = 8
# Both groups' switches differ, so a mix-up between groups would show.
GROUP_KWARGS = [
    {"weight_decay": 0.1, "trust_ratio_bounds": (0.01, 10.0)},
    {"weight_decay": 0.0, "layer_adaptation": False, "bias_correction": False},
]
# The peers' switches: decay on the weights (its ||w|| is scaled, not measured),
# group step counting (parameter 5 skips steps), step-size bias correction.
PEER_KWARGS = [
    {
        "weight_decay": 0.1,
        "trust_ratio_bounds": (0.01, 10.0),
        "decay_in_update": False,
        "step_count": "group",
        "grad_averaging": False,
    },
    {"weight_decay": 0.0, "layer_adaptation": False, "step_size_bias_correction": True},
]
CASES = {
    "float64": {"dtype": torch.float64, "max_grad_norm": None, "groups": GROUP_KWARGS},
    "float32-clipped": {"dtype": torch.float32, "max_grad_norm": 0.1, "groups": GROUP_KWARGS},
    "float64-peer-switches": {"dtype": torch.float64, "max_grad_norm": 1.0, "groups": PEER_KWARGS},
}


def problem(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    weights[3].zero_()  # a zero-norm parameter: trust ratio 1
    grads: list[list[torch.Tensor | None]] = []
    for step in range(STEPS):
        # Parameter 5 has no gradient on odd steps: its shards skip them together.
        grads.append(
            [
                None if (i == 5 and step % 2) else torch.randn(s, generator=gen)
                for i, s in enumerate(SHAPES)
            ]
        )
    return weights, grads


def group_of(k: int) -> int:
    # The second group (no adaptation) gets small parameters only, so the ones
    # split across ranks have trust ratios that need the all-reduce.
    return 1 if k in (2, 6) else 0


def make_lamb(params_by_group: list[list[torch.Tensor]], case: dict[str, Any], **kw: Any) -> Lamb:
    groups = [{"params": ps, **case["groups"][g]} for g, ps in enumerate(params_by_group) if ps]
    return Lamb(groups, lr=0.05, max_grad_norm=case["max_grad_norm"], **kw)


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
            p.grad = None if g is None else g.to(case["dtype"])
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


def rank_main(cuts: list[int], seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    group = dist.group.WORLD
    numels = [max(1, torch.Size(s).numel()) for s in SHAPES]
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        weights, grads = problem(seed)
        flat_map, slices = ShardMap.from_flat_range(numels, cuts[rank], cuts[rank + 1])
        # Optimizer order is group after group; the map must follow it.
        order = sorted(range(len(slices)), key=lambda j: group_of(slices[j][0]))
        slices = [slices[j] for j in order]
        shards = ShardMap([k for k, _, _ in slices], flat_map.numels)
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
                g = row[k]
                p.grad = None if g is None else g.reshape(-1)[o : o + n].to(case["dtype"])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                opt.step()
            collectives.append(sum(1 for e in prof.events() if e.name.startswith("gloo:")))
            history.append([p.detach().clone() for p in local])
        out[name] = {"slices": slices, "history": history, "collectives": collectives}

    # A map that claims one element too many for parameter 1 is refused on every rank.
    bad = ShardMap(flat_map.param_ids, [n + (k == 1) for k, n in enumerate(numels)])
    try:
        Lamb(local_for(slices_of(numels, cuts, rank)), shards=bad, process_group=group)
    except ValueError as e:
        out["bad_map_error"] = str(e)
    # A map whose length does not match the local tensors fails on that rank only;
    # the others must raise too rather than wait.
    short = ShardMap(flat_map.param_ids[:-1], flat_map.numels) if rank == 0 else flat_map
    try:
        Lamb(local_for(slices_of(numels, cuts, rank)), shards=short, process_group=group)
    except ValueError as e:
        out["short_map_error"] = str(e)
    return out


def slices_of(numels: list[int], cuts: list[int], rank: int) -> list[tuple[int, int, int]]:
    return ShardMap.from_flat_range(numels, cuts[rank], cuts[rank + 1])[1]


def local_for(slices: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    return [torch.zeros(n, requires_grad=True) for _, _, n in slices]


def test_flat_range_map_names_each_slice() -> None:
    numels = [3, 0, 5, 2]
    shards, slices = ShardMap.from_flat_range(numels, 2, 9)
    assert slices == [(0, 2, 1), (2, 0, 5), (3, 0, 1)]
    assert shards.param_ids == (0, 2, 3) and shards.numels == tuple(numels)
    shards.check_local([torch.zeros(1), torch.zeros(5), torch.zeros(1)])
    with pytest.raises(ValueError, match=r"local tensor 1 has 6 elements .*numels\[2\] = 5"):
        shards.check_local([torch.zeros(1), torch.zeros(6), torch.zeros(1)])
    with pytest.raises(ValueError, match=r"must satisfy 0 <= start <= stop <= 10, got \[4, 11\)"):
        ShardMap.from_flat_range(numels, 4, 11)


@pytest.mark.slow  # gloo ranks in fresh processes: seconds each
@pytest.mark.parametrize(
    "cuts",
    [
        pytest.param([0, 20, 60], id="2-ranks"),
        pytest.param([0, 1, 25, 30, 60], id="4-ranks-uneven"),
    ],
)
def test_sharded_equals_unsharded_step_for_step(cuts: list[int]) -> None:
    total = sum(max(1, torch.Size(s).numel()) for s in SHAPES)
    cuts[-1] = total
    world = len(cuts) - 1
    results = run_ranks(rank_main, world, args=(cuts, 3), timeout=240)
    for name, case in CASES.items():
        want = unsharded(case, 3)
        tol = {"rtol": 1e-12, "atol": 1e-12} if case["dtype"] == torch.float64 else {}
        for step in range(STEPS):
            for rank, res in enumerate(results):
                r = res[name]
                for (k, o, n), got in zip(r["slices"], r["history"][step], strict=True):
                    torch.testing.assert_close(
                        got,
                        want[step][k].reshape(-1)[o : o + n],
                        **tol,
                        msg=lambda m, c=name, s=step, k=k, rk=rank: (
                            f"{c} step {s} rank {rk} param {k}: {m}"
                        ),
                    )
        # One packed all-reduce of the norms per step, plus one for the clipping norm.
        per_step = 1 if case["max_grad_norm"] is None else 2
        for res in results:
            assert res[name]["collectives"] == [per_step] * STEPS
    for res in results:
        assert (
            "parameter 1 has shards.numels[1] = 16 elements but the ranks' local tensors hold 15"
            in res["bad_map_error"]
        )
    assert (
        "shards.param_ids must have one entry per parameter tensor" in results[0]["short_map_error"]
    )
    for res in results[1:]:
        assert "ShardMap of another rank" in res["short_map_error"]
