"""Shared checks for the kernel tests, reached through fixtures (importlib mode).

The norm tests' shared scaffold is a module of its own, _norm_cases.py.

Every kernel result is judged against a float64 reference computed from the same
inputs, beside the same computation done by torch in the low-precision dtype: the
kernel may be at most about twice as far from the reference as torch is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# test_layer_norm.py and test_rms_norm.py import their shared scaffold, _norm_cases.py,
# by name; in importlib mode the tests folder is not on sys.path by itself.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Error allowed relative to the reference's scale, per dtype, whatever torch does.
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
# Slack on top of 2x torch's own error, for when torch happens to land very close.
_SLACK = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}

Checker = Callable[..., None]


def _check_close(
    name: str,
    got: torch.Tensor,
    torch_lowp: torch.Tensor,
    ref: torch.Tensor,
    *,
    is_torch: bool = False,
    scale: float | None = None,
) -> None:
    """``got`` (a kernel result) vs ``ref`` (float64), bounded by torch's own error.

    ``is_torch``: ``got`` is the torch backend itself; only the tolerance applies.
    ``scale``: the size errors are relative to; by default ``1 + max |ref|``. Input
    gradients pass the size of the terms that cancel in them (``|dy| |w| rstd``), as
    near-cancelling gradients are small while their rounding error is not.
    """
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == torch_lowp.dtype, f"{name}: dtype {got.dtype} != {torch_lowp.dtype}"
    if ref.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    if scale is None:
        scale = 1.0 + ref.abs().max().item()
    err = (got.double() - ref).abs().max().item()
    torch_err = (torch_lowp.double() - ref).abs().max().item()
    tol = _TOLERANCE[got.dtype] * scale
    assert err <= tol, f"{name}: max error {err:.3g} > tolerance {tol:.3g}"
    if is_torch:
        return
    bound = 2.0 * torch_err + _SLACK[got.dtype] * scale
    assert err <= bound, f"{name}: max error {err:.3g} > 2 x torch's {torch_err:.3g} + slack"


@pytest.fixture(scope="session")
def check_close() -> Checker:
    """``check_close(name, got, torch_lowp, ref64, *, is_torch, scale)``: see ``_check_close``."""
    return _check_close
