"""The usual LAMB param groups of a model: biases and norm weights left alone.

Weight decay and the trust ratio are meant for weight matrices. A bias or a
LayerNorm gain near zero would be decayed toward zero, and its tiny ||w|| would
give a tiny trust ratio that freezes it (the reason Apex and TF-Addons exclude
them, by weight decay 0 or by an explicit list).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["lamb_param_groups"]

# Modules whose parameters are normalisation gains and shifts.
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)


def lamb_param_groups(
    model: nn.Module,
    weight_decay: float = 0.01,
    *,
    exclude_types: tuple[type[nn.Module], ...] = (),
) -> list[dict[str, Any]]:
    """Two param groups for :class:`ms_optim.Lamb` (or any optimizer).

    The first holds the weights (``weight_decay`` and layer adaptation on); the
    second holds biases, parameters of normalisation modules (and of
    ``exclude_types``), and any parameter with fewer than 2 dimensions, which
    catches hand-written norm gains (``weight_decay=0.0``,
    ``layer_adaptation=False``). Frozen parameters (``requires_grad=False``) are
    left out; shared parameters appear once. Empty groups are dropped.
    """
    if not isinstance(weight_decay, (int, float)) or isinstance(weight_decay, bool):
        raise TypeError(f"weight_decay must be a number, got {weight_decay!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    excluded = _NORM_TYPES + tuple(exclude_types)
    decay: list[torch.Tensor] = []
    plain: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, excluded) or name.endswith("bias") or p.dim() < 2:
                plain.append(p)
            else:
                decay.append(p)
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": float(weight_decay)})
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0, "layer_adaptation": False})
    return groups
