"""The device checks: a matmul judged against a float64 reference and a floor, and host
memory bandwidth. Faults come in through the ``matmul`` parameter and impossible floors;
the verifying function is also checked directly on corrupted products."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ms_health.diagnostics import (
    MATMUL_TOLERANCE,
    matmul_check,
    matmul_error,
    memory_bandwidth_check,
)

SIZE = 96  # small: the checks' logic, not this machine's speed, is under test


@pytest.mark.parametrize("dtype", sorted(MATMUL_TOLERANCE))
def test_matmul_check_passes_a_healthy_cpu_in_every_dtype(dtype: str) -> None:
    result = matmul_check("cpu", SIZE, dtype, min_flops=0)
    assert result.ok, result.message
    ev = result.evidence
    assert ev["dtype"] == dtype and ev["size"] == SIZE
    assert 0 <= ev["max_rel_error"] <= MATMUL_TOLERANCE[dtype] == ev["tolerance"]
    assert ev["flops"] > 0 and len(ev["times_s"]) == 3
    assert "TFLOP/s" in result.message


def test_matmul_check_takes_a_torch_dtype() -> None:
    assert matmul_check("cpu", SIZE, torch.bfloat16).evidence["dtype"] == "bfloat16"


def _corrupt_one(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a @ b
    out[3, 5] += 0.5  # one wrong element, as from a flipped bit in one tile
    return out


def _nan_one(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a @ b
    out[0, 0] = float("nan")
    return out


def _transposed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return b @ a  # a kernel that reads its operands in the wrong order


def _raises(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("CUDA error: uncorrectable ECC error encountered")


@pytest.mark.parametrize("wrong", [_corrupt_one, _transposed])
def test_matmul_check_fails_a_wrong_product(wrong: object) -> None:
    result = matmul_check("cpu", SIZE, "float32", matmul=wrong)  # type: ignore[arg-type]
    assert not result.ok
    assert "is wrong" in result.message and "max relative error" in result.message
    assert result.evidence["max_rel_error"] > MATMUL_TOLERANCE["float32"]


def test_matmul_check_fails_a_product_with_a_nan() -> None:
    result = matmul_check("cpu", SIZE, "bfloat16", matmul=_nan_one)
    assert not result.ok and "non-finite" in result.message
    assert result.evidence["max_rel_error"] == "inf"


def test_a_device_error_fails_the_check_with_its_message() -> None:
    result = matmul_check("cpu", SIZE, matmul=_raises)
    assert not result.ok and "uncorrectable ECC error" in result.message
    assert "RuntimeError" in result.evidence["traceback"]


def test_an_impossible_flops_floor_fails_with_the_measured_figure() -> None:
    result = matmul_check("cpu", SIZE, min_flops=1e30)
    assert not result.ok and "too slow" in result.message
    measured = f"{result.evidence['flops'] / 1e12:.3g} TFLOP/s"
    assert measured in result.message and "floor 1e+18 TFLOP/s" in result.message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_matmul_check_on_cuda_without_cuda_fails_saying_so() -> None:
    result = matmul_check("cuda", SIZE)
    assert not result.ok and result.message == "CUDA is not available"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_matmul_check_passes_a_healthy_gpu(dtype: str) -> None:
    result = matmul_check("cuda", 2048, dtype, min_flops=0)
    assert result.ok, result.message
    assert result.evidence["flops"] > 0


@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    data=st.data(),
    delta=st.floats(1e-6, 1e3) | st.floats(-1e3, -1e-6),
)
def test_matmul_error_is_the_worst_element_relative_to_the_largest(
    rows: int, cols: int, data: st.DataObject, delta: float
) -> None:
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    ref = torch.rand(rows, cols, generator=gen, dtype=torch.float64) * 2 - 1
    i, j = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, cols - 1))
    out = ref.clone()
    out[i, j] += delta
    assert matmul_error(ref, ref) == 0.0
    scale = float(ref.abs().max())
    assert matmul_error(out, ref) == pytest.approx(abs(delta) / scale, rel=1e-6, abs=1e-12)
    # In a narrower dtype the same corruption still shows, on top of the rounding.
    # (float32 rounds each element by up to 2^-24 of itself.)
    assert matmul_error(out.float(), ref) >= abs(delta) / scale * (1 - 1e-6) - 1e-6


@given(i=st.integers(0, 15), bad=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_matmul_error_of_a_non_finite_product_is_inf(i: int, bad: float) -> None:
    ref = torch.ones(4, 4, dtype=torch.float64)
    out = ref.clone().view(-1)
    out[i] = bad
    assert matmul_error(out.view(4, 4), ref) == math.inf


def test_matmul_error_of_a_misshapen_product_is_inf() -> None:
    ref = torch.ones(4, 4, dtype=torch.float64)
    assert matmul_error(torch.ones(4, 3), ref) == math.inf


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"device": "tpu"}, "device must be"),
        ({"device": "cpu:0"}, "device must be"),
        ({"device": "cuda:x"}, "device must be"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"size": 0}, "size must be an int >= 1"),
        ({"repeats": 0}, "repeats must be an int >= 1"),
        ({"min_flops": -1.0}, "min_flops must be None or a number >= 0"),
        ({"min_flops": math.nan}, "min_flops must be None or a number >= 0"),
        ({"tolerance": 0.0}, "tolerance must be a finite number > 0"),
    ],
)
def test_matmul_check_refuses_bad_arguments(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        matmul_check(**{"size": SIZE, **kwargs})  # type: ignore[arg-type]


def test_memory_bandwidth_check_measures_a_copy() -> None:
    result = memory_bandwidth_check(8, min_gbps=0, repeats=3)
    assert result.ok, result.message
    ev = result.evidence
    assert ev["bytes"] == 8 << 20 and ev["intact"] is True and len(ev["times_s"]) == 3
    assert ev["gbps"] == pytest.approx(2 * ev["bytes"] / ev["best_s"] / 1e9)
    assert f"{ev['gbps']:.3g} GB/s" in result.message


def test_an_impossible_bandwidth_floor_fails_with_the_measured_figure() -> None:
    result = memory_bandwidth_check(8, min_gbps=1e12)
    assert not result.ok and "too slow" in result.message
    assert f"{result.evidence['gbps']:.3g} GB/s" in result.message
    assert "floor 1e+12 GB/s" in result.message


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((0,), {}, ValueError, "size_mb must be a finite number > 0"),
        ((math.inf,), {}, ValueError, "size_mb must be a finite number > 0"),
        (("8",), {}, TypeError, "size_mb must be a number"),
        ((8, -1.0), {}, ValueError, "min_gbps must be None or a number >= 0"),
        ((8,), {"repeats": 0}, ValueError, "repeats must be an int >= 1"),
    ],
)
def test_memory_bandwidth_check_refuses_bad_arguments(
    args: tuple[object, ...], kwargs: dict[str, object], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        memory_bandwidth_check(*args, **kwargs)  # type: ignore[arg-type]
