"""The scaffold shared by test_layer_norm.py and test_rms_norm.py.

LayerNorm and RMSNorm run the same kernels, so their tests differ only in the
function under test and its float64 definition: a ``Norm`` names those, and every
check here takes one. Results are judged by the ``check_close`` fixture (conftest.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from ms_kernels.layer_norm import add_layer_norm, layer_norm
from ms_kernels.rms_norm import add_rms_norm, rms_norm

HIDDEN = (1, 7, 1023, 1500, 4096)
DTYPES = (torch.float32, torch.float16)
LAYER_NORM_EPS = 1e-5
# What torch.nn.RMSNorm uses for eps=None on float16, bfloat16 and float32 inputs:
# the epsilon of float32, the type it computes in (its docstring, and measured).
RMS_DEFAULT_EPS = torch.finfo(torch.float32).eps

Case = dict[str, Any]
Tensors = dict[str, torch.Tensor | None]


@dataclass(frozen=True)
class Norm:
    """LayerNorm (``kind="layer"``: centred, with a bias) or RMSNorm (``kind="rms"``)."""

    kind: str

    @property
    def has_bias(self) -> bool:
        return self.kind == "layer"

    @property
    def default_eps(self) -> float | None:
        """The functions' default eps."""
        return LAYER_NORM_EPS if self.kind == "layer" else None

    def reference_eps(self, case: Case) -> float:
        """The eps the float64 reference uses: what the kernel must use for ``case``."""
        if self.kind == "layer":
            return float(case["eps"])
        return RMS_DEFAULT_EPS if case["eps"] is None else float(case["eps"])

    def apply(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        normalized_shape: tuple[int, ...],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float | None,
        backend: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, s)``: the norm of ``s = x + residual`` (``s = x`` without a residual).

        ``backend="reference"`` is the definition in torch, run by the caller in float64.
        """
        if backend == "reference":
            s = x + residual if residual is not None else x
            if self.kind == "layer":
                return F.layer_norm(s, normalized_shape, weight, bias, eps), s
            return F.rms_norm(s, normalized_shape, weight, eps), s
        if self.kind == "layer":
            if residual is not None:
                return add_layer_norm(
                    x, residual, normalized_shape, weight, bias, eps, backend=backend
                )  # type: ignore[arg-type]
            return layer_norm(x, normalized_shape, weight, bias, eps, backend=backend), x  # type: ignore[arg-type]
        assert bias is None
        if residual is not None:
            return add_rms_norm(x, residual, normalized_shape, weight, eps, backend=backend)  # type: ignore[arg-type]
        return rms_norm(x, normalized_shape, weight, eps, backend=backend), x  # type: ignore[arg-type]


LAYER = Norm("layer")
RMS = Norm("rms")


def cases(norm: Norm) -> st.SearchStrategy[Case]:
    """Hypothesis cases: shapes, dtype, which parameters, residual, layout, eps, seed."""

    @st.composite
    def draw_case(draw: Any) -> Case:
        lead = draw(
            st.lists(st.integers(0, 4), min_size=1, max_size=3).filter(lambda s: math.prod(s) <= 8)
        )
        affine = draw(st.booleans())
        return {
            "lead": tuple(lead),
            "n": draw(st.sampled_from(HIDDEN)),
            "dtype": draw(st.sampled_from(DTYPES)),
            "affine": affine,
            "bias": norm.has_bias and draw(st.booleans()),
            "residual": draw(st.booleans()),
            "strided": draw(st.booleans()),
            "eps": LAYER_NORM_EPS if norm.kind == "layer" else draw(st.sampled_from([None, 1e-6])),
            "seed": draw(st.integers(0, 2**16)),
        }

    result: st.SearchStrategy[Case] = draw_case()
    return result


def fixed_case(norm: Norm, **overrides: Any) -> Case:
    """A case with every field set; ``overrides`` replace the defaults."""
    case: Case = {
        "lead": (3,),
        "n": 7,
        "dtype": torch.float32,
        "affine": True,
        "bias": norm.has_bias,
        "residual": False,
        "strided": False,
        "eps": LAYER_NORM_EPS if norm.kind == "layer" else 1e-6,
        "seed": 0,
    }
    case.update(overrides)
    return case


def inputs(case: Case, *, scale: float = 1.0) -> Tensors:
    """Inputs and upstream grads in ``case["dtype"]``; ``strided`` gives non-contiguous views.

    ``scale`` multiplies the activations (``x`` and ``residual``).
    """
    gen = torch.Generator().manual_seed(case["seed"])
    lead, n, dtype = case["lead"], case["n"], case["dtype"]

    def act(size: float = 1.0) -> torch.Tensor:
        if case["strided"]:  # every other element of a wider buffer: last-dim stride 2
            return (size * torch.randn(*lead, 2 * n, generator=gen)).to(dtype)[..., ::2]
        return (size * torch.randn(*lead, n, generator=gen)).to(dtype)

    def param(shift: float) -> torch.Tensor:
        return (shift + 0.5 * torch.randn(n, generator=gen)).to(dtype)

    return {
        "x": act(scale),
        "residual": act(scale) if case["residual"] else None,
        "weight": param(1.0) if case["affine"] else None,
        "bias": param(0.0) if case["affine"] and case["bias"] else None,
        "dy": act(),
        "ds": act(),
    }


def run(
    norm: Norm,
    tensors: Tensors,
    case: Case,
    backend: str,
    dtype: torch.dtype,
    *,
    residual_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Forward and backward with leaves in ``dtype`` (float64 for the reference).

    ``residual_dtype``: the residual's dtype, when it differs from x's; the weight
    and bias then take the promoted dtype, as in a model whose parameters and
    residual stream are float32 under autocast.
    """
    r_dtype = residual_dtype or dtype
    param_dtype = torch.promote_types(dtype, r_dtype)
    leaf_dtypes = {"x": dtype, "residual": r_dtype, "weight": param_dtype, "bias": param_dtype}
    leaves = {
        k: v.detach().to(leaf_dtypes[k]).requires_grad_()
        for k in ("x", "residual", "weight", "bias")
        if (v := tensors[k]) is not None
    }
    x, residual = leaves["x"], leaves.get("residual")
    weight, bias = leaves.get("weight"), leaves.get("bias")
    dy, ds = tensors["dy"], tensors["ds"]
    assert dy is not None and ds is not None
    n = case["n"]
    eps = norm.reference_eps(case) if backend == "reference" else case["eps"]
    y, s = norm.apply(x, residual, (n,), weight, bias, eps, backend)
    outs = {"y": y}
    loss = (y * dy.to(dtype)).sum()
    if residual is not None:
        outs["sum"] = s
        loss = loss + (s * ds.to(dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    for (k, leaf), g in zip(leaves.items(), grads, strict=True):
        outs[f"grad_{k}"] = g if g is not None else torch.zeros_like(leaf)
    return {k: v.detach() for k, v in outs.items()}


def scales(norm: Norm, tensors: Tensors, case: Case) -> dict[str, float]:
    """Error scales for the input gradients: the size of the terms that cancel in them."""
    x, r, w, dy = tensors["x"], tensors["residual"], tensors["weight"], tensors["dy"]
    assert x is not None and dy is not None
    if x.numel() == 0:
        return {}
    s = x.double() + r.double() if r is not None else x.double()
    second_moment = s.var(-1, unbiased=False) if norm.kind == "layer" else s.pow(2).mean(-1)
    rstd = second_moment.add(norm.reference_eps(case)).rsqrt().max().item()
    wdy = dy.double() * (w.double() if w is not None else 1.0)
    term = 1.0 + wdy.abs().max().item() * rstd
    return {"grad_x": term, "grad_residual": term}


def check_case(check_close: Any, norm: Norm, case: Case) -> None:
    """Triton and torch backends against float64, every output and gradient."""
    tensors = inputs(case)
    errs = scales(norm, tensors, case)
    ref = run(norm, tensors, case, "reference", torch.float64)
    lowp = run(norm, tensors, case, "torch", case["dtype"])
    got = run(norm, tensors, case, "triton", case["dtype"])
    assert got.keys() == ref.keys() == lowp.keys()
    for name in ref:
        check_close(f"triton {name}", got[name], lowp[name], ref[name], scale=errs.get(name))
        check_close(f"torch {name}", lowp[name], lowp[name], ref[name], is_torch=True)


def check_every_hidden_size(check_close: Any, norm: Norm, residual: bool) -> None:
    """Every hidden size in float32 with every parameter: all outputs and gradients."""
    for n in HIDDEN:
        case = fixed_case(norm, n=n, residual=residual, seed=n)
        tensors = inputs(case)
        errs = scales(norm, tensors, case)
        ref = run(norm, tensors, case, "reference", torch.float64)
        lowp = run(norm, tensors, case, "torch", torch.float32)
        got = run(norm, tensors, case, "triton", torch.float32)
        expected = {"y", "grad_x", "grad_weight"}
        if norm.has_bias:
            expected |= {"grad_bias"}
        if residual:
            expected |= {"sum", "grad_residual"}
        assert got.keys() == expected
        for name in ref:
            check_close(f"n={n} {name}", got[name], lowp[name], ref[name], scale=errs.get(name))


def check_mixed_dtype_residual(
    check_close: Any, norm: Norm, dtype: torch.dtype, residual_dtype: torch.dtype
) -> None:
    """A residual of another dtype: both backends sum in the promoted dtype.

    ``y`` and ``s`` have the promoted dtype; each input's gradient has its own.
    """
    promoted = torch.promote_types(dtype, residual_dtype)
    case = fixed_case(norm, lead=(4,), n=1500, dtype=dtype, residual=True, seed=5)
    tensors = inputs(case)
    residual = tensors["residual"]
    assert residual is not None
    tensors["residual"] = residual.to(residual_dtype)  # the reference sees the same values
    errs = scales(norm, tensors, case)
    ref = run(norm, tensors, case, "reference", torch.float64)
    results = {
        backend: run(norm, tensors, case, backend, dtype, residual_dtype=residual_dtype)
        for backend in ("torch", "triton")
    }
    want = {"y": promoted, "sum": promoted, "grad_x": dtype, "grad_residual": residual_dtype}
    for backend, outs in results.items():
        got_dtypes = {name: outs[name].dtype for name in want}
        assert got_dtypes == want, f"{backend}: {got_dtypes}"
    lowp, got = results["torch"], results["triton"]
    assert got.keys() == lowp.keys() == ref.keys()
    for name in ref:
        check_close(f"triton {name}", got[name], lowp[name], ref[name], scale=errs.get(name))
        check_close(f"torch {name}", lowp[name], lowp[name], ref[name], is_torch=True)


def check_residual_gradient_includes_the_sum_output(norm: Norm) -> None:
    # With dy = 0 the only gradient is the one flowing into the returned sum.
    x = torch.randn(2, 7, requires_grad=True)
    r = torch.randn(2, 7, requires_grad=True)
    y, s = norm.apply(x, r, (7,), None, None, norm.default_eps, "triton")
    ds = torch.randn(2, 7)
    gx, gr = torch.autograd.grad((y * 0).sum() + (s * ds).sum(), [x, r])
    torch.testing.assert_close(gx, ds)
    torch.testing.assert_close(gr, ds)


def check_zero_rows(norm: Norm, lead: tuple[int, ...]) -> None:
    """No rows (``lead`` holds a 0): empty outputs and gradients, zero parameter grads."""
    shape = (*lead, 7)
    x = torch.randn(shape, requires_grad=True)
    r = torch.randn(shape, requires_grad=True)
    params = [torch.randn(7, requires_grad=True)]
    if norm.has_bias:
        params.append(torch.randn(7, requires_grad=True))
    w, b = params[0], params[1] if norm.has_bias else None
    y, s = norm.apply(x, r, (7,), w, b, norm.default_eps, "triton")
    assert y.shape == s.shape == shape
    gx, gr, *gparams = torch.autograd.grad((y.sum() + s.sum()), [x, r, *params])
    assert gx.shape == gr.shape == shape
    for g in gparams:
        assert torch.equal(g, torch.zeros(7))


def check_deterministic(norm: Norm) -> None:
    # 7 rows over 4 backward programs: several rows per partial buffer row.
    gen = torch.Generator().manual_seed(0)
    x, r, dy = (torch.randn(7, 1500, generator=gen) for _ in range(3))
    params = [torch.randn(1500, generator=gen) for _ in range(2 if norm.has_bias else 1)]

    def once() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, r, *params)]
        bias = leaves[3] if norm.has_bias else None
        y, s = norm.apply(
            leaves[0], leaves[1], (1500,), leaves[2], bias, norm.default_eps, "triton"
        )
        return [y, s, *torch.autograd.grad((y * dy).sum() + s.sum(), leaves)]

    for a, c in zip(once(), once(), strict=True):
        assert torch.equal(a, c)


def check_multi_dim_normalized_shape(norm: Norm) -> None:
    eps = norm.reference_eps(fixed_case(norm))
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    params = [
        torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
        for _ in range(2 if norm.has_bias else 1)
    ]
    w, b = params[0], params[1] if norm.has_bias else None
    got, _ = norm.apply(
        x.float(), None, (3, 5), w.float(), b.float() if b is not None else None, eps, "triton"
    )
    ref, _ = norm.apply(x, None, (3, 5), w, b, eps, "reference")
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    g_got = torch.autograd.grad(got.double().pow(2).sum(), [x, *params])
    g_ref = torch.autograd.grad(ref.pow(2).sum(), [x, *params])
    for a, c in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)


def check_cuda_against_reference(check_close: Any, norm: Norm, dtype: torch.dtype) -> None:
    # The interpreter cannot do bf16 arithmetic, so bf16 is checked on a GPU only.
    for n in HIDDEN:
        eps = LAYER_NORM_EPS if norm.kind == "layer" else None
        case = fixed_case(
            norm, lead=(4, 2), n=n, dtype=dtype, residual=True, strided=True, eps=eps, seed=n
        )
        tensors = {k: v.cuda() if v is not None else None for k, v in inputs(case).items()}
        errs = scales(norm, tensors, case)
        ref = run(norm, tensors, case, "reference", torch.float64)
        lowp = run(norm, tensors, case, "torch", dtype)
        got = run(norm, tensors, case, "triton", dtype)
        for name in ref:
            check_close(f"n={n} {name}", got[name], lowp[name], ref[name], scale=errs.get(name))
