"""Bias + GeLU, fused: y = gelu(x + bias), forward and backward in one pass each.

MegaScale fuses the bias add and the activation of the MLP's first GEMM, which
otherwise take several kernels (and several round trips through memory) each way.

Three layers, as everywhere in ms-kernels: the Triton kernels with their
``torch.autograd.Function`` (``ms_kernels._bias_gelu_triton``, imported only when
the Triton backend runs); :func:`bias_gelu`, the functional API; and
:class:`BiasGeLU`, a module holding the bias. :func:`bias_gelu_reference` is the
torch path with identical semantics (``torch.nn.functional.gelu(x + bias)``).

Both GeLU forms are supported: the exact one (``approximate="none"``, erf) and the
tanh approximation (``approximate="tanh"``). The kernels compute in fp32 whatever
the storage dtype, and reduce the bias gradient without atomics (bitwise
reproducible).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ms_kernels._backend import Backend, resolve_backend

__all__ = ["BiasGeLU", "bias_gelu", "bias_gelu_reference"]

Approximate = Literal["none", "tanh"]
_APPROXIMATE = ("none", "tanh")
_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def bias_gelu_reference(
    x: torch.Tensor, bias: torch.Tensor, approximate: Approximate = "none"
) -> torch.Tensor:
    """The torch path: ``gelu(x + bias)``, the semantics the kernels reproduce."""
    return nn.functional.gelu(x + bias, approximate=approximate)


def _check(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_TYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a floating-point tensor, got {got}")
    if not isinstance(bias, torch.Tensor) or bias.dtype != x.dtype:
        got = bias.dtype if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise TypeError(f"bias must be a tensor of x's dtype {x.dtype}, got {got}")
    if x.dim() < 1 or bias.shape != (x.shape[-1],):
        raise ValueError(
            f"bias must have shape (x.shape[-1],) = ({x.shape[-1] if x.dim() else '?'},), "
            f"got {tuple(bias.shape)} for x of shape {tuple(x.shape)}"
        )
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be one of {_APPROXIMATE}, got {approximate!r}")
    if bias.device != x.device:
        raise ValueError(f"bias must be on x's device {x.device}, got {bias.device}")


def bias_gelu(
    x: torch.Tensor,
    bias: torch.Tensor,
    approximate: Approximate = "none",
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``gelu(x + bias)`` over the last dimension of ``x``, fused on the Triton backend.

    Args:
        x: (..., N) floating-point input.
        bias: (N,) bias of ``x``'s dtype.
        approximate: ``"none"`` for the exact (erf) GeLU, ``"tanh"`` for the tanh
            approximation, as in ``torch.nn.functional.gelu``.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"triton"`` or ``"torch"``.
    """
    _check(x, bias, approximate)
    if resolve_backend(backend, x, bias) == "torch":
        return bias_gelu_reference(x, bias, approximate)
    from ms_kernels._bias_gelu_triton import run_bias_gelu  # only when Triton runs

    return run_bias_gelu(x, bias, approximate)


class BiasGeLU(nn.Module):
    """Holds the bias of a preceding bias-free linear layer and applies gelu(x + bias).

    ``nn.Sequential(nn.Linear(d, 4 * d, bias=False), BiasGeLU(4 * d))`` computes what
    ``nn.Sequential(nn.Linear(d, 4 * d), nn.GELU())`` does, with the bias add and the
    activation in one kernel each way.
    """

    def __init__(
        self,
        num_features: int,
        approximate: Approximate = "none",
        *,
        backend: Backend = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be an int >= 1, got {num_features!r}")
        if approximate not in _APPROXIMATE:
            raise ValueError(f"approximate must be one of {_APPROXIMATE}, got {approximate!r}")
        self.num_features = num_features
        self.approximate: Approximate = approximate
        self.backend: Backend = backend
        self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, self.bias, self.approximate, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.num_features}, approximate={self.approximate!r}, backend={self.backend!r}"
