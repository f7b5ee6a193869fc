"""ms_kernels.layer_norm against a float64 reference, both backends, every gradient.

The checks shared with test_rms_norm.py live in _norm_cases.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _norm_cases import (
    LAYER,
    cases,
    check_case,
    check_cuda_against_reference,
    check_deterministic,
    check_every_hidden_size,
    check_mixed_dtype_residual,
    check_multi_dim_normalized_shape,
    check_residual_gradient_includes_the_sum_output,
    check_zero_rows,
)
from hypothesis import given, settings

from ms_kernels.layer_norm import LayerNorm, add_layer_norm, layer_norm


@pytest.mark.slow
@settings(max_examples=25)
@given(case=cases(LAYER))
def test_matches_float64_reference(check_close: Any, case: dict[str, Any]) -> None:
    check_case(check_close, LAYER, case)


@pytest.mark.parametrize("residual", [False, True])
def test_every_hidden_size_and_gradient(check_close: Any, residual: bool) -> None:
    check_every_hidden_size(check_close, LAYER, residual)


@pytest.mark.parametrize(
    ("dtype", "residual_dtype"), [(torch.float16, torch.float32), (torch.float32, torch.float16)]
)
def test_mixed_dtype_residual_promotes_on_both_backends(
    check_close: Any, dtype: torch.dtype, residual_dtype: torch.dtype
) -> None:
    check_mixed_dtype_residual(check_close, LAYER, dtype, residual_dtype)


def test_residual_gradient_includes_the_sum_output() -> None:
    check_residual_gradient_includes_the_sum_output(LAYER)


def test_zero_rows() -> None:
    check_zero_rows(LAYER, (0, 3))


def test_deterministic() -> None:
    check_deterministic(LAYER)


def test_multi_dim_normalized_shape() -> None:
    check_multi_dim_normalized_shape(LAYER)


@pytest.mark.parametrize(("affine", "bias"), [(True, True), (True, False), (False, False)])
def test_module_is_a_drop_in(affine: bool, bias: bool) -> None:
    ref = torch.nn.LayerNorm((4, 6), eps=1e-6, elementwise_affine=affine, bias=bias)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_()
    mod = LayerNorm((4, 6), eps=1e-6, elementwise_affine=affine, bias=bias, backend="triton")
    assert mod.state_dict().keys() == ref.state_dict().keys()
    mod.load_state_dict(ref.state_dict())
    x = torch.randn(3, 4, 6)
    torch.testing.assert_close(mod(x), ref(x), atol=1e-5, rtol=1e-5)
    assert "backend='triton'" in repr(mod)


def test_module_dtype_and_device() -> None:
    mod = LayerNorm(8, dtype=torch.float16, device="cpu", backend="torch")
    assert mod.weight.dtype == torch.float16 and mod.weight.device.type == "cpu"
    assert mod(torch.randn(2, 8, dtype=torch.float16)).dtype == torch.float16


def test_bad_inputs_name_the_argument() -> None:
    x = torch.randn(2, 7)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        layer_norm(torch.ones(2, 7, dtype=torch.int64), (7,), backend="triton")
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, (7,), torch.ones(6), backend="triton")
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, (7,), torch.ones(7), torch.ones(8), backend="torch")
    with pytest.raises(TypeError, match="weight must be a floating-point"):
        layer_norm(x, (7,), torch.ones(7, dtype=torch.int32))
    with pytest.raises(ValueError, match="normalized_shape must be"):
        layer_norm(x, (6,))
    with pytest.raises(ValueError, match="residual must have"):
        add_layer_norm(x, torch.randn(3, 7), (7,))
    with pytest.raises(ValueError, match="normalized_shape must have at most 65536"):
        layer_norm(torch.randn(1, 65537), (65537,), backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        layer_norm(x, (7,), backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend must be one of"):
        LayerNorm(7, backend="fast")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_against_reference(check_close: Any, dtype: torch.dtype) -> None:
    check_cuda_against_reference(check_close, LAYER, dtype)
