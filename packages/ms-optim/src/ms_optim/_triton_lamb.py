# Triton kernels take untyped arguments (their types come from the launch).
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""Fused multi-tensor LAMB in Triton: two launches per bucket, whatever its size.

Layers (STYLE.md): the kernels ``_moments_kernel`` / ``_apply_kernel``; the
wrapper :class:`TritonImpl` (the two phases of :mod:`ms_optim._bucket`); the
drop-in ``Lamb(..., impl="triton")``. The torch reference with identical
semantics is :mod:`ms_optim._single`.

Multi-tensor: each program handles one block of one tensor. A launch gets
tables of data addresses (one int64 per tensor) and a block map (tensor index,
first element), so one launch covers every tensor of a bucket. Per-block
partial sums of w^2 and u^2 are written to a buffer and summed per tensor
afterwards, with no atomics, so the result does not depend on program order.
Phase 2 recomputes u from the stored moments rather than keeping it: 10 words
of memory traffic per element against the floor of 7, and no scratch buffer.

The kernels compute in fp32: fp16/bf16 parameters come in through their fp32
master or scratch copy. Float64 buckets fall back to the foreach path.
"""

from __future__ import annotations

from typing import Any

import torch

from ms_optim._bucket import Bucket
from ms_optim._foreach import ForeachImpl

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("Lamb(impl='triton') needs Triton: pip install 'ms-optim[triton]'") from e

__all__ = ["TritonImpl"]


@triton.jit
def _update(m, v, w, bc1, bc2, eps, weight_decay, BIAS_CORRECTION, DECOUPLED):
    # Shared by both kernels so phase 2 recomputes exactly phase 1's u.
    if BIAS_CORRECTION:  # noqa: SIM108 - a compile-time branch, kept readable
        u = (m / bc1) / (tl.sqrt(v / bc2) + eps)
    else:
        u = m / (tl.sqrt(v) + eps)
    if DECOUPLED:
        u = u + weight_decay * w
    return u


@triton.jit
def _moments_kernel(
    w_addrs,
    g_addrs,
    m_addrs,
    v_addrs,
    numels,
    bc1s,
    bc2s,
    block_tensor,
    block_start,
    w_part,
    u_part,
    grad_scale,
    beta1,
    beta2,
    one_minus_beta1,
    one_minus_beta2,
    eps,
    weight_decay,
    BIAS_CORRECTION: tl.constexpr,
    DECOUPLED: tl.constexpr,
    CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    w_ptr = tl.load(w_addrs + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(g_addrs + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_addrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_addrs + t).to(tl.pointer_type(tl.float32))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if CLIP:
        g = g * tl.load(grad_scale)
    if not DECOUPLED:
        g = g + weight_decay * w  # L2: the decay enters the moments
    # 1 - beta comes from the host in float64: 1 - 0.999 in fp32 is off by 1.3e-5.
    # one_minus_beta1 is 1 without grad averaging (m = b1 m + g).
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    u = _update(
        m, v, w, tl.load(bc1s + t), tl.load(bc2s + t), eps, weight_decay, BIAS_CORRECTION, DECOUPLED
    )
    u = tl.where(mask, u, 0.0)  # masked lanes may hold 0/0 when eps is 0
    tl.store(w_part + pid, tl.sum(w * w, axis=0))
    tl.store(u_part + pid, tl.sum(u * u, axis=0))


@triton.jit
def _apply_kernel(
    w_addrs,
    m_addrs,
    v_addrs,
    numels,
    bc1s,
    bc2s,
    steps,
    block_tensor,
    block_start,
    eps,
    weight_decay,
    w_scale,
    BIAS_CORRECTION: tl.constexpr,
    DECOUPLED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    offs = tl.load(block_start + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numels + t)
    w_ptr = tl.load(w_addrs + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_addrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_addrs + t).to(tl.pointer_type(tl.float32))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=1.0)
    u = _update(
        m, v, w, tl.load(bc1s + t), tl.load(bc2s + t), eps, weight_decay, BIAS_CORRECTION, DECOUPLED
    )
    # steps[t] = -lr * ratio[t]; w_scale = 1 - lr wd when decay acts on w directly.
    tl.store(w_ptr + offs, w_scale * w + tl.load(steps + t) * u, mask=mask)


class TritonImpl:
    """``impl="triton"``: the two phases as two fused multi-tensor launches."""

    def __init__(self, block_size: int = 1024) -> None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        self.block_size = block_size
        self._fallback = ForeachImpl()

    def moments(self, b: Bucket) -> tuple[Any, torch.Tensor, torch.Tensor]:
        _check_device(b)
        tensors = (*b.weights, *b.grads, *b.exp_avgs, *b.exp_avg_sqs)
        if b.weights[0].dtype != torch.float32 or not all(t.is_contiguous() for t in tensors):
            # The kernels address flat fp32 memory; the foreach path gives the same result.
            carry, w_sq, u_sq = self._fallback.moments(b)
            return ("foreach", carry), w_sq, u_sq
        h = b.hyper
        dev = b.weights[0].device
        plan = _Plan(b, self.block_size, dev)
        w_part = torch.empty(plan.n_blocks, dtype=torch.float32, device=dev)
        u_part = torch.empty_like(w_part)
        scale = b.grad_scale if b.grad_scale is not None else torch.ones((), device=dev)
        _moments_kernel[(plan.n_blocks,)](
            _addresses(b.weights, dev),
            _addresses(b.grads, dev),
            _addresses(b.exp_avgs, dev),
            _addresses(b.exp_avg_sqs, dev),
            plan.numels,
            plan.bc1,
            plan.bc2,
            plan.block_tensor,
            plan.block_start,
            w_part,
            u_part,
            scale.to(device=dev, dtype=torch.float32),
            h.beta1,
            h.beta2,
            h.beta3,
            1.0 - h.beta2,
            h.eps,
            h.weight_decay,
            BIAS_CORRECTION=h.bias_correction,
            DECOUPLED=h.decoupled_weight_decay,
            CLIP=b.grad_scale is not None,
            BLOCK=self.block_size,
        )
        # Blocks of a tensor are consecutive: a segment sum, in a fixed order.
        w_sq = torch.segment_reduce(w_part, "sum", lengths=plan.blocks_per_tensor)
        u_sq = torch.segment_reduce(u_part, "sum", lengths=plan.blocks_per_tensor)
        return ("triton", plan), w_sq, u_sq

    def apply(self, b: Bucket, carry: Any, ratios: torch.Tensor) -> None:
        kind, data = carry
        if kind == "foreach":
            self._fallback.apply(b, data, ratios)
            return
        plan: _Plan = data
        h = b.hyper
        dev = b.weights[0].device
        _apply_kernel[(plan.n_blocks,)](
            _addresses(b.weights, dev),
            _addresses(b.exp_avgs, dev),
            _addresses(b.exp_avg_sqs, dev),
            plan.numels,
            plan.bc1,
            plan.bc2,
            (ratios * -h.lr).to(device=dev, dtype=torch.float32),
            plan.block_tensor,
            plan.block_start,
            h.eps,
            h.weight_decay,
            b.weight_scale,
            BIAS_CORRECTION=h.bias_correction,
            DECOUPLED=h.decoupled_weight_decay,
            BLOCK=self.block_size,
        )


class _Plan:
    """Block map and per-tensor scalars of one bucket, shared by both launches."""

    def __init__(self, b: Bucket, block: int, dev: torch.device) -> None:
        numels = [w.numel() for w in b.weights]
        # At least one block per tensor, so that every tensor gets its partial sums.
        counts = [max(1, -(-n // block)) for n in numels]
        tensor_of = [t for t, c in enumerate(counts) for _ in range(c)]
        start_of = [i * block for c in counts for i in range(c)]
        self.n_blocks = len(tensor_of)
        self.blocks_per_tensor = torch.tensor(counts, device=dev)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=dev)
        self.block_tensor = torch.tensor(tensor_of, dtype=torch.int32, device=dev)
        self.block_start = torch.tensor(start_of, dtype=torch.int64, device=dev)
        self.bc1 = torch.tensor(b.bias_corrections1, dtype=torch.float32, device=dev)
        self.bc2 = torch.tensor(b.bias_corrections2, dtype=torch.float32, device=dev)


def _addresses(tensors: list[torch.Tensor], dev: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=dev)


def _check_device(b: Bucket) -> None:
    if not b.weights[0].is_cuda and not _interpreted():
        raise ValueError(
            "impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before the first "
            f"import, as the tests do); got tensors on {b.weights[0].device}. On CPU use "
            "impl='compiled' or the default 'foreach'"
        )


def _interpreted() -> bool:
    # What counts is how the kernels were defined (at import), not the variable now.
    return type(_moments_kernel).__name__ == "InterpretedFunction"
