"""What every implementation of the LAMB update receives, and what they share.

A step is split in two phases so that the trust ratios can wait for norms that
other tensors (or other ranks) complete:

1. ``moments``: update m and v, form the update u, return sum(w^2) and sum(u^2)
   per tensor;
2. ``apply``: w = weight_scale * w - lr * ratio * u, once the ratios are known
   (``ratio``: the trust ratio, times the step-size bias correction if any).

Between the phases :mod:`ms_optim._lamb` sums the squares per logical parameter
(one all-reduce when sharded) and calls :func:`trust_ratios`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ms_optim._hyper import GroupHyper

__all__ = ["Bucket", "LambImpl", "trust_ratios"]


@dataclass
class Bucket:
    """Tensors of one param group that share device and compute dtype."""

    hyper: GroupHyper
    #: Weights in the compute dtype, updated in place: the parameter itself, its
    #: fp32 master copy, or an fp32 scratch copy written back afterwards.
    weights: list[torch.Tensor]
    #: Gradients in the compute dtype. Possibly the user's ``p.grad``: read only.
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    #: 1 - beta^t per tensor (1.0 when bias correction is off); steps may differ
    #: between tensors, since a tensor without a gradient skips a step.
    bias_corrections1: list[float]
    bias_corrections2: list[float]
    #: Global-norm clipping factor (0-d tensor), or None when the group does not clip.
    grad_scale: torch.Tensor | None
    #: Factor on w before the step, 1 - lr wd when decay acts on the weights
    #: directly (``decay_in_update=False``); 1.0 otherwise. ``apply`` computes
    #: w = weight_scale w - lr ratio u; ``hyper.weight_decay`` is then 0, so that u
    #: carries no decay term.
    weight_scale: float = 1.0


class LambImpl(Protocol):
    """One way of computing the two phases; all give Algorithm 2's result."""

    def moments(self, b: Bucket) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Update the moments; return (carry for ``apply``, sum w^2, sum u^2) per tensor."""
        ...

    def apply(self, b: Bucket, carry: Any, ratios: torch.Tensor) -> None:
        """w_i = weight_scale w_i - lr ratios[i] u_i for every tensor i of the bucket."""
        ...


def trust_ratios(w_norm: torch.Tensor, u_norm: torch.Tensor, h: GroupHyper) -> torch.Tensor:
    """phi(||w||) / ||u||, clamped as configured; 1 where either norm is 0 (Algorithm 2)."""
    if not h.layer_adaptation:
        return torch.ones_like(w_norm)
    phi = w_norm if h.weight_norm_bounds is None else w_norm.clamp(*h.weight_norm_bounds)
    ratio = phi / u_norm
    if h.trust_ratio_bounds is not None:
        ratio = ratio.clamp(*h.trust_ratio_bounds)
    # The zero test is on the raw norms: a freshly zero-initialised weight must get
    # ratio 1 even when phi's lower bound would make phi(0) positive.
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))
