"""The chunked collective matmuls overlap, as their event log shows, on the latency
backend with a finite link bandwidth (each piece's transfer takes its wire bytes over
the bandwidth, after the pieces issued before it): during chunk k's GEMM the
communication of chunk k + 1 is in flight, forward and backward. And the link model
itself: an op completes no earlier than its transfer plus L after the link is free."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ms_parallel import TPComm, all_gather_matmul, matmul_reduce_scatter
from ms_parallel.events import EventLog
from ms_parallel.latency import register_latency_backend
from ms_testing.dist import run_ranks

pytestmark = pytest.mark.slow

NAME = "test_tp_overlap_latency"
LATENCY = 0.02
TRANSFER = 0.08  # seconds per piece on the link
ROWS, BATCH, K, N, CHUNKS = 6, 2, 512, 64, 3


def _backend_ops(log: EventLog, group: str, op: str, since: int) -> list[dict[str, float]]:
    """The backend's ops of type ``op`` on ``group`` from event ``since`` on, in issue
    order: their issue and completion times and wire bytes."""
    ops: dict[int, dict[str, float]] = {}
    for e in log.events[since:]:
        if e.name != op or e.attrs.get("group") != group or "seq" not in e.attrs:
            continue
        ops.setdefault(e.attrs["seq"], {})[e.kind] = e.t
        ops[e.attrs["seq"]]["wire"] = e.attrs["wire_bytes"]
    return [ops[s] for s in sorted(ops)]


def _gemms(log: EventLog, since: int, phase: str) -> dict[Any, dict[str, float]]:
    out: dict[Any, dict[str, float]] = {}
    for e in log.events[since:]:
        if e.name == "gemm" and e.attrs.get("phase") == phase:
            out.setdefault(e.attrs["chunk"], {})[e.kind] = e.t
    return out


def _rank() -> dict[str, Any]:
    log = EventLog()
    net = register_latency_backend(NAME, latency=LATENCY, on_event=log)
    pg = dist.new_group(backend=NAME)
    assert pg is not None
    group = pg.group_name
    out: dict[str, Any] = {}

    # The link model: one all-gather of known wire bytes, then two back to back.
    piece = torch.ones(ROWS // CHUNKS * BATCH, K)
    wire = (dist.get_world_size() - 1) * piece.numel() * 4  # an all-gather's ring bytes
    net.set_bandwidth(wire / TRANSFER)
    since = len(log.events)
    outs = [torch.empty(dist.get_world_size() * piece.shape[0], K) for _ in range(3)]
    dist.all_gather_into_tensor(outs[0], piece, group=pg)
    works = [dist.all_gather_into_tensor(o, piece, group=pg, async_op=True) for o in outs[1:]]
    for w in works:
        w.wait()
    out["link"] = _backend_ops(log, group, "all_gather", since)
    out["wire"] = wire

    comm = TPComm(pg, on_event=log, label="test")
    x = torch.randn(ROWS, BATCH, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    since = len(log.events)
    y = all_gather_matmul(x, w, comm, chunks=CHUNKS)
    assert isinstance(y, torch.Tensor)
    out["ag_forward"] = (
        _backend_ops(log, group, "all_gather", since),
        _gemms(log, since, "forward"),
    )
    since = len(log.events)
    y.sum().backward()
    out["ag_backward"] = _backend_ops(log, group, "all_to_all", since)
    out["ag_backward_gemms"] = _gemms(log, since, "backward")

    h = torch.randn(dist.get_world_size() * ROWS, BATCH, K, requires_grad=True)
    since = len(log.events)
    z = matmul_reduce_scatter(h, w, comm, chunks=CHUNKS)
    out["rs_forward"] = (
        _backend_ops(log, group, "all_to_all", since),
        _gemms(log, since, "forward"),
    )
    z.sum().backward()
    net.set_bandwidth(float("inf"))
    return out


def test_chunk_k_plus_1_is_in_flight_during_chunk_k_gemm() -> None:
    for r in run_ranks(_rank, 2, timeout=180):
        # Link model: transfer + L after issue; the second of two queued ops waits for
        # the first's transfer (each op's completion at least TRANSFER after the last).
        link = r["link"]
        assert len(link) == 3
        for op in link:
            assert op["complete"] - op["issue"] >= TRANSFER + LATENCY - 1e-3, op
            assert op["wire"] == r["wire"]
        assert link[2]["complete"] - link[1]["issue"] >= 2 * TRANSFER + LATENCY - 1e-3

        # All-gather + matmul forward: all pieces issued at once; piece k's GEMM starts
        # after piece k arrived and before piece k + 1 did (it is still on the link).
        pieces, gemms = r["ag_forward"]
        assert len(pieces) == CHUNKS
        issued_by = min(g["compute_begin"] for g in gemms.values())
        assert all(p["issue"] <= issued_by for p in pieces)
        for k in range(CHUNKS):
            assert gemms[k]["compute_begin"] >= pieces[k]["complete"], k
            if k + 1 < CHUNKS:
                assert gemms[k]["compute_begin"] < pieces[k + 1]["complete"], k
                assert gemms[k]["compute_end"] < pieces[k + 1]["complete"], k

        # Matmul + reduce-scatter forward: chunk k's exchange goes out when its GEMM
        # ends and is still in flight while chunk k + 1's GEMM runs.
        sent, gemms = r["rs_forward"]
        assert len(sent) == CHUNKS
        for k in range(CHUNKS):
            assert sent[k]["issue"] >= gemms[k]["compute_end"], k
            if k + 1 < CHUNKS:
                assert gemms[k + 1]["compute_begin"] < sent[k]["complete"], k

        # Backward of the all-gather matmul: dX's exchange (remote rows first) is in
        # flight while the weight-gradient GEMMs run.
        back = r["ag_backward"]
        assert len(back) == CHUNKS
        dw_gemms = [g for g in r["ag_backward_gemms"].values() if "compute_begin" in g]
        assert dw_gemms
        assert any(g["compute_begin"] < back[0]["complete"] for g in dw_gemms)
