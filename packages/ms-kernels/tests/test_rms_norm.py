"""ms_kernels.rms_norm against a float64 reference, both backends, every gradient.

The checks shared with test_layer_norm.py live in _norm_cases.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _norm_cases import (
    RMS,
    RMS_DEFAULT_EPS,
    cases,
    check_case,
    check_cuda_against_reference,
    check_deterministic,
    check_every_hidden_size,
    check_mixed_dtype_residual,
    check_multi_dim_normalized_shape,
    check_residual_gradient_includes_the_sum_output,
    check_zero_rows,
    fixed_case,
    inputs,
    run,
    scales,
)
from hypothesis import given, settings

from ms_kernels.rms_norm import RMSNorm, add_rms_norm, rms_norm


@pytest.mark.slow
@settings(max_examples=25)
@given(case=cases(RMS))
def test_matches_float64_reference(check_close: Any, case: dict[str, Any]) -> None:
    check_case(check_close, RMS, case)


@pytest.mark.parametrize("residual", [False, True])
def test_every_hidden_size_and_gradient(check_close: Any, residual: bool) -> None:
    check_every_hidden_size(check_close, RMS, residual)


def _check_small_activations(check_close: Any, dtype: torch.dtype, device: str) -> None:
    """eps=None on activations of size 1e-3, whose mean square (1e-6) is far below
    float16's epsilon (9.8e-4): with that eps instead of float32's, y shrinks ~30x."""
    for residual in (False, True):
        case = fixed_case(RMS, lead=(4,), n=64, dtype=dtype, residual=residual, eps=None)
        tensors = {
            k: v.to(device) if v is not None else None for k, v in inputs(case, scale=1e-3).items()
        }
        errs = scales(RMS, tensors, case)
        ref = run(RMS, tensors, case, "reference", torch.float64)
        lowp = run(RMS, tensors, case, "torch", dtype)
        got = run(RMS, tensors, case, "auto" if device == "cuda" else "triton", dtype)
        for name in ref:
            check_close(f"triton {name}", got[name], lowp[name], ref[name], scale=errs.get(name))
            check_close(f"torch {name}", lowp[name], lowp[name], ref[name], is_torch=True)
    # The module against torch's own, both with eps=None.
    ref_mod = torch.nn.RMSNorm(64, device=device, dtype=dtype)
    mod = RMSNorm(64, device=device, dtype=dtype, backend="auto" if device == "cuda" else "triton")
    x = (1e-3 * torch.randn(4, 64, generator=torch.Generator().manual_seed(1))).to(device, dtype)
    want = ref_mod(x)
    x64 = x.double()
    exact = x64 * x64.pow(2).mean(-1, keepdim=True).add(RMS_DEFAULT_EPS).rsqrt()
    check_close("module", mod(x), want, exact)
    torch.testing.assert_close(mod(x), want, atol=1e-2, rtol=1e-2)


def test_eps_none_is_torchs_on_small_float16_activations(check_close: Any) -> None:
    _check_small_activations(check_close, torch.float16, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_eps_none_is_torchs_on_small_activations_on_cuda(
    check_close: Any, dtype: torch.dtype
) -> None:
    # On CUDA ``auto`` picks the Triton kernels.
    _check_small_activations(check_close, dtype, "cuda")


@pytest.mark.parametrize(
    ("dtype", "residual_dtype"), [(torch.float16, torch.float32), (torch.float32, torch.float16)]
)
def test_mixed_dtype_residual_promotes_on_both_backends(
    check_close: Any, dtype: torch.dtype, residual_dtype: torch.dtype
) -> None:
    check_mixed_dtype_residual(check_close, RMS, dtype, residual_dtype)


def test_residual_gradient_includes_the_sum_output() -> None:
    check_residual_gradient_includes_the_sum_output(RMS)


def test_zero_rows() -> None:
    check_zero_rows(RMS, (3, 0))


def test_deterministic() -> None:
    check_deterministic(RMS)


def test_multi_dim_normalized_shape() -> None:
    check_multi_dim_normalized_shape(RMS)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_module_is_a_drop_in(affine: bool, eps: float | None) -> None:
    ref = torch.nn.RMSNorm((4, 6), eps=eps, elementwise_affine=affine)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    mod = RMSNorm((4, 6), eps=eps, elementwise_affine=affine, backend="triton")
    assert mod.state_dict().keys() == ref.state_dict().keys()
    mod.load_state_dict(ref.state_dict())
    # Small inputs, where eps=None (float32's eps) against a wrong eps would show.
    x = 1e-3 * torch.randn(3, 4, 6)
    torch.testing.assert_close(mod(x), ref(x), atol=1e-5, rtol=1e-5)
    assert "backend='triton'" in repr(mod)


def test_module_dtype_and_device() -> None:
    mod = RMSNorm(8, dtype=torch.float16, device="cpu", backend="torch")
    assert mod.weight.dtype == torch.float16 and mod.weight.device.type == "cpu"
    assert mod(torch.randn(2, 8, dtype=torch.float16)).dtype == torch.float16


def test_bad_inputs_name_the_argument() -> None:
    x = torch.randn(2, 7)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        rms_norm(torch.ones(2, 7, dtype=torch.int64), (7,), backend="triton")
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, (7,), torch.ones(6), backend="triton")
    with pytest.raises(TypeError, match="weight must be a floating-point"):
        rms_norm(x, (7,), torch.ones(7, dtype=torch.int32))
    with pytest.raises(ValueError, match="normalized_shape must be"):
        rms_norm(x, (6,))
    with pytest.raises(ValueError, match="residual must have"):
        add_rms_norm(x, torch.randn(3, 7), (7,))
    with pytest.raises(TypeError, match="residual must be a floating-point"):
        add_rms_norm(x, torch.ones(2, 7, dtype=torch.int64), (7,))
    with pytest.raises(ValueError, match="normalized_shape must have at most 65536"):
        rms_norm(torch.randn(1, 65537), (65537,), backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        RMSNorm(7, backend="fast")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_against_reference(check_close: Any, dtype: torch.dtype) -> None:
    check_cuda_against_reference(check_close, RMS, dtype)
