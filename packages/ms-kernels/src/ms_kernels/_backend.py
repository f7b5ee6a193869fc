"""Choosing between the Triton kernels and the torch reference paths.

The choice is explicit (a ``backend`` argument) and made per call from the
tensors' device; nothing is switched at import time. ``TRITON_INTERPRET`` is
Triton's own switch: with it set, Triton kernels also run on CPU tensors (slowly;
that is how the test suite checks them on machines without a GPU).
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

__all__ = ["Backend", "resolve_backend", "triton_available"]

Backend = Literal["auto", "triton", "torch"]
_BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package imports here."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> Literal["triton", "torch"]:
    """The backend that runs an op on ``tensors``.

    ``auto`` picks Triton for CUDA tensors when triton is installed, else torch.
    An explicit ``triton`` that cannot run raises instead of falling back.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(
                "backend='triton' needs the triton package, which is not installed: "
                "pip install 'triton>=3.0' (Linux)"
            )
        if not (on_cuda or _interpreting()):
            devices = sorted({str(t.device) for t in tensors})
            raise ValueError(
                "backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before the "
                f"kernels are defined, for testing), got tensors on {devices}"
            )
        return "triton"
    return "torch"
