"""The Triton kernels behind ``layer_norm`` and ``rms_norm``: one forward, one backward.

Private; imported only when a call runs on the Triton backend, so that ``ms_kernels``
imports (and its torch paths run) where triton is not installed. The torch
references with identical semantics are ``ms_kernels.layer_norm.layer_norm_reference``
and ``ms_kernels.rms_norm.rms_norm_reference``.

RMSNorm is LayerNorm without the centring and the bias (``IS_RMS``), so both share
these kernels. They load in the input dtype, compute in fp32 and store in the input
dtype; with a residual of another dtype, the sum and the output are stored in the
dtype torch promotes the two to (``torch.promote_types``). Weight and bias gradients
are reduced without atomics: each backward program accumulates its rows into its own
row of a partial buffer, and the partials are summed afterwards, so results are
bitwise reproducible.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["run_norm"]

# Backward programs per SM on CUDA; under the interpreter each program costs
# milliseconds, so a handful of programs there.
_PROGRAMS_PER_SM = 4
_INTERPRETER_PROGRAMS = 4


@triton.jit  # type: ignore[untyped-decorator]
def _norm_fwd_kernel(  # type: ignore[no-untyped-def]
    X,
    R,
    S,
    Y,
    W,
    B,
    Mean,
    Rstd,
    stride_x,
    stride_r,
    stride_s,
    stride_y,
    N,
    eps,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the storage dtype first and normalize that, so the
        # output is the norm of the returned sum (the reference's semantics).
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        tl.store(Mean + row, mean)
        xc = tl.where(mask, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(Rstd + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _norm_bwd_kernel(  # type: ignore[no-untyped-def]
    X,
    W,
    DY,
    DS,
    DX,
    Mean,
    Rstd,
    DW_part,
    DB_part,
    stride_x,
    stride_dy,
    stride_ds,
    stride_dx,
    M,
    N,
    rows_per_program,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full([BLOCK_N], 1.0, tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = first + i
        # A block-shaped row test: the interpreter rejects a scalar mask here. Rows
        # past M load zeros, so they add nothing to dw and db.
        row_mask = mask & ((cols * 0 + row) < M)
        stat_row = tl.minimum(row, M - 1)
        x = tl.load(X + row * stride_x + cols, mask=row_mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + stat_row)
        if IS_RMS:
            xhat = x * rstd
        else:
            mean = tl.load(Mean + stat_row)
            xhat = tl.where(row_mask, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DS:
            dx += tl.load(DS + row * stride_ds + cols, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=row_mask)
        dw += dy * xhat
        db += dy
    tl.store(DW_part + pid * N + cols, dw, mask=mask)
    if not IS_RMS:
        tl.store(DB_part + pid * N + cols, db, mask=mask)


def _backward_programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * _PROGRAMS_PER_SM))
    return max(1, min(rows, _INTERPRETER_PROGRAMS))


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


class _NormFn(torch.autograd.Function):
    """LayerNorm / RMSNorm of 2-D rows, optionally of ``x + residual``.

    Returns ``(y,)`` without a residual and ``(y, x + residual)`` with one.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        is_rms: bool,
    ) -> tuple[torch.Tensor, ...]:
        rows, n = x.shape
        block = triton.next_power_of_2(n)
        # The sum, and so the output, take torch's promoted dtype of x and residual,
        # as ``x + residual`` does on the torch backend.
        s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
        y = torch.empty(x.shape, dtype=s_dtype, device=x.device)
        s = torch.empty_like(y) if residual is not None else x
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows > 0:
            r = residual if residual is not None else x
            _norm_fwd_kernel[(rows,)](
                x,
                r,
                s,
                y,
                weight if weight is not None else x,
                bias if bias is not None else x,
                mean,
                rstd,
                x.stride(0),
                r.stride(0),
                s.stride(0),
                y.stride(0),
                n,
                eps,
                IS_RMS=is_rms,
                HAS_RES=residual is not None,
                HAS_W=weight is not None,
                HAS_B=bias is not None,
                BLOCK_N=block,
                num_warps=_num_warps(block),
            )
        ctx.save_for_backward(s, weight, mean, rstd)
        ctx.has_residual = residual is not None
        ctx.x_dtype = x.dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.is_rms = is_rms
        ctx.set_materialize_grads(False)
        if residual is not None:
            return y, s
        return (y,)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        s, weight, mean, rstd = ctx.saved_tensors
        dy = grads[0]
        ds = grads[1] if ctx.has_residual else None
        rows, n = s.shape
        if dy is None:
            dy = torch.zeros_like(s)
        dy = dy.contiguous()
        if ds is not None:
            ds = ds.contiguous()
        dx = torch.empty_like(s)
        programs = _backward_programs(rows, s.device)
        rows_per_program = math.ceil(rows / programs) if rows else 0
        dw_part = torch.zeros(programs, n, dtype=torch.float32, device=s.device)
        db_part = torch.zeros(programs, n, dtype=torch.float32, device=s.device)
        if rows > 0:
            block = triton.next_power_of_2(n)
            d = ds if ds is not None else dy
            _norm_bwd_kernel[(programs,)](
                s,
                weight if weight is not None else s,
                dy,
                d,
                dx,
                mean,
                rstd,
                dw_part,
                db_part,
                s.stride(0),
                dy.stride(0),
                d.stride(0),
                dx.stride(0),
                rows,
                n,
                rows_per_program,
                IS_RMS=ctx.is_rms,
                HAS_W=weight is not None,
                HAS_DS=ds is not None,
                BLOCK_N=block,
                num_warps=_num_warps(block),
            )
        dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
        db = db_part.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        # dx is the gradient of s; each addend gets it in its own dtype, as autograd
        # gives it through a promoting ``x + residual``.
        return (
            dx.to(ctx.x_dtype),
            dx.to(ctx.residual_dtype) if ctx.has_residual else None,
            dw,
            db,
            None,
            None,
        )


def run_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    eps: float,
    is_rms: bool,
) -> tuple[torch.Tensor, ...]:
    """Flattens to rows of ``n``, runs ``_NormFn``, and restores ``x``'s shape."""
    x2 = x.reshape(-1, n).contiguous()
    r2 = residual.reshape(-1, n).contiguous() if residual is not None else None
    w = weight.reshape(n).contiguous() if weight is not None else None
    b = bias.reshape(n).contiguous() if bias is not None else None
    outs = _NormFn.apply(x2, r2, w, b, float(eps), is_rms)  # type: ignore[no-untyped-call]
    return tuple(o.view(x.shape) for o in outs)
