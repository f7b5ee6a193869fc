"""Chunked collective matmuls: the GEMMs of tensor + sequence parallelism with their
all-gather and reduce-scatter pipelined, forward and backward (MegaScale section 3.3).

Sequence parallelism keeps activations between layers split along their first
dimension (the sequence) over the TP group. A column-parallel GEMM needs the whole
sequence (an all-gather before it); a row-parallel GEMM gives partial sums of the whole
sequence (a reduce-scatter after it). Both functions here split the rows of the shard
into ``chunks`` pieces and overlap each piece's communication with GEMMs, using
``torch.distributed`` collectives only, so the same code runs on gloo and NCCL, eager:

- :func:`all_gather_matmul` issues every piece's all-gather at once, multiplies this
  rank's own rows while they fly, then each piece's remote rows as it arrives;
- :func:`matmul_reduce_scatter` multiplies each piece's rows of the other ranks first and
  sends them with an all-to-all (the same bytes as a ring reduce-scatter), so that its
  own rows' GEMM, done last, hides the exchange; it adds what came back.

Their backwards are each other's forwards, with the weight gradients placed where they
hide the remaining communication. Docs: ``docs/tensor-parallel.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ms_parallel._tp_comm import Pending, TPComm, chunk_bounds

__all__ = [
    "all_gather_matmul",
    "gather_sequence",
    "matmul_reduce_scatter",
    "reduce_scatter_sequence",
    "scatter_sequence",
]


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _check_chunks(chunks: int) -> int:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
    return chunks


def _as_comm(group: dist.ProcessGroup | TPComm | None) -> TPComm:
    return group if isinstance(group, TPComm) else TPComm(group)


def _weights(weights: Tensor | Sequence[Tensor], k: int, what: str) -> list[Tensor]:
    ws = [weights] if isinstance(weights, Tensor) else list(weights)
    if not ws:
        raise ValueError(f"{what} must be a tensor or a non-empty sequence of tensors")
    for i, w in enumerate(ws):
        if not isinstance(w, Tensor) or w.dim() != 2 or w.shape[1] != k:
            got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(f"{what}[{i}] must be a 2-D (out, {k}) tensor, got {got}")
    return ws


# -- the fused all-gather + matmul ------------------------------------------------------


def _gather_mm(
    x2: Tensor, ws: Sequence[Tensor], comm: TPComm, chunks: int, phase: str, op: str
) -> list[Tensor]:
    """``[AG(x2) @ w.T for w in ws]`` as ``(size, rows, out)`` tensors, overlapped."""
    n, r, rows = comm.size, comm.rank, x2.shape[0]
    bounds = chunk_bounds(rows, chunks)
    flying = [comm.gather(x2[a:b], op, p, len(bounds), phase) for p, (a, b) in enumerate(bounds)]
    outs = [x2.new_empty((n, rows, w.shape[0])) for w in ws]
    comm.emit("gemm", "compute_begin", chunk="local", phase=phase)
    for out, w in zip(outs, ws, strict=True):
        torch.matmul(x2, w.t(), out=out[r])
    comm.emit("gemm", "compute_end", chunk="local", phase=phase)
    for p, (a, b) in enumerate(bounds):
        got = comm.wait(flying[p], phase)
        comm.emit("gemm", "compute_begin", chunk=p, phase=phase)
        for j in range(n):
            if j != r:
                for out, w in zip(outs, ws, strict=True):
                    torch.matmul(got[j], w.t(), out=out[j, a:b])
        comm.emit("gemm", "compute_end", chunk=p, phase=phase)
    return outs


def _scaled_mm(x: Tensor, w: Tensor, scale: Tensor | None, out: Tensor, accumulate: bool) -> None:
    """``out (+)= (x @ w.T) * scale`` (``scale`` None: unscaled)."""
    if scale is None:
        if accumulate:
            out.addmm_(x, w.t())
        else:
            torch.matmul(x, w.t(), out=out)
    elif accumulate:
        out.add_(torch.matmul(x, w.t()).mul_(scale))
    else:
        torch.mul(torch.matmul(x, w.t()), scale, out=out)


def _mm_scatter_send(
    xs: Sequence[Tensor],
    ws: Sequence[Tensor],
    scales: Sequence[Tensor | None],
    comm: TPComm,
    chunks: int,
    phase: str,
) -> tuple[list[tuple[int, int]], list[Pending]]:
    """Issue, piece by piece, the other ranks' rows of ``sum((x @ w.T) * scale)``; ``xs``
    (and the scales) are ``(size, rows, k)``."""
    n, r, rows = comm.size, comm.rank, xs[0].shape[1]
    out_features = ws[0].shape[0]
    bounds = chunk_bounds(rows, chunks)
    flying = []
    for p, (a, b) in enumerate(bounds):
        send = xs[0].new_empty((n, b - a, out_features))
        send[r].zero_()  # this rank's own slot comes back to it unread
        comm.emit("gemm", "compute_begin", chunk=p, phase=phase)
        for j in range(n):
            if j == r:
                continue
            for i, (x, w, sc) in enumerate(zip(xs, ws, scales, strict=True)):
                _scaled_mm(x[j, a:b], w, None if sc is None else sc[j, a:b], send[j], i > 0)
        comm.emit("gemm", "compute_end", chunk=p, phase=phase)
        flying.append(comm.exchange(send, "reduce_scatter", p, len(bounds), phase))
    return bounds, flying


def _add_received(
    y: Tensor, bounds: list[tuple[int, int]], flying: list[Pending], comm: TPComm, phase: str
) -> None:
    for p, (a, b) in enumerate(bounds):
        got = comm.wait(flying[p], phase)
        for j in range(comm.size):
            if j != comm.rank:
                y[a:b] += got[j]


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm, chunks: int, *ws: Tensor) -> Any:
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        with torch.autocast(x.device.type, enabled=False):
            outs = _gather_mm(x2, ws, comm, chunks, "forward", "all_gather")
        ctx.save_for_backward(x2, *ws)
        ctx.comm, ctx.chunks, ctx.x_shape = comm, chunks, x.shape
        lead = (comm.size * x.shape[0], *x.shape[1:-1])
        return tuple(out.view(*lead, out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        x2, *ws = ctx.saved_tensors
        comm: TPComm = ctx.comm
        n, r, rows = comm.size, comm.rank, x2.shape[0]
        gys = [g.reshape(n, rows, g.shape[-1]) for g in grads]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        with torch.autocast(x2.device.type, enabled=False):
            bounds = chunk_bounds(rows, ctx.chunks)
            # The input is gathered again rather than kept from forward (sequence
            # parallelism's memory saving); its pieces fly behind the dX GEMMs.
            regather = [
                comm.gather(x2[a:b], "all_gather", p, len(bounds), "backward")
                for p, (a, b) in enumerate(bounds)
                if any(want_w)
            ]
            dx: Tensor | None = None
            sent: list[Pending] = []
            if want_x:
                # dX = dY @ W summed over the group: the other ranks' rows go first.
                wts = [w.t() for w in ws]
                none: list[Tensor | None] = [None] * len(gys)
                _, sent = _mm_scatter_send(gys, wts, none, comm, ctx.chunks, "backward")
                dx = torch.matmul(gys[0][r], ws[0])
                for gy, w in zip(gys[1:], ws[1:], strict=True):
                    dx.addmm_(gy[r], w)
            # The weight gradients hide the exchange: local rows first, then each piece.
            dws: list[Tensor | None] = [
                gy[r].t() @ x2 if want else None for gy, want in zip(gys, want_w, strict=True)
            ]
            for p, (a, b) in enumerate(bounds):
                if not regather:
                    break
                got = comm.wait(regather[p], "backward")
                for j in range(n):
                    if j != r:
                        for i, gy in enumerate(gys):
                            dw = dws[i]
                            if dw is not None:
                                dw.addmm_(gy[j, a:b].t(), got[j])
            if dx is not None:
                _add_received(dx, bounds, sent, comm, "backward")
        return (None if dx is None else dx.view(ctx.x_shape), None, None, *dws)


def all_gather_matmul(
    x_shard: Tensor,
    weights: Tensor | Sequence[Tensor],
    group: dist.ProcessGroup | TPComm | None,
    *,
    chunks: int = 2,
    overlap: bool = True,
) -> Tensor | list[Tensor]:
    """``all_gather(x_shard) @ w.T`` for each weight, the gather chunked and overlapped.

    Args:
        x_shard: ``(s, *batch, k)``, this rank's part of a sequence split over ``group``
            along dim 0 (rank ``i`` holds rows ``[i * s, (i + 1) * s)``).
        weights: one ``(out, k)`` weight (``nn.Linear``'s layout), or several that read
            the same gathered input (the parallel block's QKV and FC).
        group: the TP group, or a :class:`TPComm` that also carries the timeout, the
            event hook and a label for errors; ``None`` or one rank: a plain matmul.
        chunks: pieces the shard's rows are split into (each piece's all-gather is
            waited just before its GEMM); more than the rows is taken as one per row.
        overlap: ``False`` runs the unfused reference instead: one all-gather, waited,
            then the GEMMs (the same results).

    Returns:
        ``(size * s, *batch, out)`` for one weight, else a list in ``weights``' order.
        Differentiable in ``x_shard`` and the weights.
    """
    k = x_shard.shape[-1]
    ws = _weights(weights, k, "weights")
    _check_chunks(chunks)
    comm = _as_comm(group)
    dtype = _autocast_dtype(x_shard)
    if dtype is not None:
        x_shard, ws = x_shard.to(dtype), [w.to(dtype) for w in ws]
    if comm.size == 1 or not overlap:
        full = gather_sequence(x_shard, comm)
        outs = [torch.nn.functional.linear(full, w) for w in ws]
    else:
        outs = list(_AllGatherMatmul.apply(x_shard, comm, chunks, *ws))  # type: ignore[no-untyped-call]
    return outs[0] if isinstance(weights, Tensor) else outs


# -- the fused matmul + reduce-scatter --------------------------------------------------


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, comm: TPComm, chunks: int, n_in: int, scaled: tuple[bool, ...], *tensors: Tensor
    ) -> Tensor:
        xs_in, ws = tensors[:n_in], tensors[n_in : 2 * n_in]
        given = iter(tensors[2 * n_in :])
        n = comm.size
        rows = xs_in[0].numel() // (n * xs_in[0].shape[-1])
        xs = [x.reshape(n, rows, x.shape[-1]) for x in xs_in]
        out_features = ws[0].shape[0]
        scales = [next(given).reshape(n, rows, out_features) if s else None for s in scaled]
        r = comm.rank
        with torch.autocast(xs[0].device.type, enabled=False):
            bounds, flying = _mm_scatter_send(xs, ws, scales, comm, chunks, "forward")
            y = xs[0].new_empty((rows, out_features))
            for i, (x, w, sc) in enumerate(zip(xs, ws, scales, strict=True)):
                _scaled_mm(x[r], w, None if sc is None else sc[r], y, i > 0)
            _add_received(y, bounds, flying, comm, "forward")
        ctx.save_for_backward(*xs, *ws, *(sc for sc in scales if sc is not None))
        ctx.comm, ctx.chunks, ctx.n_in, ctx.scaled = comm, chunks, n_in, scaled
        ctx.x_shapes = [x.shape for x in xs_in]
        lead = xs_in[0].shape[:-1]
        return y.view(lead[0] // n, *lead[1:], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        saved = ctx.saved_tensors
        n_in = ctx.n_in
        xs, ws = saved[:n_in], saved[n_in : 2 * n_in]
        given = iter(saved[2 * n_in :])
        scales = [next(given) if s else None for s in ctx.scaled]
        comm: TPComm = ctx.comm
        n, r, rows = comm.size, comm.rank, xs[0].shape[1]
        g2 = grad.reshape(rows, grad.shape[-1])
        want = ctx.needs_input_grad[4 : 4 + 2 * n_in]
        want_x, want_w = want[:n_in], want[n_in:]

        def scaled(g: Tensor, sc: Tensor | None, j: int, a: int, b: int) -> Tensor:
            return g if sc is None else g * sc[j, a:b]

        with torch.autocast(g2.device.type, enabled=False):
            bounds = chunk_bounds(rows, ctx.chunks)
            flying = [
                comm.gather(g2[a:b], "all_gather", p, len(bounds), "backward")
                for p, (a, b) in enumerate(bounds)
            ]
            # This rank's rows first, while the other ranks' gradient pieces fly.
            dxs: list[Tensor | None] = []
            dws: list[Tensor | None] = []
            for x, w, sc, wx, ww in zip(xs, ws, scales, want_x, want_w, strict=True):
                g = scaled(g2, sc, r, 0, rows)
                dx = None
                if wx:
                    dx = g2.new_empty((n, rows, w.shape[1]))
                    torch.matmul(g, w, out=dx[r])
                dxs.append(dx)
                dws.append(g.t() @ x[r] if ww else None)
            for p, (a, b) in enumerate(bounds):
                got = comm.wait(flying[p], "backward")
                for j in range(n):
                    if j == r:
                        continue
                    for i, (x, w, sc) in enumerate(zip(xs, ws, scales, strict=True)):
                        dx, dw = dxs[i], dws[i]
                        if dx is None and dw is None:
                            continue
                        g = scaled(got[j], sc, j, a, b)
                        if dx is not None:
                            torch.matmul(g, w, out=dx[j, a:b])
                        if dw is not None:
                            dw.addmm_(g.t(), x[j, a:b])
        out_x = [
            None if dx is None else dx.view(shape)
            for dx, shape in zip(dxs, ctx.x_shapes, strict=True)
        ]
        return (None, None, None, None, *out_x, *dws, *(None for s in ctx.scaled if s))


def matmul_reduce_scatter(
    xs: Tensor | Sequence[Tensor],
    weights: Tensor | Sequence[Tensor],
    group: dist.ProcessGroup | TPComm | None,
    *,
    chunks: int = 2,
    overlap: bool = True,
    scales: Sequence[Tensor | None] | None = None,
) -> Tensor:
    """``reduce_scatter(sum(x @ w.T))`` along dim 0, the GEMMs chunked and overlapped.

    Args:
        xs: ``(size * s, *batch, k_i)`` inputs holding the whole sequence (each rank's
            partial sums are over its own slice of ``k``), one or several: the parallel
            block sums its attention and MLP projections before one reduce-scatter.
        weights: ``(out, k_i)`` weights, one per input.
        group: the TP group, or a :class:`TPComm`; ``None`` or one rank: a plain matmul.
        chunks: pieces each rank's share of rows is split into; each piece's exchange
            is issued as soon as its GEMMs are done.
        overlap: ``False`` runs the unfused reference: the GEMMs, then one
            reduce-scatter, waited (the same results up to the order of the sum).
        scales: one per input, None or a constant tensor of the whole output's shape
            ``(size * s, *batch, out)`` multiplied into that GEMM's output before the
            sum (no gradient flows to it): the parallel block's dropout masks, which
            every rank of the group must hold alike.

    Returns:
        ``(s, *batch, out)``: this rank's part of the summed result.
    """
    x_list = [xs] if isinstance(xs, Tensor) else list(xs)
    w_list = [weights] if isinstance(weights, Tensor) else list(weights)
    if not x_list or len(x_list) != len(w_list):
        raise ValueError(
            f"xs and weights must be non-empty and of the same length, got {len(x_list)} "
            f"inputs and {len(w_list)} weights"
        )
    lead = x_list[0].shape[:-1]
    for i, (x, w) in enumerate(zip(x_list, w_list, strict=True)):
        if x.shape[:-1] != lead:
            raise ValueError(
                f"xs[{i}] must have the leading shape {tuple(lead)} of xs[0], got {tuple(x.shape)}"
            )
        _weights(w, x.shape[-1], f"weights[{i}] for xs[{i}] of shape {tuple(x.shape)}; weights")
    if len({w.shape[0] for w in w_list}) != 1:
        raise ValueError(
            f"weights must share their output size, got {[tuple(w.shape) for w in w_list]}"
        )
    _check_chunks(chunks)
    comm = _as_comm(group)
    if x_list[0].dim() < 2 or lead[0] % comm.size:
        raise ValueError(
            f"xs' first dimension (the sequence, {lead[0] if lead else 0}) must divide by "
            f"the group's size {comm.size}"
        )
    s_list = _scales(scales, len(x_list), (*lead, w_list[0].shape[0]))
    dtype = _autocast_dtype(x_list[0])
    if dtype is not None:
        x_list, w_list = [x.to(dtype) for x in x_list], [w.to(dtype) for w in w_list]
        s_list = [None if sc is None else sc.to(dtype) for sc in s_list]
    if comm.size == 1 or not overlap:
        total: Tensor | None = None
        for x, w, sc in zip(x_list, w_list, s_list, strict=True):
            y = torch.nn.functional.linear(x, w)
            y = y if sc is None else y * sc
            total = y if total is None else total + y
        assert total is not None
        return reduce_scatter_sequence(total, comm)
    scaled = tuple(sc is not None for sc in s_list)
    given = [sc.contiguous() for sc in s_list if sc is not None]
    out: Tensor = _MatmulReduceScatter.apply(  # type: ignore[no-untyped-call]
        comm, chunks, len(x_list), scaled, *x_list, *w_list, *given
    )
    return out


def _scales(
    scales: Sequence[Tensor | None] | None, n: int, shape: tuple[int, ...]
) -> list[Tensor | None]:
    if scales is None:
        return [None] * n
    got = list(scales)
    if len(got) != n:
        raise ValueError(f"scales must hold one entry per input ({n}), got {len(got)}")
    for i, sc in enumerate(got):
        if sc is None:
            continue
        if not isinstance(sc, Tensor) or tuple(sc.shape) != shape:
            what = tuple(sc.shape) if isinstance(sc, Tensor) else type(sc).__name__
            raise ValueError(
                f"scales[{i}] must be None or of the output's shape {shape}, got {what}"
            )
        if sc.requires_grad:
            raise ValueError(f"scales[{i}] must be a constant (requires_grad=False)")
    return got


# -- the unfused sequence-parallel collectives ------------------------------------------


def _gather_wait(x: Tensor, comm: TPComm, phase: str) -> Tensor:
    got = comm.wait(comm.gather(x.contiguous(), "all_gather", 0, 1, phase), phase)
    return got.view(comm.size * x.shape[0], *x.shape[1:])


def _reduce_scatter_wait(x: Tensor, comm: TPComm, phase: str) -> Tensor:
    # An all-to-all and a local sum, as the fused path does: the same bytes as a ring
    # reduce-scatter, and gloo bounds its wait (its own reduce-scatter ignores the
    # timeout of wait() and ends only at the group's timeout).
    n = comm.size
    parts = x.contiguous().view(n, x.shape[0] // n, *x.shape[1:])
    got = comm.wait(comm.exchange(parts, "reduce_scatter", 0, 1, phase), phase)
    out = parts[comm.rank].clone()
    for j in range(n):
        if j != comm.rank:
            out += got[j]
    return out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return _gather_wait(x, comm, "forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return _reduce_scatter_wait(grad, ctx.comm, "backward"), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        return _reduce_scatter_wait(x, comm, "forward")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return _gather_wait(grad, ctx.comm, "backward"), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, comm: TPComm) -> Tensor:
        ctx.comm = comm
        s = x.shape[0] // comm.size
        return x[comm.rank * s : (comm.rank + 1) * s].clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        return _gather_wait(grad, ctx.comm, "backward"), None


def _seq_check(x: Tensor, comm: TPComm, what: str) -> None:
    if x.dim() < 1 or x.shape[0] % comm.size:
        raise ValueError(
            f"{what}: the first dimension (the sequence) must divide by the group's size "
            f"{comm.size}, got shape {tuple(x.shape)}"
        )


def gather_sequence(x: Tensor, group: dist.ProcessGroup | TPComm | None) -> Tensor:
    """All-gather along dim 0 (the sequence); backward: reduce-scatter of the gradient."""
    comm = _as_comm(group)
    if comm.size == 1:
        return x
    out: Tensor = _Gather.apply(x, comm)  # type: ignore[no-untyped-call]
    return out


def reduce_scatter_sequence(x: Tensor, group: dist.ProcessGroup | TPComm | None) -> Tensor:
    """Sum over the group and keep this rank's part of dim 0; backward: all-gather."""
    comm = _as_comm(group)
    if comm.size == 1:
        return x
    _seq_check(x, comm, "reduce_scatter_sequence")
    out: Tensor = _ReduceScatter.apply(x, comm)  # type: ignore[no-untyped-call]
    return out


def scatter_sequence(x: Tensor, group: dist.ProcessGroup | TPComm | None) -> Tensor:
    """This rank's part of dim 0 of a tensor every rank holds whole; backward: all-gather
    (each rank's gradient covers only its part)."""
    comm = _as_comm(group)
    if comm.size == 1:
        return x
    _seq_check(x, comm, "scatter_sequence")
    out: Tensor = _Scatter.apply(x, comm)  # type: ignore[no-untyped-call]
    return out
