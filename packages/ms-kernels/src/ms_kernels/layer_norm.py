"""Fused LayerNorm over the last dimension, with an optional fused residual add.

Three layers, as in Liger-Kernel: Triton kernels wrapped in a
``torch.autograd.Function`` (``ms_kernels._norm_triton``, imported only when the
Triton backend runs); the functional ``layer_norm`` / ``add_layer_norm``;
the ``LayerNorm`` module, a drop-in for ``torch.nn.LayerNorm``. The torch reference
with identical semantics is ``layer_norm_reference`` / ``add_layer_norm_reference``
(``F.layer_norm`` of ``x + residual``, in the dtype torch promotes the two to); the ``torch``
backend runs it.

The kernels also serve ``ms_kernels.rms_norm``: RMSNorm is LayerNorm without the
centring and the bias, so both share one forward and one backward. They compute in
fp32 and reduce the weight and bias gradients without atomics (bitwise reproducible).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ms_kernels._backend import Backend, resolve_backend

__all__ = [
    "MAX_HIDDEN",
    "LayerNorm",
    "add_layer_norm",
    "add_layer_norm_reference",
    "layer_norm",
    "layer_norm_reference",
]

MAX_HIDDEN = 65536
"""Largest normalized size the Triton kernels take (one block per row)."""


def _normalized_size(x: torch.Tensor, normalized_shape: Sequence[int]) -> int:
    """Checks ``x`` against ``normalized_shape``; returns the flattened size."""
    shape = tuple(normalized_shape)
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if len(shape) == 0 or tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(
            f"normalized_shape must be a non-empty suffix of x's shape {tuple(x.shape)}, "
            f"got {shape}"
        )
    return math.prod(shape)


def _check_param(name: str, param: torch.Tensor | None, normalized_shape: Sequence[int]) -> None:
    if param is None:
        return
    if not param.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {param.dtype}")
    if tuple(param.shape) != tuple(normalized_shape):
        raise ValueError(
            f"{name} must have shape normalized_shape={tuple(normalized_shape)}, "
            f"got {tuple(param.shape)}"
        )


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if not residual.dtype.is_floating_point:
        raise TypeError(f"residual must be a floating-point tensor, got dtype {residual.dtype}")
    if residual.shape != x.shape:
        raise ValueError(
            f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )


def _check_triton_size(n: int) -> None:
    if n > MAX_HIDDEN:
        raise ValueError(
            f"normalized_shape must have at most {MAX_HIDDEN} elements for backend='triton', "
            f"got {n}; use backend='torch'"
        )


def _run_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    eps: float,
    is_rms: bool,
) -> tuple[torch.Tensor, ...]:
    """The Triton kernels (``ms_kernels._norm_triton``), imported only when used."""
    _check_triton_size(n)
    from ms_kernels._norm_triton import run_norm

    return run_norm(x, residual, weight, bias, n, eps, is_rms)


def layer_norm_reference(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """The torch reference: ``torch.nn.functional.layer_norm``."""
    return F.layer_norm(x, tuple(normalized_shape), weight, bias, eps)


def add_layer_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``add_layer_norm``: ``s = x + residual``, then ``layer_norm(s)``."""
    s = x + residual
    return F.layer_norm(s, tuple(normalized_shape), weight, bias, eps), s


def layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims, as ``F.layer_norm``.

    ``backend``: ``"triton"`` (fused kernels; CUDA, or the interpreter), ``"torch"``
    (``layer_norm_reference``) or ``"auto"`` (Triton for CUDA tensors).
    """
    n = _normalized_size(x, normalized_shape)
    _check_param("weight", weight, normalized_shape)
    _check_param("bias", bias, normalized_shape)
    params = [t for t in (weight, bias) if t is not None]
    if resolve_backend(backend, x, *params) == "torch":
        return layer_norm_reference(x, normalized_shape, weight, bias, eps)
    return _run_triton(x, None, weight, bias, n, eps, is_rms=False)[0]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``s = x + residual; y = layer_norm(s)``; returns ``(y, s)``.

    ``s`` has the dtype torch promotes ``x`` and ``residual`` to (``torch.promote_types``:
    float16 + float16 is float16, bfloat16 + float32 is float32), on both backends, and
    is rounded to it before it is normalized; ``y`` has that dtype too. Gradients reach
    both ``x`` and ``residual``, each in its own dtype, including those flowing into ``s``.
    """
    n = _normalized_size(x, normalized_shape)
    _check_residual(x, residual)
    _check_param("weight", weight, normalized_shape)
    _check_param("bias", bias, normalized_shape)
    params = [t for t in (weight, bias) if t is not None]
    if resolve_backend(backend, x, residual, *params) == "torch":
        return add_layer_norm_reference(x, residual, normalized_shape, weight, bias, eps)
    y, s = _run_triton(x, residual, weight, bias, n, eps, is_rms=False)
    return y, s


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for ``torch.nn.LayerNorm`` (same arguments, parameters and state_dict keys).

    ``backend`` picks the implementation per call, as in ``layer_norm``.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        backend: Backend = "auto",
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        resolve_backend(backend)  # validates the name now rather than on first call
        self.backend: Backend = backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps, backend=self.backend
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"
