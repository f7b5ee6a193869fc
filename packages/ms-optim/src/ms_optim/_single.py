"""Single-tensor LAMB: one tensor at a time, plain torch ops.

The readable form of the update, used to test the multi-tensor and fused paths.
:mod:`ms_optim._foreach` computes the same values with fewer, fused ops (lerp for
m, the bias corrections folded into eps and one factor), so the two agree to
round-off, not bit for bit.
"""

from __future__ import annotations

import torch

from ms_optim._bucket import Bucket

__all__ = ["SingleTensorImpl"]


class SingleTensorImpl:
    """``impl="single"``."""

    def moments(self, b: Bucket) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        h = b.hyper
        updates: list[torch.Tensor] = []
        w_sq: list[torch.Tensor] = []
        u_sq: list[torch.Tensor] = []
        for i, (w, g, m, v) in enumerate(
            zip(b.weights, b.grads, b.exp_avgs, b.exp_avg_sqs, strict=True)
        ):
            if b.grad_scale is not None:
                g = g * b.grad_scale  # a new tensor: p.grad stays as the user left it
            if not h.decoupled_weight_decay and h.weight_decay != 0.0:
                g = g.add(w, alpha=h.weight_decay)  # L2: decay enters the moments
            m.mul_(h.beta1).add_(g, alpha=h.beta3)
            v.mul_(h.beta2).addcmul_(g, g, value=1.0 - h.beta2)
            if h.bias_correction:
                denom = (v / b.bias_corrections2[i]).sqrt_().add_(h.eps)
                u = (m / b.bias_corrections1[i]).div_(denom)
            else:
                denom = v.sqrt().add_(h.eps)
                u = m / denom
            if h.decoupled_weight_decay and h.weight_decay != 0.0:
                u.add_(w, alpha=h.weight_decay)
            updates.append(u)
            w_sq.append(torch.linalg.vector_norm(w))
            u_sq.append(torch.linalg.vector_norm(u))
        if not updates:
            empty = torch.zeros(0)
            return updates, empty, empty
        return updates, torch.stack(w_sq).square_(), torch.stack(u_sq).square_()

    def apply(self, b: Bucket, carry: list[torch.Tensor], ratios: torch.Tensor) -> None:
        scales = (ratios * -b.hyper.lr).unbind()
        for w, u, s in zip(b.weights, carry, scales, strict=True):
            if b.weight_scale != 1.0:
                w.mul_(b.weight_scale)
            w.add_(u.mul_(s))
