"""Fused bias + GeLU against a float64 reference, on the Triton backend (interpreted on CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ms_kernels.bias_gelu import BiasGeLU, bias_gelu, bias_gelu_reference

HIDDEN = [1, 7, 1023, 1500, 4096]
DTYPES = [torch.float32, torch.float16]
# Absolute tolerance against float64, per dtype, on O(1) inputs.
TOL = {torch.float32: 1e-5, torch.float16: 2e-2}


def _leaf(t: torch.Tensor) -> torch.Tensor:
    # No clone: a view stays a view of the same memory, strides and all.
    return t.detach().requires_grad_()


def _run(fn, x, b, dy, approximate):  # type: ignore[no-untyped-def]
    x, b = _leaf(x), _leaf(b)
    y = fn(x, b, approximate)
    y.backward(dy)
    return y.detach(), x.grad, b.grad


def _make(shape: tuple[int, ...], dtype: torch.dtype, seed: int, transposed: bool):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    if transposed and len(shape) >= 2:
        # A non-contiguous x: the transpose of a contiguous (..., n, rows) tensor.
        base = torch.randn((*shape[:-2], n, shape[-2]), generator=gen) * 2
        x = base.transpose(-1, -2).to(dtype)
        assert not x.is_contiguous() or min(shape[-2], n) <= 1 or x.numel() == 0
    else:
        x = (torch.randn(shape, generator=gen) * 2).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    return x, b, dy


def _check_against_reference(shape, dtype, approximate, seed, transposed):  # type: ignore[no-untyped-def]
    x, b, dy = _make(shape, dtype, seed, transposed)
    _check_tensors(x, b, dy, approximate)


def _check_tensors(x, b, dy, approximate):  # type: ignore[no-untyped-def]
    """The Triton backend on these very tensors against float64 and torch in their dtype."""
    dtype, shape = x.dtype, x.shape
    got = _run(lambda x, b, a: bias_gelu(x, b, a, backend="triton"), x, b, dy, approximate)
    want = _run(bias_gelu_reference, x.double(), b.double(), dy.double(), approximate)
    torch_same_dtype = _run(bias_gelu_reference, x, b, dy, approximate)
    for name, g, w, t in zip(("y", "dx", "dbias"), got, want, torch_same_dtype, strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        err = (g.double() - w).abs().max().item() if g.numel() else 0.0
        torch_err = (t.double() - w).abs().max().item() if t.numel() else 0.0
        scale = w.abs().max().item() if w.numel() else 0.0
        # dbias sums over rows: its error grows with the row count.
        rows = max(1, x.numel() // max(1, shape[-1])) if name == "dbias" else 1
        assert err <= TOL[dtype] * (1 + scale) * rows, f"{name}: error {err} vs float64"
        slack = torch.finfo(dtype).eps * (1 + scale)
        assert err <= 2 * torch_err + slack, f"{name}: error {err}, torch's in {dtype}: {torch_err}"


@pytest.mark.slow
@given(
    hidden=st.sampled_from(HIDDEN),
    lead=st.lists(st.integers(0, 3), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    approximate=st.sampled_from(["none", "tanh"]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_matches_float64_reference(hidden, lead, dtype, approximate, transposed, seed):  # type: ignore[no-untyped-def]
    # At most 8 rows: each interpreted program costs milliseconds.
    lead = lead[:1] if hidden >= 1023 else lead
    shape = (*[min(d, 8) for d in lead], hidden)
    _check_against_reference(shape, dtype, approximate, seed, transposed)


def test_row_strided_views_are_read_in_place() -> None:
    # x: the first 300 columns of a wider buffer (row stride 512); the bias and dy:
    # every other element of theirs. The old code read the bias as if contiguous.
    gen = torch.Generator().manual_seed(4)
    x = (2 * torch.randn(9, 512, generator=gen))[:, :300]
    b = torch.randn(600, generator=gen)[::2]
    dy = torch.randn(9, 600, generator=gen)[:, ::2]
    assert x.stride() == (512, 1) and b.stride() == (2,) and dy.stride() == (600, 2)
    _check_tensors(x, b, dy, "tanh")


def test_row_offsets_past_2_31_elements() -> None:
    # Rows 2**30 elements apart: row 2 starts at element 2**31, where an int32 offset
    # wraps and the kernel would touch the wrong address (x and dy both; dy's rows
    # start n elements after x's). The buffer reserves 4 GiB of address space, of
    # which only the pages of these rows are ever touched (memory is backed lazily).
    # With int32 offsets the interpreter dereferences a wild pointer: the run may
    # crash (the traceback names this test) rather than fail an assertion.
    n = 7
    buf = torch.empty(2**31 + 2 * n, dtype=torch.float16)
    x = buf.as_strided((3, n), (2**30, 1))
    dy = buf.as_strided((3, n), (2**30, 1), n)
    gen = torch.Generator().manual_seed(0)
    x.copy_(2 * torch.randn(3, n, generator=gen))
    dy.copy_(torch.randn(3, n, generator=gen))
    b = torch.randn(n, generator=gen).half()
    for approximate in ("none", "tanh"):
        _check_tensors(x, b, dy, approximate)


@pytest.mark.gpu
@pytest.mark.slow
def test_more_than_2_31_elements_on_cuda() -> None:
    # A contiguous (m, 4096) fp16 tensor of 2**31 + 2**17 elements (4 GiB; four of
    # them): the last rows' offsets are past int32's range. Checked there and at the
    # start against float64.
    n = 4096
    m = 2**31 // n + 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", generator=gen, dtype=torch.float16)
    dy = torch.randn(m, n, device="cuda", generator=gen, dtype=torch.float16)
    b = torch.randn(n, device="cuda", generator=gen, dtype=torch.float16)
    xl, bl = _leaf(x), _leaf(b)
    y = bias_gelu(xl, bl, backend="triton")
    (dx,) = torch.autograd.grad(y, [xl], dy)
    for rows in (slice(0, 64), slice(m - 64, m)):
        x64 = x[rows].double().requires_grad_()
        want = bias_gelu_reference(x64, b.double())
        (want_dx,) = torch.autograd.grad(want, [x64], dy[rows].double())
        for name, g, w in (("y", y[rows], want), ("dx", dx[rows], want_dx)):
            err = (g.double() - w).abs().max().item()
            assert err <= TOL[torch.float16] * (1 + w.abs().max().item()), f"{name}: {err}"


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_large_inputs_saturate_correctly(approximate: str) -> None:
    # exp overflows beyond |z| ~ 44 in the tanh form; gelu must still be z and 0.
    x = torch.tensor([[-200.0, -40.0, -5.0, 0.0, 5.0, 40.0, 200.0]])
    b = torch.zeros(7)
    y = bias_gelu(x, b, approximate, backend="triton")  # type: ignore[arg-type]
    torch.testing.assert_close(y, bias_gelu_reference(x, b, approximate), rtol=1e-6, atol=1e-6)  # type: ignore[arg-type]
    assert torch.isfinite(y).all()


def test_zero_size_batch() -> None:
    x = torch.empty(0, 5, 7, requires_grad=True)
    b = torch.randn(7, requires_grad=True)
    y = bias_gelu(x, b, backend="triton")
    y.sum().backward()
    assert y.shape == (0, 5, 7)
    assert x.grad is not None and x.grad.shape == x.shape
    torch.testing.assert_close(b.grad, torch.zeros(7))


def test_bitwise_deterministic() -> None:
    x, b, dy = _make((8, 300), torch.float32, 3, False)
    first = _run(lambda x, b, a: bias_gelu(x, b, a, backend="triton"), x, b, dy, "none")
    second = _run(lambda x, b, a: bias_gelu(x, b, a, backend="triton"), x, b, dy, "none")
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bfloat16_on_cuda(approximate: str) -> None:
    # The interpreter cannot do bf16 arithmetic; the kernels upcast after load on GPU.
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 1500, device="cuda", generator=gen).bfloat16()
    b = torch.randn(1500, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(64, 1500, device="cuda", generator=gen).bfloat16()
    got = _run(lambda x, b, a: bias_gelu(x, b, a, backend="triton"), x, b, dy, approximate)
    want = _run(bias_gelu_reference, x.double(), b.double(), dy.double(), approximate)
    ref = _run(bias_gelu_reference, x, b, dy, approximate)
    for g, w, t in zip(got, want, ref, strict=True):
        err = (g.double() - w).abs().max().item()
        assert err <= 2 * (t.double() - w).abs().max().item() + 1e-2


def test_module_equals_linear_then_gelu() -> None:
    torch.manual_seed(0)
    dense = torch.nn.Linear(16, 64)
    fused = torch.nn.Sequential(torch.nn.Linear(16, 64, bias=False), BiasGeLU(64, "tanh"))
    fused[0].weight.data.copy_(dense.weight)
    fused[1].bias.data.copy_(dense.bias)
    x = torch.randn(4, 16)
    want = torch.nn.functional.gelu(dense(x), approximate="tanh")
    torch.testing.assert_close(fused(x), want)
    fused[1].backend = "triton"
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-6)
    assert list(fused[1].state_dict()) == ["bias"]


@pytest.mark.parametrize(
    ("x", "bias", "kwargs", "error", "match"),
    [
        (torch.ones(2, 3, dtype=torch.int32), torch.ones(3), {}, TypeError, "x must be a floating"),
        (
            torch.ones(2, 3),
            torch.ones(3, dtype=torch.float64),
            {},
            TypeError,
            "bias must be a tensor of x's dtype",
        ),
        (
            torch.ones(2, 3),
            torch.ones(4),
            {},
            ValueError,
            r"bias must have shape \(x.shape\[-1\],\) = \(3,\), got \(4,\)",
        ),
        (
            torch.ones(2, 3),
            torch.ones(3),
            {"approximate": "erf"},
            ValueError,
            "approximate must be one of",
        ),
        (
            torch.ones(2, 3),
            torch.ones(3),
            {"backend": "cuda"},
            ValueError,
            "backend must be one of",
        ),
    ],
)
def test_bad_input_is_named(x, bias, kwargs, error, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=match):
        bias_gelu(x, bias, **kwargs)


def test_explicit_triton_on_cpu_without_the_interpreter_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        bias_gelu(torch.ones(2, 3), torch.ones(3), backend="triton")
    # auto on CPU is the torch path, silently and by design.
    torch.testing.assert_close(
        bias_gelu(torch.ones(2, 3), torch.ones(3)),
        bias_gelu_reference(torch.ones(2, 3), torch.ones(3)),
    )
