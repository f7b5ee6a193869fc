"""The chunked collective matmuls against a float64 computation of the whole problem in
one process, forward and backward, on 2 and 4 gloo ranks, and against their unfused
references (one collective, waited, then the GEMMs)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ms_parallel import TPComm, all_gather_matmul, matmul_reduce_scatter
from ms_parallel.events import EventLog
from ms_testing.dist import run_ranks

S, B, K, N = 4, 3, 8, 12  # sequence per rank, batch, in and out (N) features


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _column_case(world: int, chunks: int, overlap: bool, n_weights: int) -> dict[str, object]:
    rank = dist.get_rank()
    x_full = _full(0, world * S, B, K)
    w_full = [_full(1 + i, N, K) for i in range(n_weights)]
    g_full = [_full(10 + i, world * S, B, N) for i in range(n_weights)]
    cols = slice(rank * N // world, (rank + 1) * N // world)
    x = x_full[rank * S : (rank + 1) * S].float().requires_grad_()
    ws = [w[cols].float().requires_grad_() for w in w_full]
    log = EventLog()
    comm = TPComm(dist.group.WORLD, on_event=log, label="test")
    ys = all_gather_matmul(x, ws, comm, chunks=chunks, overlap=overlap)
    assert isinstance(ys, list)
    sum((y * g[..., cols].float()).sum() for y, g in zip(ys, g_full, strict=True)).backward()
    # float64 references of the whole problem
    ref_y = [x_full @ w[cols].t() for w in w_full]
    ref_dx = sum(g @ w for g, w in zip(g_full, w_full, strict=True))[rank * S : (rank + 1) * S]
    ref_dw = [torch.einsum("sbo,sbk->ok", g[..., cols], x_full) for g in g_full]
    for y, ref in zip(ys, ref_y, strict=True):
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-5, atol=1e-5)
    for w, ref in zip(ws, ref_dw, strict=True):
        torch.testing.assert_close(w.grad.double(), ref, rtol=1e-5, atol=1e-5)
    return {
        "y": [y.detach() for y in ys],
        "dx": x.grad.clone(),
        "dw": [w.grad.clone() for w in ws],
        "events": [(e.name, e.kind, dict(e.attrs)) for e in log.events],
    }


def _row_case(
    world: int, chunks: int, overlap: bool, n_inputs: int, scaled: bool = False
) -> dict[str, object]:
    """``scaled``: the first input's product is multiplied by a dropout-like mask (the
    same on every rank) before the sum, the second's (if any) is not."""
    rank = dist.get_rank()
    ks = [K, 2 * K][:n_inputs]
    x_full = [_full(20 + i, world * S, B, k) for i, k in enumerate(ks)]
    w_full = [_full(30 + i, N, k) for i, k in enumerate(ks)]
    g_full = _full(40, world * S, B, N)
    ones = torch.ones(world * S, B, N, dtype=torch.float64)
    masks = [(_full(50, world * S, B, N) > 0).double() * 2 if scaled else ones, ones]
    parts = [slice(rank * k // world, (rank + 1) * k // world) for k in ks]
    xs = [x[..., c].float().requires_grad_() for x, c in zip(x_full, parts, strict=True)]
    ws = [w[:, c].float().requires_grad_() for w, c in zip(w_full, parts, strict=True)]
    scales = [masks[0].float(), None][:n_inputs] if scaled else None
    y = matmul_reduce_scatter(
        xs, ws, dist.group.WORLD, chunks=chunks, overlap=overlap, scales=scales
    )
    mine = slice(rank * S, (rank + 1) * S)
    (y * g_full[mine].float()).sum().backward()
    ref_y = sum((x @ w.t()) * m for x, w, m in zip(x_full, w_full, masks, strict=False))[mine]
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    for x, w, c, m in zip(xs, w_full, parts, masks, strict=False):
        ref = (g_full * m) @ w[:, c]
        torch.testing.assert_close(x.grad.double(), ref, rtol=1e-5, atol=1e-5)
    for w, x, c, m in zip(ws, x_full, parts, masks, strict=False):
        ref = torch.einsum("sbo,sbk->ok", g_full * m, x[..., c])
        torch.testing.assert_close(w.grad.double(), ref, rtol=1e-5, atol=1e-5)
    return {"y": y.detach(), "dx": [x.grad.clone() for x in xs], "dw": [w.grad.clone() for w in ws]}


COLUMN_CHUNKS = (1, 2, 4, 7)  # 7: more pieces than the rows split evenly into
ROW_CHUNKS = (1, 2, 5)


def _all_cases(world: int) -> dict[str, object]:
    """Every chunk count, fused and unfused, in one launch (processes cost seconds)."""
    out: dict[str, object] = {}
    for c in COLUMN_CHUNKS:
        for overlap in (True, False):
            out[f"col-{c}-{overlap}"] = _column_case(world, c, overlap, 2)
        out[f"col1-{c}"] = _column_case(world, c, True, 1)
    for c in ROW_CHUNKS:
        for overlap in (True, False):
            out[f"row-{c}-{overlap}"] = _row_case(world, c, overlap, 2)
        out[f"row1-{c}"] = _row_case(world, c, True, 1)
        for overlap in (True, False):
            out[f"rowmask-{c}-{overlap}"] = _row_case(world, c, overlap, 2, scaled=True)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fused_matmuls_match_float64_and_their_references(world: int) -> None:
    # Each case asserts against float64 on its rank; here fused and unfused agree.
    for res in run_ranks(_all_cases, world, args=(world,), timeout=240):
        for c in COLUMN_CHUNKS:
            a, b = res[f"col-{c}-True"], res[f"col-{c}-False"]
            for ya, yb in zip(a["y"], b["y"], strict=True):
                torch.testing.assert_close(ya, yb, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(a["dx"], b["dx"], rtol=1e-6, atol=1e-6)
            # Every piece's all-gather is issued before the first is waited for.
            gathers = [
                e[1] for e in a["events"] if e[0] == "all_gather" and e[2]["phase"] == "forward"
            ]
            pieces = min(c, S * B)
            assert gathers[:pieces] == ["issue"] * pieces, gathers
            assert gathers.count("issue") == pieces
        for c in ROW_CHUNKS:
            for kind in ("row", "rowmask"):
                a, b = res[f"{kind}-{c}-True"], res[f"{kind}-{c}-False"]
                torch.testing.assert_close(a["y"], b["y"], rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(a["dx"], b["dx"], rtol=1e-6, atol=1e-6)


def test_one_rank_is_a_plain_matmul() -> None:
    x = torch.randn(4, 2, 8, requires_grad=True)
    w = torch.randn(6, 8, requires_grad=True)
    y = all_gather_matmul(x, w, None, chunks=3)
    torch.testing.assert_close(y, x @ w.t())
    y2 = matmul_reduce_scatter(x, w, None, chunks=3)
    torch.testing.assert_close(y2, x @ w.t())


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True])
def test_bad_chunks_are_refused(chunks: object) -> None:
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        all_gather_matmul(torch.randn(2, 4), torch.randn(3, 4), None, chunks=chunks)  # type: ignore[arg-type]


def test_a_weight_of_the_wrong_width_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"weights\[1\] must be a 2-D \(out, 4\) tensor, got \(3, 5\)"
    ):
        all_gather_matmul(torch.randn(2, 4), [torch.randn(3, 4), torch.randn(3, 5)], None)


def test_scales_of_the_wrong_shape_or_with_a_gradient_are_refused() -> None:
    x, w = torch.randn(4, 2, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"scales must hold one entry per input \(1\), got 2"):
        matmul_reduce_scatter(x, w, None, scales=[None, None])
    with pytest.raises(ValueError, match=r"scales\[0\] must be None or of the output's shape"):
        matmul_reduce_scatter(x, w, None, scales=[torch.ones(4, 2, 8)])
    with pytest.raises(ValueError, match=r"scales\[0\] must be a constant"):
        matmul_reduce_scatter(x, w, None, scales=[torch.ones(4, 2, 6, requires_grad=True)])
    mask = torch.ones(4, 2, 6).bernoulli_(0.5)
    torch.testing.assert_close(matmul_reduce_scatter(x, w, None, scales=[mask]), (x @ w.t()) * mask)
