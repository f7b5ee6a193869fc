"""The Triton kernels behind ``bias_gelu``: gelu(x + bias), forward and backward.

Private; imported only when a call runs on the Triton backend, so that ``ms_kernels``
imports (and its torch paths run) where triton is not installed. The torch
reference with identical semantics is ``ms_kernels.bias_gelu.bias_gelu_reference``.

The kernels compute in fp32 whatever the storage dtype, and address elements with
int64 row offsets, so tensors of 2**31 elements and more are handled. Inputs are
read with their row stride (no copy of a slice of a wider buffer); outputs are
contiguous. tanh is written with exp, since libdevice's tanh is not available to
Triton's interpreter. The bias gradient is reduced without atomics: each program
writes its column sums to a partial buffer, summed afterwards, so results are
bitwise reproducible.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["run_bias_gelu"]

# Rows and columns per program: 4096 elements, a few registers per thread on a GPU,
# and few programs for the interpreter (each costs milliseconds there).
_BLOCK_M = 16
_MAX_BLOCK_N = 256


@triton.jit
def _tanh_and_sech2(a):  # type: ignore[no-untyped-def]
    # From q = e^{-2|a|} in (0, 1]: tanh|a| = (1 - q) / (1 + q), sech^2 a = 4q / (1 + q)^2.
    # Never overflows, and sech^2 keeps full relative precision where tanh is near
    # +-1 (1 - tanh^2 there would cancel to a few ulps of 1).
    q = tl.exp(-2.0 * tl.abs(a))
    t = (1.0 - q) / (1.0 + q)
    return tl.where(a < 0, -t, t), 4.0 * q / ((1.0 + q) * (1.0 + q))


@triton.jit  # type: ignore[untyped-decorator]
def _gelu_and_grad(z, TANH: tl.constexpr, WANT_GRAD: tl.constexpr):  # type: ignore[no-untyped-def]
    """gelu(z) and, when WANT_GRAD, its derivative (else y again)."""
    if TANH:
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)  # sqrt(2/pi) (z + c z^3)
        t, sech2 = _tanh_and_sech2(inner)
        y = 0.5 * z * (1.0 + t)
        grad = y
        if WANT_GRAD:
            d_inner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
            grad = 0.5 * (1.0 + t) + 0.5 * z * sech2 * d_inner
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        y = z * cdf
        grad = y
        if WANT_GRAD:
            grad = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)  # + z * pdf(z)
    return y, grad


@triton.jit  # type: ignore[untyped-decorator]
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """This program's rows (int64), columns and in-bounds mask."""
    # Row indices in int64: a row index times a row stride passes 2**31 once a
    # tensor holds 2**31 elements, and int32 would wrap to a wrong address.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    return rows, cols, mask


@triton.jit  # type: ignore[untyped-decorator]
def _forward_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    stride_x,
    stride_y,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y, _ = _gelu_and_grad(x.to(tl.float32) + b[None, :], TANH, False)
    y_offs = rows[:, None] * stride_y + cols[None, :]
    tl.store(y_ptr + y_offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit  # type: ignore[untyped-decorator]
def _backward_kernel(  # type: ignore[no-untyped-def]
    dy_ptr,
    x_ptr,
    b_ptr,
    dx_ptr,
    db_partial_ptr,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(M, N, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    _, grad = _gelu_and_grad(x.to(tl.float32) + b[None, :], TANH, True)
    dz = tl.where(mask, dy.to(tl.float32) * grad, 0.0)
    dx_offs = rows[:, None] * stride_dx + cols[None, :]
    tl.store(dx_ptr + dx_offs, dz.to(dx_ptr.dtype.element_ty), mask=mask)
    # This program's share of the bias gradient; the host sums the rows of partials.
    pid_m = tl.program_id(0).to(tl.int64)
    tl.store(db_partial_ptr + pid_m * N + cols, tl.sum(dz, axis=0), mask=cols < N)


def _blocks(n: int) -> tuple[int, int]:
    return _BLOCK_M, min(triton.next_power_of_2(max(n, 1)), _MAX_BLOCK_N)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as (rows, n), copied only when its columns are not dense."""
    t2 = t.reshape(-1, n)
    # The kernels take any row stride, so a slice of a wider buffer is read in place.
    return t2 if t2.stride(1) == 1 else t2.contiguous()


class _BiasGeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
        n = x.shape[-1]
        x2 = _rows(x, n)
        b = bias.contiguous()
        m = x2.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m > 0 and n > 0:
            bm, bn = _blocks(n)
            grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
            _forward_kernel[grid](
                x2,
                b,
                y,
                m,
                n,
                x2.stride(0),
                y.stride(0),
                TANH=approximate == "tanh",
                BLOCK_M=bm,
                BLOCK_N=bn,
            )
        ctx.save_for_backward(x2, b)
        ctx.approximate = approximate
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, b = ctx.saved_tensors
        m, n = x2.shape
        dy2 = _rows(dy, n)
        dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
        bm, bn = _blocks(n)
        blocks_m = triton.cdiv(m, bm)
        partial = torch.empty((blocks_m, n), dtype=torch.float32, device=x2.device)
        if m > 0 and n > 0:
            _backward_kernel[(blocks_m, triton.cdiv(n, bn))](
                dy2,
                x2,
                b,
                dx,
                partial,
                m,
                n,
                dy2.stride(0),
                x2.stride(0),
                dx.stride(0),
                TANH=ctx.approximate == "tanh",
                BLOCK_M=bm,
                BLOCK_N=bn,
            )
        dbias = partial.sum(dim=0).to(b.dtype)
        return dx.view(ctx.x_shape), dbias, None


def run_bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    out: torch.Tensor = _BiasGeLUFunction.apply(x, bias, approximate)  # type: ignore[no-untyped-call]
    return out
