"""An independent float64 reference of LAMB (Algorithm 2, arXiv 1904.00962).

Written from the paper, one parameter at a time, with Python floats for the
scalars; it shares no code with ms_optim. Tests reach it through the
``reference`` fixture (pytest's importlib mode makes sibling imports awkward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
import torch


@dataclass(frozen=True)
class RefConfig:
    """One param group's switches, named as in the paper."""

    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    bias_correction: bool = True
    decoupled: bool = True
    adaptation: bool = True
    phi_bounds: tuple[float, float] | None = None  # clamp of ||w||
    ratio_bounds: tuple[float, float] | None = None  # clamp of the trust ratio
    max_grad_norm: float | None = None

    def lamb_kwargs(self) -> dict[str, object]:
        """The same switches as ``ms_optim.Lamb`` keyword arguments."""
        return {
            "lr": self.lr,
            "betas": (self.beta1, self.beta2),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "bias_correction": self.bias_correction,
            "decoupled_weight_decay": self.decoupled,
            "layer_adaptation": self.adaptation,
            "weight_norm_bounds": self.phi_bounds,
            "trust_ratio_bounds": self.ratio_bounds,
            "max_grad_norm": self.max_grad_norm,
        }

    def with_(self, **changes: object) -> RefConfig:
        return replace(self, **changes)  # type: ignore[arg-type]


def reference_lamb(
    weights: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor | None]],
    configs: Sequence[RefConfig],
    group_of: Sequence[int],
    lrs: Sequence[Sequence[float]] | None = None,
) -> list[torch.Tensor]:
    """Run LAMB in float64; return the final weights.

    ``grads[s][i]`` is parameter i's gradient at step s (None: no gradient, the
    parameter skips the step and its step count does not advance). ``lrs[s][k]``
    overrides group k's learning rate at step s.
    """
    w = [x.detach().double().clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    t = [0] * len(w)
    for s, step_grads in enumerate(grads):
        present = [g.double() if g is not None else None for g in step_grads]
        total = math.sqrt(sum(float((g * g).sum()) for g in present if g is not None))
        for i, g in enumerate(present):
            if g is None:
                continue
            c = configs[group_of[i]]
            lr = c.lr if lrs is None else lrs[s][group_of[i]]
            if c.max_grad_norm is not None:
                g = g * (c.max_grad_norm / max(total, c.max_grad_norm))
            if not c.decoupled:
                g = g + c.weight_decay * w[i]
            t[i] += 1
            m[i] = c.beta1 * m[i] + (1 - c.beta1) * g
            v[i] = c.beta2 * v[i] + (1 - c.beta2) * g * g
            m_hat, v_hat = m[i], v[i]
            if c.bias_correction:
                m_hat = m_hat / (1 - c.beta1 ** t[i])
                v_hat = v_hat / (1 - c.beta2 ** t[i])
            u = m_hat / (v_hat.sqrt() + c.eps)
            if c.decoupled:
                u = u + c.weight_decay * w[i]
            w_norm = float(w[i].norm())
            u_norm = float(u.norm())
            ratio = 1.0
            if c.adaptation and w_norm > 0 and u_norm > 0:
                phi = w_norm
                if c.phi_bounds is not None:
                    phi = min(max(phi, c.phi_bounds[0]), c.phi_bounds[1])
                ratio = phi / u_norm
                if c.ratio_bounds is not None:
                    ratio = min(max(ratio, c.ratio_bounds[0]), c.ratio_bounds[1])
            w[i] = w[i] - lr * ratio * u
    return w


@pytest.fixture(scope="session")
def reference() -> object:
    return reference_lamb


@pytest.fixture(scope="session")
def ref_config() -> type[RefConfig]:
    return RefConfig
