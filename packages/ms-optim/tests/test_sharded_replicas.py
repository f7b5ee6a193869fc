"""Lamb over a data x tensor parallel group (``ShardMap.replicas``) equals the
optimizer on the full logical parameters in one process, step for step.

Four gloo ranks stand for dp 2 x tp 2 (rank = dp_rank * 2 + tp_rank, tp inner as in
Megatron). Tensor parallelism splits some parameters over the tp ranks (by rows or,
non-contiguously, by columns) and replicates others; ZeRO then splits each rank's
tensor over the dp ranks unevenly, or keeps it whole (a replicated chunk). So a
local tensor is held, with the same values, by 1, 2 (tp or dp) or 4 ranks, and a
norm that counted each copy would move the trust ratios and the clipping.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ms_optim import Lamb, ShardMap
from ms_testing import run_ranks

DP, TP = 2, 2
WORLD = DP * TP
# (shape, how tp holds it: "col" splits dim 0, "row" splits the last dim, "rep"
# replicates; how ZeRO holds each tp rank's tensor: "split" over dp, "whole";
# param group)
SPECS: list[tuple[tuple[int, ...], str, str, int]] = [
    ((8, 6), "col", "split", 0),  # column-parallel weight
    ((6, 8), "row", "split", 0),  # row-parallel weight: a strided slice per tp rank
    ((8,), "col", "split", 1),  # its bias, split like the weight
    ((6,), "rep", "split", 1),  # LayerNorm weight: identical on the tp ranks
    ((5, 6), "rep", "split", 0),  # position embedding
    ((4, 6), "col", "whole", 0),  # tp-split, in a chunk ZeRO keeps whole: dp copies
    ((6,), "rep", "whole", 1),  # whole on every rank of the group
    ((), "rep", "split", 1),  # one element: only the tp ranks of dp rank 1 hold it
]
EVERYWHERE = 6  # the parameter every rank holds whole
NO_GRAD_ON_ODD_STEPS = 4  # its holders skip those steps together
STEPS = 6
GROUPS = [
    {"weight_decay": 0.1, "trust_ratio_bounds": (0.01, 10.0)},
    {"weight_decay": 0.0, "bias_correction": False},
]
# The peers' switches: decay on the weights (||w|| scaled, not measured), group step
# counting, the bias correction in the step size.
PEER_GROUPS = [
    {
        "weight_decay": 0.1,
        "decay_in_update": False,
        "step_count": "group",
        "grad_averaging": False,
    },
    {"weight_decay": 0.0, "step_size_bias_correction": True},
]
# LAMB's update is nearly blind to a gradient's scale (m / sqrt(v)) but for eps: a
# larger eps makes the clipping factor, hence the clipping norm, show in the result.
CASES: dict[str, dict[str, Any]] = {
    "float64": {"dtype": torch.float64, "max_grad_norm": None, "eps": 1e-6, "groups": GROUPS},
    "float64-clipped-peer": {
        "dtype": torch.float64,
        "max_grad_norm": 1.0,
        "eps": 1e-3,
        "groups": PEER_GROUPS,
    },
    "float32-clipped": {
        "dtype": torch.float32,
        "max_grad_norm": 0.5,
        "eps": 1e-3,
        "groups": GROUPS,
    },
}
# Every implementation, on the float32 case (Triton's kernels take fp32 only).
IMPLS = ("single", "compiled", "triton")


def numel(k: int) -> int:
    return max(1, torch.Size(SPECS[k][0]).numel())


def tp_indices(k: int, tp_rank: int) -> list[int]:
    """Flat indices (into the logical parameter) of tp rank ``tp_rank``'s tensor."""
    shape, mode, _, _ = SPECS[k]
    index = torch.arange(numel(k)).reshape(shape) if shape else torch.arange(1)
    if mode == "col":
        index = index.chunk(TP, dim=0)[tp_rank]
    elif mode == "row":
        index = index.chunk(TP, dim=-1)[tp_rank]
    return index.reshape(-1).tolist()


def local_layout(rank: int) -> list[tuple[int, list[int], int]]:
    """``(param, flat indices, replicas)`` of this rank's tensors, group after group."""
    dp_rank, tp_rank = divmod(rank, TP)
    out = []
    for k, (_, tp_mode, zero_mode, _) in enumerate(SPECS):
        index = tp_indices(k, tp_rank)
        replicas = TP if tp_mode == "rep" else 1
        if zero_mode == "whole":
            replicas *= DP
        else:
            cut = len(index) * 3 // 8  # uneven: dp rank 0 gets the smaller part
            index = index[:cut] if dp_rank == 0 else index[cut:]
        if index:
            out.append((k, index, replicas))
    return sorted(out, key=lambda e: (SPECS[e[0]][3], e[0]))


def shard_map(layout: list[tuple[int, list[int], int]], kind: str) -> ShardMap:
    """``kind`` "replicas": every count in ``replicas``; "replicated": the tensor every
    rank holds is also named in ``replicated`` (and its count is the group's size)."""
    return ShardMap(
        param_ids=[k for k, _, _ in layout],
        numels=[numel(k) for k in range(len(SPECS))],
        replicated=[i for i, (k, _, _) in enumerate(layout) if k == EVERYWHERE]
        if kind == "replicated"
        else (),
        replicas=[r for _, _, r in layout],
    )


def problem(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s[0], generator=gen, dtype=torch.float64) for s in SPECS]
    grads: list[list[torch.Tensor | None]] = [
        [
            None
            if k == NO_GRAD_ON_ODD_STEPS and step % 2
            else torch.randn(s[0], generator=gen, dtype=torch.float64)
            for k, s in enumerate(SPECS)
        ]
        for step in range(STEPS)
    ]
    return weights, grads


def make_lamb(by_group: list[list[torch.Tensor]], case: dict[str, Any], **kw: Any) -> Lamb:
    groups = [{"params": ps, **case["groups"][g]} for g, ps in enumerate(by_group) if ps]
    return Lamb(groups, lr=0.05, eps=case["eps"], max_grad_norm=case["max_grad_norm"], **kw)


def one_process(case: dict[str, Any], seed: int) -> list[list[torch.Tensor]]:
    weights, grads = problem(seed)
    params = [w.to(case["dtype"]).requires_grad_() for w in weights]
    by_group: list[list[torch.Tensor]] = [[], []]
    for k, p in enumerate(params):
        by_group[SPECS[k][3]].append(p)
    opt = make_lamb(by_group, case, impl="foreach")
    history = []
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = None if g is None else g.to(case["dtype"])
        opt.step()
        history.append([p.detach().reshape(-1).clone() for p in params])
    return history


def _impl(name: str) -> Any:
    # Small thresholds, so that these tiny tensors reach the fused code paths.
    if name == "compiled":
        from ms_optim._compiled import CompiledImpl

        return CompiledImpl(min_numel=8)
    if name == "triton":
        from ms_optim._triton_lamb import TritonImpl

        return TritonImpl(block_size=16)
    return None


def run_sharded(
    layout: list[tuple[int, list[int], int]],
    shards: ShardMap,
    case: dict[str, Any],
    impl: str,
    seed: int,
) -> dict[str, Any]:
    weights, grads = problem(seed)
    index = [torch.tensor(ix) for _, ix, _ in layout]
    local = [
        weights[k].reshape(-1)[ix].to(case["dtype"]).requires_grad_()
        for (k, _, _), ix in zip(layout, index, strict=True)
    ]
    by_group: list[list[torch.Tensor]] = [[], []]
    for (k, _, _), p in zip(layout, local, strict=True):
        by_group[SPECS[k][3]].append(p)
    opt = make_lamb(
        by_group,
        case,
        impl=impl,
        shards=shards,
        process_group=dist.group.WORLD,
    )
    if (fused := _impl(impl)) is not None:
        opt._impl = fused
    history, collectives = [], []
    for row in grads:
        for (k, _, _), ix, p in zip(layout, index, local, strict=True):
            g = row[k]
            p.grad = None if g is None else g.reshape(-1)[ix].to(case["dtype"])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
        collectives.append(sum(1 for e in prof.events() if e.name.startswith("gloo:")))
        history.append([p.detach().clone() for p in local])
    return {"history": history, "collectives": collectives}


def refused(layout: list[tuple[int, list[int], int]], shards: ShardMap) -> str:
    params = [torch.zeros(len(ix), requires_grad=True) for _, ix, _ in layout]
    try:
        Lamb(params, shards=shards, process_group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "accepted"


def rank_main(seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    layout = local_layout(rank)
    out: dict[str, Any] = {"layout": layout, "runs": {}}
    for kind in ("replicas", "replicated"):
        shards = shard_map(layout, kind)
        for name, case in CASES.items():
            out["runs"][(kind, name, "foreach")] = run_sharded(
                layout, shards, case, "foreach", seed
            )
    shards = shard_map(layout, "replicas")
    for impl in IMPLS:
        if impl == "triton":
            try:
                import triton  # noqa: F401
            except ImportError:
                continue
        case = CASES["float32-clipped"]
        out["runs"][("replicas", "float32-clipped", impl)] = run_sharded(
            layout, shards, case, impl, seed
        )

    # Wrong maps, each refused on every rank. ``ln`` is rank 0's shard of the
    # LayerNorm weight, which both tp ranks of dp rank 0 hold.
    ln = next(i for i, (k, _, _) in enumerate(layout) if k == 3)
    everywhere = next(i for i, (k, _, _) in enumerate(layout) if k == EVERYWHERE)

    def with_count(position: int, count: int, on_rank: int | None = 0) -> ShardMap:
        if on_rank is not None and rank != on_rank:
            return shards
        replicas = list(shards.replicas)
        replicas[position] = count
        return ShardMap(shards.param_ids, shards.numels, shards.replicated, replicas)

    out["errors"] = {
        "one-rank-says-1": refused(layout, with_count(ln, 1)),
        "one-rank-says-3": refused(layout, with_count(ln, 3)),
        "omitted": refused(layout, ShardMap(shards.param_ids, shards.numels)),
        "more-than-the-group": refused(layout, with_count(ln, 5)),
        "replicated-but-2": refused(
            layout,
            ShardMap(
                shards.param_ids,
                shards.numels,
                (everywhere,),
                [2 if i == everywhere else r for i, r in enumerate(shards.replicas)],
            ),
        ),
    }
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(rank_main, WORLD, args=(11,), timeout=300)


def test_layout_covers_every_parameter_with_the_stated_copies() -> None:
    # The test's own layout: each element held by exactly the ranks its count says.
    holders: dict[tuple[int, int], list[int]] = {}
    counts: dict[tuple[int, int], set[int]] = {}
    for rank in range(WORLD):
        for k, index, r in local_layout(rank):
            for j in index:
                holders.setdefault((k, j), []).append(rank)
                counts.setdefault((k, j), set()).add(r)
    assert sorted(holders) == [(k, j) for k in range(len(SPECS)) for j in range(numel(k))]
    for key, ranks_ in holders.items():
        assert counts[key] == {len(ranks_)}, key
    # Every kind of copy shows up: 1, tp, dp and the whole group.
    assert {r for rank in range(WORLD) for _, _, r in local_layout(rank)} == {1, 2, 4}
    assert {SPECS[k][1:3] for rank in range(WORLD) for k, _, r in local_layout(rank) if r == 2} == {
        ("rep", "split"),
        ("col", "whole"),
    }


@pytest.mark.slow  # gloo ranks in fresh processes: seconds each
def test_dp_tp_lamb_equals_one_process_step_for_step(ranks: list[dict[str, Any]]) -> None:
    want = {name: one_process(case, 11) for name, case in CASES.items()}
    runs = sorted(ranks[0]["runs"])
    assert ("replicas", "float32-clipped", "single") in runs, runs
    assert ("replicas", "float32-clipped", "compiled") in runs, runs
    if importlib.util.find_spec("triton") is not None:
        assert ("replicas", "float32-clipped", "triton") in runs, runs
    for kind, name, impl in runs:
        case = CASES[name]
        tol = (
            {"rtol": 1e-12, "atol": 1e-12}
            if case["dtype"] == torch.float64
            else {"rtol": 1e-6, "atol": 1e-6}
        )
        for rank, res in enumerate(ranks):
            run = res["runs"][(kind, name, impl)]
            for step in range(STEPS):
                for (k, index, _), got in zip(res["layout"], run["history"][step], strict=True):
                    torch.testing.assert_close(
                        got,
                        want[name][step][k][index],
                        **tol,
                        msg=lambda m, s=step, k=k, r=rank, c=(kind, name, impl): (
                            f"{c} step {s} rank {r} param {k}: {m}"
                        ),
                    )
            # Still one packed all-reduce of the norms, plus one for the clipping norm.
            per_step = 1 if case["max_grad_norm"] is None else 2
            assert run["collectives"] == [per_step] * STEPS, (kind, name, impl)


@pytest.mark.slow
def test_wrong_replica_counts_are_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    expected_everywhere = {
        # Rank 0's copy counted whole: 2 + (2 + 4 + 4) / 2 = 7 elements of 6.
        "one-rank-says-1": "logical parameter 3 has shards.numels[3] = 6 elements but the "
        "ranks' local tensors hold 7 of them in total",
        "one-rank-says-3": "the local tensors of logical parameter 3 with replicas = 3 hold "
        "2 elements summed over the ranks, not a multiple of 3",
        # Without counts, each tp copy of the LayerNorm weight counts: 12 of 6.
        "omitted": "logical parameter 3 has shards.numels[3] = 6 elements but the ranks' "
        "local tensors hold 12 of them",
    }
    for rank, res in enumerate(ranks):
        errors = res["errors"]
        for name, text in expected_everywhere.items():
            assert text in errors[name], (rank, name, errors[name])
        everywhere = next(i for i, (k, _, _) in enumerate(res["layout"]) if k == EVERYWHERE)
        assert (
            f"shards.replicas[{everywhere}] must be 4 (the size of process_group) since "
            f"shards.replicated names position {everywhere} (held by every rank), got 2"
            in errors["replicated-but-2"]
        ), errors["replicated-but-2"]
        if rank == 0:
            assert "must be at most 4 (the size of process_group" in errors["more-than-the-group"]
            assert errors["more-than-the-group"].endswith("got 5")
        else:
            assert "ShardMap of another rank" in errors["more-than-the-group"], rank


def test_replicas_are_validated() -> None:
    ok = ShardMap(param_ids=(0, 1, 1), numels=(3, 4), replicated=(0,), replicas=(4, 2, 1))
    assert ok.replicas == (4, 2, 1)
    assert ok.replica_counts(4) == (4, 2, 1)
    assert ShardMap((0, 1), (3, 4), replicated=(1,)).replica_counts(8) == (1, 8)
    assert ShardMap((0, 1), (3, 4)).replica_counts(8) == (1, 1)
    for bad, got in [
        ((0, 1, 1), "0"),
        ((1, -2, 1), "-2"),
        ((True, 1, 1), "True"),
        ((1, 1.0, 1), "1.0"),
    ]:
        with pytest.raises(
            ValueError,
            match=rf"ShardMap.replicas\[\d\] must be an int >= 1 \(the ranks holding local "
            rf"tensor \d, this one included\), got {got}",
        ):
            ShardMap(param_ids=(0, 1, 1), numels=(3, 4), replicas=bad)
    with pytest.raises(
        ValueError,
        match=r"ShardMap.replicas must be empty or have one entry per entry of param_ids "
        r"\(3\), got 2 entries",
    ):
        ShardMap(param_ids=(0, 1, 1), numels=(3, 4), replicas=(1, 1))


def test_check_local_refuses_counts_the_group_cannot_have() -> None:
    params = [torch.zeros(3), torch.zeros(2), torch.zeros(2)]
    shards = ShardMap(param_ids=(0, 1, 1), numels=(3, 4), replicated=(0,), replicas=(4, 2, 1))
    shards.check_local(params)  # without the group's size, nothing to compare with
    shards.check_local(params, group_size=4)
    with pytest.raises(
        ValueError,
        match=r"shards.replicas\[0\] must be 2 \(the size of process_group\) since "
        r"shards.replicated names position 0 \(held by every rank\), got 4",
    ):
        shards.check_local(params, group_size=2)
    with pytest.raises(
        ValueError, match=r"shards.replicas\[1\] must be at most 1 \(the size of process_group"
    ):
        ShardMap((0, 1, 1), (3, 4), replicas=(1, 2, 1)).check_local(params, group_size=1)
