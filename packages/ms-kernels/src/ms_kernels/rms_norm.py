"""Fused RMSNorm over the last dimension, with an optional fused residual add.

Three layers, as in Liger-Kernel: the Triton kernels and their autograd Function
are shared with LayerNorm (``ms_kernels.layer_norm``, ``IS_RMS=True``: no centring,
no bias); the functional ``rms_norm`` / ``add_rms_norm``; the ``RMSNorm`` module, a
drop-in for ``torch.nn.RMSNorm``. The torch reference with identical semantics is
``rms_norm_reference`` / ``add_rms_norm_reference`` (``F.rms_norm`` of
``x + residual``, in the dtype torch promotes the two to); the ``torch`` backend runs it.

``eps=None`` means the machine epsilon of the type torch computes in (its "opmath"
type), as ``torch.nn.RMSNorm`` and ``F.rms_norm`` do: ``torch.finfo(torch.float32).eps``
for float16, bfloat16 and float32 inputs, ``torch.finfo(torch.float64).eps`` for
float64. Not the input dtype's own epsilon: float16's (9.8e-4) and bfloat16's
(7.8e-3) would swamp the mean square of small activations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ms_kernels._backend import Backend, resolve_backend
from ms_kernels.layer_norm import (
    _check_param,
    _check_residual,
    _normalized_size,
    _run_triton,
)

__all__ = [
    "RMSNorm",
    "add_rms_norm",
    "add_rms_norm_reference",
    "rms_norm",
    "rms_norm_reference",
]


def _eps(x: torch.Tensor, eps: float | None) -> float:
    """The epsilon ``F.rms_norm`` uses for ``x``: see the module docstring."""
    if eps is not None:
        return float(eps)
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.finfo(opmath).eps


def rms_norm_reference(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """The torch reference: ``torch.nn.functional.rms_norm``."""
    return F.rms_norm(x, tuple(normalized_shape), weight, eps)


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``add_rms_norm``: ``s = x + residual``, then ``rms_norm(s)``."""
    s = x + residual
    return F.rms_norm(s, tuple(normalized_shape), weight, eps), s


def rms_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """RMSNorm over the trailing ``normalized_shape`` dims, as ``F.rms_norm``.

    ``backend``: ``"triton"`` (fused kernels; CUDA, or the interpreter), ``"torch"``
    (``rms_norm_reference``) or ``"auto"`` (Triton for CUDA tensors).
    """
    n = _normalized_size(x, normalized_shape)
    _check_param("weight", weight, normalized_shape)
    params = [weight] if weight is not None else []
    if resolve_backend(backend, x, *params) == "torch":
        return rms_norm_reference(x, normalized_shape, weight, eps)
    return _run_triton(x, None, weight, None, n, _eps(x, eps), is_rms=True)[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``s = x + residual; y = rms_norm(s)``; returns ``(y, s)``.

    ``s`` has the dtype torch promotes ``x`` and ``residual`` to (``torch.promote_types``:
    float16 + float16 is float16, bfloat16 + float32 is float32), on both backends, and
    is rounded to it before it is normalized; ``y`` has that dtype too. Gradients reach
    both ``x`` and ``residual``, each in its own dtype, including those flowing into ``s``.
    """
    n = _normalized_size(x, normalized_shape)
    _check_residual(x, residual)
    _check_param("weight", weight, normalized_shape)
    params = [weight] if weight is not None else []
    if resolve_backend(backend, x, residual, *params) == "torch":
        return add_rms_norm_reference(x, residual, normalized_shape, weight, eps)
    y, s = _run_triton(x, residual, weight, None, n, _eps(x, eps), is_rms=True)
    return y, s


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in for ``torch.nn.RMSNorm`` (same arguments, parameter and state_dict key).

    ``backend`` picks the implementation per call, as in ``rms_norm``.
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        backend: Backend = "auto",
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        resolve_backend(backend)  # validates the name now rather than on first call
        self.backend: Backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"
