"""The per-group hyper-parameters of LAMB, validated once per step.

Param groups stay plain dicts (the ``torch.optim`` contract: LR schedulers write
``group["lr"]``, checkpoints store the dicts); this module turns one into a typed,
checked :class:`GroupHyper` so that every implementation reads the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["HYPER_DEFAULTS", "NEW_IN_FORMAT_2", "GroupHyper", "check_bounds", "read_group"]

StepCount = Literal["param", "group"]
_STEP_COUNTS = ("param", "group")

# Defaults of every per-group key; Lamb's constructor arguments override them.
HYPER_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-6,
    "weight_decay": 0.01,
    "bias_correction": True,
    "decoupled_weight_decay": True,
    "layer_adaptation": True,
    "weight_norm_bounds": None,
    "trust_ratio_bounds": None,
    "max_grad_norm": None,
    "grad_averaging": True,
    "step_size_bias_correction": False,
    "decay_in_update": True,
    "step_count": "param",
}

#: Keys added in ms-optim 0.2.0, with the value that reproduces 0.1.0. A
#: state_dict whose groups all hold these values is written as format 1, which
#: 0.1.0 can load and honour; any other value needs format 2.
NEW_IN_FORMAT_2: dict[str, Any] = {
    "grad_averaging": True,
    "step_size_bias_correction": False,
    "decay_in_update": True,
    "step_count": "param",
}


@dataclass(frozen=True)
class GroupHyper:
    """One param group's hyper-parameters, checked."""

    #: Learning rate, >= 0.
    lr: float
    #: Decay rates of the first and second moments, each in [0, 1).
    beta1: float
    beta2: float
    #: Added to sqrt(v^) in the denominator, >= 0.
    eps: float
    #: Weight-decay factor lambda, >= 0.
    weight_decay: float
    #: Divide the moments by (1 - beta^t) (Algorithm 2's m^ and v^).
    bias_correction: bool
    #: True: u = r + lambda w (the paper, AdamW style). False: L2, g += lambda w
    #: before the moments, and u = r.
    decoupled_weight_decay: bool
    #: False: trust ratio fixed at 1, a plain Adam(W) step (for biases and norms).
    layer_adaptation: bool
    #: The paper's phi: clamp ||w|| into [lo, hi] before the ratio; None: phi(z) = z.
    weight_norm_bounds: tuple[float, float] | None
    #: Clamp the ratio phi(||w||) / ||u|| into [lo, hi] (DeepSpeed); None: no clamp.
    trust_ratio_bounds: tuple[float, float] | None
    #: Scale gradients by max_grad_norm / max(global norm, max_grad_norm) before
    #: the update (NVLAMB); None: no clipping.
    max_grad_norm: float | None
    #: False: m = b1 m + g, without the (1 - b1) factor (Apex / timm
    #: ``grad_averaging=False``); the bias correction still divides by 1 - b1^t.
    grad_averaging: bool = True
    #: With bias_correction: build u from the raw moments, m / (sqrt(v) + eps), and
    #: scale the step by sqrt(1 - b2^t) / (1 - b1^t) after the trust ratio
    #: (DeepSpeed ``FusedLamb``, torch-optimizer ``debias=True``). No effect without
    #: bias_correction.
    step_size_bias_correction: bool = False
    #: False: decoupled decay acts on the weights directly, w *= 1 - lr wd, before
    #: ||w|| is taken and outside u and the trust ratio (timm ``decoupled_decay``).
    #: Needs decoupled_weight_decay.
    decay_in_update: bool = True
    #: "param": t counts the steps in which this parameter had a gradient.
    #: "group": t counts the optimizer's steps, one per ``step()`` call, for every
    #: parameter of the group, with or without a gradient (Apex, timm).
    step_count: StepCount = "param"

    @property
    def beta3(self) -> float:
        """The weight of g in m: 1 - b1, or 1 without grad averaging."""
        return 1.0 - self.beta1 if self.grad_averaging else 1.0


def read_group(group: dict[str, Any], where: str = "") -> GroupHyper:
    """Check ``group``'s hyper-parameters.

    Errors name the key: ``betas[0]`` for constructor arguments (``where=""``),
    ``param_groups[1]['betas'][0]`` with ``where="param_groups[1]"``.
    """

    def name(key: str) -> str:
        return f"{where}[{key!r}]" if where else key

    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name('betas')} must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        _real(b, f"{name('betas')}[{i}]")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name('betas')}[{i}] must be in [0, 1), got {b!r}")
    for key in ("lr", "eps", "weight_decay"):
        value = _real(group[key], name(key))
        if not value >= 0.0 or math.isinf(value):
            raise ValueError(f"{name(key)} must be a finite number >= 0, got {value!r}")
    for key in (
        "bias_correction",
        "decoupled_weight_decay",
        "layer_adaptation",
        "grad_averaging",
        "step_size_bias_correction",
        "decay_in_update",
    ):
        if not isinstance(group[key], bool):
            raise TypeError(f"{name(key)} must be a bool, got {group[key]!r}")
    if not group["decay_in_update"] and not group["decoupled_weight_decay"]:
        raise ValueError(
            f"{name('decay_in_update')}=False applies decoupled decay to the weights "
            f"directly; it needs {name('decoupled_weight_decay')}=True, got False (L2)"
        )
    step_count = group["step_count"]
    if step_count not in _STEP_COUNTS:
        raise ValueError(f"{name('step_count')} must be one of {_STEP_COUNTS}, got {step_count!r}")
    max_norm = group["max_grad_norm"]
    if max_norm is not None:
        _real(max_norm, name("max_grad_norm"))
        if not max_norm > 0.0:
            raise ValueError(f"{name('max_grad_norm')} must be > 0 or None, got {max_norm!r}")
    return GroupHyper(
        lr=float(group["lr"]),
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        bias_correction=group["bias_correction"],
        decoupled_weight_decay=group["decoupled_weight_decay"],
        layer_adaptation=group["layer_adaptation"],
        weight_norm_bounds=check_bounds(group["weight_norm_bounds"], name("weight_norm_bounds")),
        trust_ratio_bounds=check_bounds(group["trust_ratio_bounds"], name("trust_ratio_bounds")),
        max_grad_norm=None if max_norm is None else float(max_norm),
        grad_averaging=group["grad_averaging"],
        step_size_bias_correction=group["step_size_bias_correction"],
        decay_in_update=group["decay_in_update"],
        step_count=step_count,
    )


def check_bounds(value: Any, name: str) -> tuple[float, float] | None:
    """``None`` or a pair ``0 <= lo <= hi`` (``hi`` may be ``inf``)."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be None or a pair (lo, hi), got {value!r}")
    lo = _real(value[0], f"{name}[0]")
    hi = _real(value[1], f"{name}[1]")
    if not 0.0 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 0 <= lo <= hi, got {tuple(value)!r}")
    return (lo, hi)


def _real(value: Any, name: str) -> float:
    # bool is an int subclass; True as a learning rate is a bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return float(value)
