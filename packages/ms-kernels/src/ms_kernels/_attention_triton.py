"""Sliding-window attention in Triton, FlashAttention-2 style: forward and backward.

Private kernels behind ``ms_kernels.attention``; that module holds the public API,
the autograd wiring and the torch reference with identical semantics.

Layout and window. ``q`` is ``(B, Sq, Hq, D)``, ``k`` and ``v`` are ``(B, Sk, Hkv, D)``
with any strides; query head ``h`` reads kv head ``h // (Hq // Hkv)`` (GQA). With
``shift = Sk - Sq`` (flash-attn's bottom-right alignment), query ``i`` attends key ``j``
iff ``i + shift - left <= j <= i + shift + right`` and ``0 <= j < Sk``; causal is
``right = 0``. A query with no such key returns ``out = 0`` and ``lse = +inf``, so the
backward's ``exp2(s - lse)`` is 0 for it and it gets, and gives, zero gradients.

Forward (FlashAttention-2, Dao 2023, Algorithm 1). One program per (query block, batch,
head). It walks the key blocks of its window with an online softmax: a running row max
``m``, a running denominator ``l`` and an unnormalised fp32 accumulator, rescaled by
``exp(m_old - m_new)`` whenever the max grows; it divides by ``l`` once at the end and
stores ``lse = m + log2(l)`` for the backward. Scores are kept in base 2 (the scale is
multiplied by log2(e) once) so the exponentials are ``exp2``, and so is lse: a round
trip through the natural log would move it by an ulp or two of ``|lse|``, which
``exp2(s - lse)`` turns into a relative error of that size in every ``P`` (a row with
one key would get ``P != 1``). While every key seen so far is masked, ``m`` is ``-inf``
and ``s - m`` would be ``-inf - -inf = NaN``; the kernel subtracts 0 instead in that
case (every ``p`` is then ``exp2(-inf) = 0``).

Backward (FlashAttention-2, Algorithm 2), three launches and no atomics, so two runs are
bitwise identical:

1. a preprocess, ``delta_i = sum_d dO_id O_id`` in fp32 (equal to ``sum_j P_ij dP_ij``,
   the term the softmax Jacobian subtracts);
2. dK/dV: one program per (key block, batch, kv head), which recomputes
   ``P = exp2(s - lse)`` for every query block that sees its keys and accumulates
   ``dV += P^T dO`` and ``dK += dS^T Q`` with ``dS = P * (dP - delta)``,
   ``dP = dO V^T``. It loops over the ``G = Hq / Hkv`` query heads sharing its kv
   head, so GQA's sum over those heads happens inside one program;
3. dQ: one program per (query block, batch, head), which walks its key blocks as the
   forward does and accumulates ``dQ += dS K``.

Steps 2 and 3 are one kernel, ``_bwd_kernel``, launched twice: a program owns a "home"
tile (keys in 2, queries in 3) and visits the tiles of the other side that its window
meets, and the ``KEY_HOME`` constexpr picks which side is home and whether dV is
summed. Either way the tiles of ``S`` and ``dP`` are queries x keys, the products
``Q K^T`` and ``dO V^T`` exactly as the forward takes ``S`` (the dK/dV kernel transposes
``P`` and ``dS`` as the left operands of its products instead): ``K Q^T`` adds the same
products, but a backend may add them in another order (the interpreter's matmul does),
which moves ``s`` by several ulps where terms cancel, and ``exp2(s - lse)`` needs bitwise
the score the forward's lse came from, or ``P`` of a one-key row is not exactly 1. (The
interpreter's matmul also rounds differently for different tile shapes; its default
tiles are all 64 x 64.) ``dS`` is then the same in both launches, too.
dQ is a launch of its own because dQ sums over keys while dK/dV sum over queries: one
pass over key blocks would have every key block add into the same dQ rows, which needs
atomics (their order, hence the rounding, varies run to run) or a partial dQ per key
block (memory ``Sq * D * Sk / BLOCK_N``). The price is computing ``P`` and ``dP`` twice.

Block skipping (what makes the cost O(S * window) rather than O(S^2)). The window of
query ``i`` is the key interval ``[i + shift - left, i + shift + right]``, which moves
right by one key per query, so a query block ``[m0, m1]`` sees exactly the keys in
``[m0 + shift - left, m1 + shift + right]`` clipped to ``[0, Sk)``: the loop runs over the
key blocks overlapping that interval and no others (``_key_range``). Inverting the
inequality, key ``j`` is seen by queries ``[j - shift - right, j - shift + left]``, so a
key block ``[n0, n1]`` is seen by query rows ``[n0 - shift - right, n1 - shift + left]``
clipped to ``[0, Sq)`` (``_query_range``). Blocks partly inside the interval are masked
element-wise; blocks outside are never loaded. An empty interval gives an empty loop.
In a partly covered key block, keys outside the interval (``_seen_keys``; for dK/dV,
keys no query at all attends) are loaded as 0 rather than read: masking their scores
is not enough, as ``P V`` and ``dO V^T`` would still multiply a NaN or inf value by 0.
(The element-wise mask is applied to every visited block, interior ones included; a
GPU-tuned version would split off the interior blocks to save those few integer ops.)

Precision. Accumulation is fp32 throughout. fp16 and bf16 feed ``tl.dot`` natively and
``P`` / ``dS`` are cast to the input dtype before their products (as FlashAttention-2
does). fp32 inputs use ``input_precision="ieee"``: exact fp32 products, not TF32, so
fp32 results match torch's fp32 (which does not use TF32 for matmuls by default) at
the cost of tensor-core speed. Triton's interpreter cannot compute in bf16, so when it
runs (``TRITON_INTERPRET``, read per call) bf16 inputs are upcast to fp32 right after
each load (``UPCAST``) and results are written to fp32 buffers that torch rounds to
bf16 (the interpreter's fp32 -> bf16 cast truncates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ms_kernels._backend import _interpreting

__all__ = ["MAX_HEAD_DIM", "attention_backward", "attention_forward"]

MAX_HEAD_DIM = 128
"""Largest head dimension the kernels take (the head row is one block)."""

_LOG2E = math.log2(math.e)


@triton.jit
def _seen_keys(m_first, m_last, Sq, Sk, left, right):  # type: ignore[no-untyped-def]
    """[lo, hi], inclusive and clipped to the keys, of the keys that any query row in
    ``m_first .. m_last`` attends: ``m_first + shift - left .. m_last + shift + right``."""
    shift = Sk - Sq
    lo = tl.maximum(m_first + shift - left, 0)
    hi = tl.minimum(m_last + shift + right, Sk - 1)
    return lo, hi


@triton.jit  # type: ignore[untyped-decorator]
def _key_range(m_start, Sq, Sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """[start, end) of the key loop of query block ``m_start``; start is block-aligned.

    The block's rows are ``m_start .. min(m_start + BLOCK_M, Sq) - 1``.
    ``end <= start`` (an empty loop) when no row sees any key.
    """
    lo, hi = _seen_keys(m_start, tl.minimum(m_start + BLOCK_M, Sq) - 1, Sq, Sk, left, right)
    return (lo // BLOCK_N) * BLOCK_N, hi + 1


@triton.jit  # type: ignore[untyped-decorator]
def _query_range(n_start, Sq, Sk, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """[start, end) of the query loop of key block ``n_start``; start is block-aligned.

    Key ``j`` is seen by queries ``j - shift - right .. j - shift + left``.
    """
    shift = Sk - Sq
    n_last = tl.minimum(n_start + BLOCK_N, Sk) - 1
    lo = tl.maximum(n_start - shift - right, 0)
    hi = tl.minimum(n_last - shift + left, Sq - 1)
    return (lo // BLOCK_M) * BLOCK_M, hi + 1


@triton.jit
def _allowed(rows, cols, Sq, Sk, left, right):  # type: ignore[no-untyped-def]
    """Which (query, key) pairs of ``rows[:, None]`` x ``cols[None, :]`` attend.

    ``rows`` and ``cols`` are already shaped ``[M, 1]`` / ``[1, N]`` (or the transpose), so
    the same test serves both the ``S`` and ``S^T`` orientations.
    """
    diag = rows + (Sk - Sq)
    return (cols >= diag - left) & (cols <= diag + right) & (cols < Sk) & (rows < Sq)


@triton.jit  # type: ignore[untyped-decorator]
def _fwd_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Out,
    Lse,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    Sq,
    Sk,
    Hq,
    G,
    D,
    left,
    right,
    qk_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    kvh = (h // G).to(tl.int64)
    h = h.to(tl.int64)
    m_start = pid_m * BLOCK_M
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rows64 = offs_m.to(tl.int64)

    q_ptrs = Q + b * stride_qb + h * stride_qh + rows64[:, None] * stride_qs
    q = tl.load(
        q_ptrs + offs_d[None, :] * stride_qd,
        mask=(offs_m[:, None] < Sq) & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(m_start, Sq, Sk, left, right, BLOCK_M, BLOCK_N)
    # Keys no row of this block attends load as 0: a key block straddling the window
    # edge would otherwise carry their NaN or inf through p @ v (0 * NaN = NaN).
    seen_lo, seen_hi = _seen_keys(
        m_start, tl.minimum(m_start + BLOCK_M, Sq) - 1, Sq, Sk, left, right
    )
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + offs_n0
        cols64 = offs_n.to(tl.int64)
        n_ok = (offs_n >= seen_lo) & (offs_n <= seen_hi)
        # K is loaded transposed, (D, N), so the score product needs no transpose.
        kt = tl.load(
            k_base + cols64[None, :] * stride_ks + offs_d[:, None] * stride_kd,
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_base + cols64[:, None] * stride_vs + offs_d[None, :] * stride_vd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale
        ok = _allowed(offs_m[:, None], offs_n[None, :], Sq, Sk, left, right)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen no allowed key yet keep m = -inf; subtract 0 there
        # instead, so exp2(-inf - -inf) = NaN never arises (p and alpha are then 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]  # acc is 0 on empty rows
    # Base 2, like m_i: the backward subtracts it from base-2 scores as it is.
    lse = tl.where(empty, float("inf"), m_i + tl.math.log2(l_safe))
    m_ok = offs_m < Sq
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows64[:, None] * stride_os
    tl.store(
        o_ptrs + offs_d[None, :] * stride_od,
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & d_ok[None, :],
    )
    tl.store(Lse + b * stride_lb + h * stride_lh + rows64 * stride_ls, lse, mask=m_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _bwd_preprocess_kernel(  # type: ignore[no-untyped-def]
    Out,
    DO,
    Delta,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_db,
    stride_ds,
    stride_dh,
    stride_dd,
    Sq,
    Hq,
    D,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows64 = offs_m.to(tl.int64)
    m_ok = offs_m < Sq
    mask = m_ok[:, None] & (offs_d[None, :] < D)
    o = tl.load(
        Out
        + b * stride_ob
        + h * stride_oh
        + rows64[:, None] * stride_os
        + offs_d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO
        + b * stride_db
        + h * stride_dh
        + rows64[:, None] * stride_ds
        + offs_d[None, :] * stride_dd,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    # Delta is (B, Hq, Sq), contiguous.
    tl.store(Delta + (b * Hq + h) * Sq + rows64, tl.sum(o * do, 1), mask=m_ok)


@triton.jit  # type: ignore[untyped-decorator]
def _bwd_kernel(  # type: ignore[no-untyped-def]
    XH,
    YH,
    XV,
    YV,
    Lse,
    Delta,
    GX,
    GY,
    stride_gb,
    stride_gs,
    stride_gh,
    stride_gd,
    stride_xhb,
    stride_xhs,
    stride_xhh,
    stride_xhd,
    stride_yhb,
    stride_yhs,
    stride_yhh,
    stride_yhd,
    stride_xvb,
    stride_xvs,
    stride_xvh,
    stride_xvd,
    stride_yvb,
    stride_yvs,
    stride_yvh,
    stride_yvd,
    stride_lb,
    stride_lh,
    stride_ls,
    H_home,
    Sq,
    Sk,
    Hq,
    G,
    D,
    left,
    right,
    scale,
    qk_scale,
    BLOCK_HOME: tl.constexpr,
    BLOCK_VISIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KEY_HOME: tl.constexpr,
):
    """Both backward kernels: a program owns a "home" tile and visits the tiles it meets.

    ``KEY_HOME``: the dK/dV kernel. Home is a key block of one kv head, ``(XH, YH) =
    (K, V)``; it visits the query blocks that see it, in each of the G query heads of
    the group, ``(XV, YV) = (Q, dO)``, and writes ``GX = dK``, ``GY = dV``. Otherwise the
    dQ kernel: home is a query block of one head, ``(XH, YH) = (Q, dO)``, visiting key
    blocks ``(XV, YV) = (K, V)``, writing ``GX = dQ``. Either way ``S = Q K^T`` and
    ``dP = dO V^T`` (queries x keys) and ``GX += dS XV`` (``dS^T`` in the first case);
    lse and delta belong to the queries, the visited side in the first case and the home
    side in the second.
    """
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H_home).to(tl.int64)
    head = pid_bh % H_home
    h_start = pid * BLOCK_HOME
    offs_h = h_start + tl.arange(0, BLOCK_HOME)
    offs_v0 = tl.arange(0, BLOCK_VISIT)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    idx_h = offs_h.to(tl.int64)
    if KEY_HOME:
        home_in = offs_h < Sk
        # Keys no query attends load as 0, so their NaN or inf cannot reach dK or dV.
        seen_lo, seen_hi = _seen_keys(0, Sq - 1, Sq, Sk, left, right)
        home_ok = (offs_h >= seen_lo) & (offs_h <= seen_hi)
        lo, hi = _query_range(h_start, Sq, Sk, left, right, BLOCK_VISIT, BLOCK_HOME)
        n_heads = G
    else:
        home_in = offs_h < Sq
        home_ok = home_in
        # Keys no row of this block attends load as 0 (see the forward).
        q_last = tl.minimum(h_start + BLOCK_HOME, Sq) - 1
        seen_lo, seen_hi = _seen_keys(h_start, q_last, Sq, Sk, left, right)
        lo, hi = _key_range(h_start, Sq, Sk, left, right, BLOCK_HOME, BLOCK_VISIT)
        n_heads = 1
    home_head = head.to(tl.int64)
    home_mask = home_ok[:, None] & d_ok[None, :]
    xh = tl.load(
        XH + b * stride_xhb + home_head * stride_xhh + idx_h[:, None] * stride_xhs
        + offs_d[None, :] * stride_xhd,
        mask=home_mask,
        other=0.0,
    )  # fmt: skip
    yh = tl.load(
        YH + b * stride_yhb + home_head * stride_yhh + idx_h[:, None] * stride_yhs
        + offs_d[None, :] * stride_yhd,
        mask=home_mask,
        other=0.0,
    )  # fmt: skip
    if UPCAST:
        xh = xh.to(tl.float32)
        yh = yh.to(tl.float32)
    if not KEY_HOME:
        lse = tl.load(
            Lse + b * stride_lb + home_head * stride_lh + idx_h * stride_ls,
            mask=home_in,
            other=0.0,
        )
        delta = tl.load(Delta + (b * Hq + home_head) * Sq + idx_h, mask=home_in, other=0.0)
    acc_x = tl.zeros([BLOCK_HOME, BLOCK_D], tl.float32)
    acc_y = tl.zeros([BLOCK_HOME, BLOCK_D], tl.float32)
    # dK/dV: the G query heads of this kv head, in a fixed order, so GQA's sum over
    # heads happens here, in registers, with no atomics.
    for g in range(0, n_heads):
        if KEY_HOME:  # noqa: SIM108 (a constexpr branch; Triton resolves it at compile time)
            visit_head = home_head * G + g
        else:
            visit_head = (head // G).to(tl.int64)
        xv_base = XV + b * stride_xvb + visit_head * stride_xvh
        yv_base = YV + b * stride_yvb + visit_head * stride_yvh
        for v_start in range(lo, hi, BLOCK_VISIT):
            offs_v = v_start + offs_v0
            idx_v = offs_v.to(tl.int64)
            if KEY_HOME:  # noqa: SIM108
                v_ok = offs_v < Sq
            else:
                v_ok = (offs_v >= seen_lo) & (offs_v <= seen_hi)
            v_mask = v_ok[:, None] & d_ok[None, :]
            xv = tl.load(
                xv_base + idx_v[:, None] * stride_xvs + offs_d[None, :] * stride_xvd,
                mask=v_mask,
                other=0.0,
            )
            yv = tl.load(
                yv_base + idx_v[:, None] * stride_yvs + offs_d[None, :] * stride_yvd,
                mask=v_mask,
                other=0.0,
            )
            if UPCAST:
                xv = xv.to(tl.float32)
                yv = yv.to(tl.float32)
            # Queries x keys, as in the forward: see the module notes.
            if KEY_HOME:
                q_t, k_t, do_t, v_t = xv, xh, yv, yh
            else:
                q_t, k_t, do_t, v_t = xh, xv, yh, yv
            s = tl.dot(q_t, tl.trans(k_t), input_precision=DOT_PRECISION) * qk_scale
            dp = tl.dot(do_t, tl.trans(v_t), input_precision=DOT_PRECISION)
            if KEY_HOME:
                lse_base = Lse + b * stride_lb + visit_head * stride_lh
                lse_q = tl.load(lse_base + idx_v * stride_ls, mask=v_ok, other=0.0)
                delta_q = tl.load(Delta + (b * Hq + visit_head) * Sq + idx_v, mask=v_ok, other=0.0)
                ok = _allowed(offs_v[:, None], offs_h[None, :], Sq, Sk, left, right)
            else:
                lse_q = lse
                delta_q = delta
                ok = _allowed(offs_h[:, None], offs_v[None, :], Sq, Sk, left, right)
            # lse = +inf (a query with no key) makes every p of its row exp2(-inf) = 0.
            p = tl.where(ok, tl.math.exp2(s - lse_q[:, None]), 0.0)
            ds = p * (dp - delta_q[:, None])
            if KEY_HOME:
                acc_y += tl.dot(tl.trans(p.to(yv.dtype)), yv, input_precision=DOT_PRECISION)
                acc_x += tl.dot(tl.trans(ds.to(xv.dtype)), xv, input_precision=DOT_PRECISION)
            else:
                acc_x += tl.dot(ds.to(xv.dtype), xv, input_precision=DOT_PRECISION)

    acc_x = acc_x * scale
    # The gradients are fresh tensors of one layout, with strides stride_g*.
    g_off = (
        b * stride_gb + home_head * stride_gh + idx_h[:, None] * stride_gs
        + offs_d[None, :] * stride_gd
    )  # fmt: skip
    out_mask = home_in[:, None] & d_ok[None, :]
    tl.store(GX + g_off, acc_x.to(GX.dtype.element_ty), mask=out_mask)
    if KEY_HOME:
        tl.store(GY + g_off, acc_y.to(GY.dtype.element_ty), mask=out_mask)


@dataclass(frozen=True)
class _Tile:
    """One kernel's launch: (BLOCK_M, BLOCK_N) and its warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 1


@dataclass(frozen=True)
class _Blocks:
    """The launches of the three main kernels."""

    fwd: _Tile
    """The forward: BLOCK_M queries per program, BLOCK_N keys a step."""
    dkdv: _Tile
    """The dK/dV kernel: BLOCK_N keys per program, BLOCK_M queries a step."""
    dq: _Tile
    """The dQ kernel: BLOCK_M queries per program, BLOCK_N keys a step (its BLOCK_M is
    also the preprocessing kernel's)."""


def _block_sizes(head_dim: int, dtype: torch.dtype, interpreting: bool) -> _Blocks:
    """Tile sizes for inputs of ``dtype`` and ``head_dim``; the one place they are chosen.

    GPU values for fp16 and bf16 come from ``tools/bench/kernels/attention_tiles.py``,
    which times every kernel over a grid of tiles, warps and stages on the device at
    hand (see the ``_TUNED`` notes). fp32 uses exact fp32 dots, which run on FMA units
    rather than tensor cores and need far more registers: hence its small tiles, which
    were compiled for sm_90 and picked to keep register spills near zero, not timed.
    """
    if interpreting:
        # Interpreted cost is per program and per op, nearly flat in tile size: 64 x 64
        # tiles ran the tests' shapes (S <= ~100) 2-3x faster than 32 x 32 and 5x faster
        # than 16 x 16. Tests patch in smaller and uneven tiles where they need many blocks.
        tile = _Tile(64, 64)
        return _Blocks(fwd=tile, dkdv=tile, dq=tile)
    if dtype == torch.float32:
        tile = _Tile(32, 32, num_warps=8, num_stages=2)
        return _Blocks(fwd=tile, dkdv=tile, dq=tile)
    if head_dim <= 64:
        return _TUNED[64]
    return _TUNED[128]


_TUNED = {
    # The same sweep at head dim 64, cut short by its time budget (each kernel saw 18-22
    # of its 23-35 candidates, the last of GRID's tiles not): against 128x64, 64x64,
    # 64x64 with 8 warps and 3 stages, the forward takes 0.83x, dK/dV 0.65x, dQ 0.81x.
    64: _Blocks(
        fwd=_Tile(64, 64, num_warps=4, num_stages=3),
        dkdv=_Tile(64, 64, num_warps=4, num_stages=3),
        dq=_Tile(64, 32, num_warps=4, num_stages=2),
    ),
    # Swept on an H200 (torch 2.11, Triton 3.6; bf16, 4 x 4096 x 32/8 heads, causal and a
    # window of 512): against the launches before (128x64, 32x32, 64x32, all 8 warps and
    # 2 stages) the forward takes 0.80x the time, the dK/dV kernel 0.52x, dQ 0.87x.
    # Four warps won every kernel; a 128-key dK/dV home with 8 warps and 3 stages gave
    # wrong gradients (relative error 1.4-2.4e-2) and is not used.
    128: _Blocks(
        fwd=_Tile(64, 64, num_warps=4, num_stages=3),
        dkdv=_Tile(64, 64, num_warps=4, num_stages=2),
        dq=_Tile(64, 64, num_warps=4, num_stages=2),
    ),
}
"""fp16 / bf16 launches on a GPU by head dim (<= 64, <= 128)."""


def _head_block(head_dim: int) -> int:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in 1..{MAX_HEAD_DIM}, got {head_dim}")
    # tl.dot needs every tile dimension >= 16.
    return max(16, int(triton.next_power_of_2(head_dim)))


def _clamp_window(left: int, right: int, sq: int, sk: int) -> tuple[int, int]:
    """A window side beyond ``sq + sk`` reaches past every key; clamping it there keeps
    the kernels' int32 index arithmetic from overflowing on "unbounded" sentinels."""
    return min(left, sq + sk), min(right, sq + sk)


def _compute_dtypes(dtype: torch.dtype) -> tuple[bool, str, torch.dtype]:
    """(UPCAST, DOT_PRECISION, dtype of the kernels' output buffers) for inputs of ``dtype``."""
    upcast = dtype == torch.bfloat16 and _interpreting()
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return upcast, precision, torch.float32 if upcast else dtype


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: int,
    right: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window attention forward.

    ``q``: ``(B, Sq, Hq, D)``; ``k``, ``v``: ``(B, Sk, Hkv, D)``, one dtype and device, any
    strides, ``Hq % Hkv == 0``. ``left``, ``right``: the window (validated by the caller;
    a value >= ``Sq + Sk`` is unbounded). Returns ``out`` ``(B, Sq, Hq, D)`` in q's dtype,
    contiguous, and ``lse`` ``(B, Hq, Sq)`` fp32, the logsumexp of ``scale * q.k`` over
    the allowed keys in base 2, ``log2(sum 2^(log2(e) scale q.k))`` (the natural-log
    value divided by ln 2), as ``attention_backward`` takes it; ``+inf``, with
    ``out = 0``, for a query that has none.
    """
    batch, sq, hq, head_dim = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    block_d = _head_block(head_dim)
    left, right = _clamp_window(left, right, sq, sk)
    upcast, precision, buf_dtype = _compute_dtypes(q.dtype)
    out = torch.empty((batch, sq, hq, head_dim), dtype=buf_dtype, device=q.device)
    lse = torch.empty((batch, hq, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out.to(q.dtype), lse
    if sk == 0:  # no keys at all: every query is empty
        return out.zero_().to(q.dtype), lse.fill_(math.inf)
    blocks = _block_sizes(head_dim, q.dtype, _interpreting())
    tile = blocks.fwd
    grid = (triton.cdiv(sq, tile.block_m), batch * hq)
    _fwd_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *lse.stride(),
        sq,
        sk,
        hq,
        hq // hkv,
        head_dim,
        left,
        right,
        scale * _LOG2E,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_D=block_d,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out.to(q.dtype), lse


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    left: int,
    right: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of ``attention_forward``, in the dtypes and shapes of q, k, v.

    ``out`` and ``lse`` are the forward's results, lse still in base 2; ``dout`` is the
    gradient of ``out`` (any strides). Queries with no allowed key contribute nothing.
    """
    batch, sq, hq, head_dim = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    block_d = _head_block(head_dim)
    left, right = _clamp_window(left, right, sq, sk)
    upcast, precision, buf_dtype = _compute_dtypes(q.dtype)
    # Every program writes its whole tile, zeros included, so the kernels leave no
    # element unwritten; only the no-launch cases below need explicit zeros.
    dq = torch.empty((batch, sq, hq, head_dim), dtype=buf_dtype, device=q.device)
    dk = torch.empty((batch, sk, hkv, head_dim), dtype=buf_dtype, device=q.device)
    dv = torch.empty((batch, sk, hkv, head_dim), dtype=buf_dtype, device=q.device)
    if batch == 0 or sq == 0 or sk == 0 or hq == 0:
        return dq.zero_().to(q.dtype), dk.zero_().to(k.dtype), dv.zero_().to(v.dtype)
    blocks = _block_sizes(head_dim, q.dtype, _interpreting())
    delta = torch.empty((batch, hq, sq), dtype=torch.float32, device=q.device)
    pre_m = blocks.dq.block_m
    _bwd_preprocess_kernel[(triton.cdiv(sq, pre_m), batch * hq)](
        out,
        dout,
        delta,
        *out.stride(),
        *dout.stride(),
        sq,
        hq,
        head_dim,
        BLOCK_M=pre_m,
        BLOCK_D=block_d,
    )
    sizes = (sq, sk, hq, hq // hkv, head_dim, left, right, scale, scale * _LOG2E)
    options = {"BLOCK_D": block_d, "UPCAST": upcast, "DOT_PRECISION": precision}
    tile = blocks.dkdv
    _bwd_kernel[(triton.cdiv(sk, tile.block_n), batch * hkv)](
        k, v, q, dout, lse, delta, dk, dv,
        *dk.stride(), *k.stride(), *v.stride(), *q.stride(), *dout.stride(), *lse.stride(),
        hkv, *sizes,
        BLOCK_HOME=tile.block_n, BLOCK_VISIT=tile.block_m, KEY_HOME=True,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **options,
    )  # fmt: skip
    tile = blocks.dq
    _bwd_kernel[(triton.cdiv(sq, tile.block_m), batch * hq)](
        q, dout, k, v, lse, delta, dq, dq,  # GY: unused by the dQ kernel
        *dq.stride(), *q.stride(), *dout.stride(), *k.stride(), *v.stride(), *lse.stride(),
        hq, *sizes,
        BLOCK_HOME=tile.block_m, BLOCK_VISIT=tile.block_n, KEY_HOME=False,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **options,
    )  # fmt: skip
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
