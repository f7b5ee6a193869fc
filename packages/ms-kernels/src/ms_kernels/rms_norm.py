"""Fused RMSNorm over the last dimension, with an optional fused residual add.

Three layers, as in Liger-Kernel: the Triton kernels and their autograd Function
are shared with LayerNorm (``ms_kernels.layer_norm``, ``IS_RMS=True``: no centring,
no bias); the functional ``rms_norm`` / ``add_rms_norm``; the ``RMSNorm`` module, a
drop-in for ``torch.nn.RMSNorm``. The torch reference with identical semantics is
``rms_norm_reference`` / ``add_rms_norm_reference`` (``F.rms_norm``, after
``x + residual`` rounded to the input dtype); the ``torch`` backend runs it.

``eps=None`` means ``torch.finfo(x.dtype).eps``, as ``torch.nn.RMSNorm`` does.
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
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


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
    """The torch reference of ``add_rms_norm``: ``s = x + residual`` in x's dtype."""
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

    ``s`` is rounded to x's dtype before it is normalized, as the reference does.
    Gradients reach both ``x`` and ``residual``, including those flowing into ``s``.
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
