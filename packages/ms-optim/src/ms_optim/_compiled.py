"""LAMB with each tensor's update fused by ``torch.compile``: two passes over memory.

A LAMB step is memory-bound: it must read w, g, m, v and write w, m, v (7 words
per element). Eager code (loop or foreach) makes a pass over memory per
operation, about a dozen in all. Here inductor fuses each phase into one loop
per tensor:

1. read w, g, m, v; reduce sum(w^2) and sum(u^2) of the *new* moments and
   update, writing nothing;
2. read w, g, m, v; recompute the new moments and u (the same expressions, so
   bit-identical); write m, v, w.

11 words of traffic per element against the floor of 7, and no temporary the
size of the model. Writing m and v in phase 1 would be 10 words on paper, but
inductor (torch 2.13, CPU) then splits that phase into a reduction loop and a
store loop, 13 in all. Shapes are dynamic (tensors are viewed flat), so a model
compiles a handful of graphs, not one per tensor; the hyper-parameters come in
as a small tensor, so LR schedules do not recompile.

Only tensors of at least ``min_numel`` elements are worth a compiled call: each
costs about 50 us of dynamo and wrapper overhead plus an OpenMP parallel region
(dynamic shapes parallelise every loop). Small tensors (biases, norms) go to the
foreach path, which packs them into a few tiles. OpenMP regions are also why a
step can take seconds when another process holds a core: libgomp's threads spin
at each region's barrier waiting for a thread that is not scheduled, about 8 ms
per region on a 2-core machine (``OMP_WAIT_POLICY=PASSIVE`` or fewer threads
avoid it); fewer calls means fewer regions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ms_optim._bucket import Bucket
from ms_optim._foreach import ForeachImpl

__all__ = ["MIN_NUMEL", "CompiledImpl"]

#: Tensors smaller than this take the foreach path (see ``CompiledImpl``).
MIN_NUMEL = 1 << 16

# Slots of the constants tensor handed to the compiled functions. 1 - beta comes
# in computed in float64: 1 - 0.999 in fp32 is off by 1.7e-5 relative.
# The weight of g in m (_1MB1) is 1 without grad averaging; _SHRINK multiplies w
# before the step when decay acts on the weights directly.
_B1, _B2, _1MB1, _1MB2, _EPS, _WD_L2, _WD_DEC, _BC1, _BC2, _SCALE, _STEP, _SHRINK = range(12)


def _new_state(
    w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New m, v and the update u; the same expressions in both phases.

    Branch-free: every switch is a value in ``c`` (a factor of 1 or a term of 0,
    which leave the result unchanged), so one graph serves every configuration.
    With switches as Python flags, each combination was a recompile of the same
    function, and a process with a few configurations hit dynamo's recompile limit
    (8), a hard error under ``fullgraph=True``. The extra multiply-adds cost
    nothing in a memory-bound loop.
    """
    g = g * c[_SCALE] + c[_WD_L2] * w  # clipping; L2 decay enters the moments
    m = m * c[_B1] + g * c[_1MB1]
    v = v * c[_B2] + g * g * c[_1MB2]
    u = (m / c[_BC1]) / ((v / c[_BC2]).sqrt() + c[_EPS]) + c[_WD_DEC] * w
    return m, v, u


def _moments(
    w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _, _, u = _new_state(w, g, m, v, c)
    return (w * w).sum(), (u * u).sum()


def _apply(
    w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor
) -> None:
    m_new, v_new, u = _new_state(w, g, m, v, c)
    m.copy_(m_new)
    v.copy_(v_new)
    w.copy_(w * c[_SHRINK] + u * c[_STEP])


class CompiledImpl:
    """``impl="compiled"``: needs a working ``torch.compile`` (on CPU, a C++ compiler).

    Tensors of at least ``min_numel`` elements (and contiguous) get one compiled
    call per phase each; the rest of the bucket (biases, norms: many tensors, few
    elements) goes to the tiled foreach path in one sub-bucket. A compiled call
    costs about 50 us of Python and dynamo overhead and, with dynamic shapes, an
    OpenMP parallel region even for 512 elements; on a model of many small
    tensors that overhead, not memory traffic, was most of the step.
    """

    def __init__(self, min_numel: int = MIN_NUMEL) -> None:
        self.min_numel = min_numel
        self._moments: Callable[..., Any] | None = None
        self._apply: Callable[..., Any] | None = None
        self._fallback = ForeachImpl()

    def _compile(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        if self._moments is None or self._apply is None:
            self._moments = torch.compile(_moments, dynamic=True, fullgraph=True)
            self._apply = torch.compile(_apply, dynamic=True, fullgraph=True)
        return self._moments, self._apply

    def moments(self, b: Bucket) -> tuple[Any, torch.Tensor, torch.Tensor]:
        big: list[int] = []
        rest: list[int] = []
        for i, (w, g, m, v) in enumerate(
            zip(b.weights, b.grads, b.exp_avgs, b.exp_avg_sqs, strict=True)
        ):
            fused = w.numel() >= self.min_numel and all(t.is_contiguous() for t in (w, g, m, v))
            (big if fused else rest).append(i)
        small = _sub_bucket(b, rest)
        fused_b = _sub_bucket(b, big)
        small_carry, small_w, small_u = self._fallback.moments(small)
        rows, big_w, big_u = self._moments_fused(fused_b)
        order = torch.tensor(big + rest, dtype=torch.int64)
        w_sq = torch.empty(len(order), dtype=b.weights[0].dtype) if b.weights else big_w
        u_sq = torch.empty_like(w_sq)
        if b.weights:
            w_sq[order] = torch.cat([big_w.to(w_sq), small_w.to(w_sq)])
            u_sq[order] = torch.cat([big_u.to(u_sq), small_u.to(u_sq)])
        carry = (big, fused_b, rows, rest, small, small_carry)
        return carry, w_sq, u_sq

    def _moments_fused(self, b: Bucket) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        if not b.weights:
            empty = torch.zeros(0)
            return [], empty, empty
        moments, _ = self._compile()
        h = b.hyper
        w0 = b.weights[0]
        dec = h.weight_decay if h.decoupled_weight_decay else 0.0
        l2 = 0.0 if h.decoupled_weight_decay else h.weight_decay
        # One row of constants per tensor, built in one call.
        consts = torch.tensor(
            [
                [
                    h.beta1,
                    h.beta2,
                    h.beta3,
                    1.0 - h.beta2,
                    h.eps,
                    l2,
                    dec,
                    c1,
                    c2,
                    1.0,
                    0.0,
                    b.weight_scale,
                ]
                for c1, c2 in zip(b.bias_corrections1, b.bias_corrections2, strict=True)
            ],
            dtype=w0.dtype,
        ).to(w0.device)
        if b.grad_scale is not None:
            consts[:, _SCALE] = b.grad_scale
        # Separate tensors, not row views: views at varying storage offsets made
        # dynamo's guards cost milliseconds per call (torch 2.13).
        rows = [r.clone() for r in consts.unbind(0)]
        w_norms: list[torch.Tensor] = []
        u_norms: list[torch.Tensor] = []
        for w, g, m, v, c in zip(b.weights, b.grads, b.exp_avgs, b.exp_avg_sqs, rows, strict=True):
            ws, us = moments(w.view(-1), g.view(-1), m.view(-1), v.view(-1), c)
            w_norms.append(ws)
            u_norms.append(us)
        return rows, torch.stack(w_norms), torch.stack(u_norms)

    def apply(self, b: Bucket, carry: Any, ratios: torch.Tensor) -> None:
        big, fused_b, rows, rest, small, small_carry = carry
        if rest:
            self._fallback.apply(small, small_carry, ratios[rest])
        if not big:
            return
        _, apply = self._compile()
        steps = (ratios[big] * -b.hyper.lr).tolist()
        for w, g, m, v, c, step in zip(
            fused_b.weights,
            fused_b.grads,
            fused_b.exp_avgs,
            fused_b.exp_avg_sqs,
            rows,
            steps,
            strict=True,
        ):
            c[_STEP] = step
            apply(w.view(-1), g.view(-1), m.view(-1), v.view(-1), c)


def _sub_bucket(b: Bucket, index: list[int]) -> Bucket:
    return Bucket(
        b.hyper,
        [b.weights[i] for i in index],
        [b.grads[i] for i in index],
        [b.exp_avgs[i] for i in index],
        [b.exp_avg_sqs[i] for i in index],
        [b.bias_corrections1[i] for i in index],
        [b.bias_corrections2[i] for i in index],
        b.grad_scale,
        b.weight_scale,
    )
