"""Lamb against the float64 reference of Algorithm 2 (conftest.py), every switch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_optim import Lamb

STEPS = 21
IMPLS = ["single", "foreach", "auto"]
# Float64 paths must agree to round-off; float32 to about 1e-6 relative.
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 2e-6, "atol": 2e-6}}

SHAPES = [(), (1,), (2,), (3,), (7,), (17,), (2, 5), (3, 1, 4), (1, 1)]


def make_problem(
    seed: int,
    shapes: list[tuple[int, ...]],
    *,
    zero: list[bool] | None = None,
    grad_rate: float = 0.8,
    steps: int = STEPS,
) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    """Weights and a gradient sequence; some weights zero, some gradients missing or zero."""
    gen = torch.Generator().manual_seed(seed)
    zero = zero or [False] * len(shapes)
    weights = [
        torch.zeros(s) if z else torch.randn(s, generator=gen)
        for s, z in zip(shapes, zero, strict=True)
    ]
    grads: list[list[torch.Tensor | None]] = []
    for _ in range(steps):
        row: list[torch.Tensor | None] = []
        for s in shapes:
            draw = float(torch.rand((), generator=gen))
            if draw > grad_rate:
                row.append(None)
            elif draw < 0.05:
                row.append(torch.zeros(s))
            else:
                row.append(torch.randn(s, generator=gen) * 0.1)
        grads.append(row)
    return weights, grads


def run_lamb(
    weights: list[torch.Tensor],
    grads: list[list[torch.Tensor | None]],
    configs: list[Any],
    group_of: list[int],
    *,
    dtype: torch.dtype,
    impl: str,
    **kwargs: Any,
) -> tuple[list[torch.Tensor], Lamb]:
    params = [w.to(dtype).clone().requires_grad_() for w in weights]
    groups = [
        {"params": [p for p, k in zip(params, group_of, strict=True) if k == g], **c.lamb_kwargs()}
        for g, c in enumerate(configs)
    ]
    opt = Lamb(groups, impl=impl, **kwargs)  # type: ignore[arg-type]
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = None if g is None else g.to(dtype)
        opt.step()
    return [p.detach() for p in params], opt


def assert_matches(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            a.double(), b, **TOL[dtype], msg=lambda m, i=i: f"param {i}: {m}"
        )


bounds = st.one_of(
    st.none(), st.sampled_from([(0.0, 10.0), (0.01, 10.0), (0.5, 2.0), (0.0, float("inf"))])
)
configs = st.builds(
    dict,
    lr=st.sampled_from([1e-3, 1e-2, 0.1]),
    beta1=st.sampled_from([0.0, 0.9]),
    beta2=st.sampled_from([0.99, 0.999]),
    # eps = 0 with a zero gradient is 0/0 everywhere; tested separately below.
    eps=st.sampled_from([1e-6, 1e-8]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    bias_correction=st.booleans(),
    decoupled=st.booleans(),
    adaptation=st.booleans(),
    phi_bounds=bounds,
    ratio_bounds=bounds,
    max_grad_norm=st.sampled_from([None, 0.05, 1.0]),
)


@settings(max_examples=40)
@given(
    shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=5),
    zero=st.lists(st.booleans(), min_size=5, max_size=5),
    seed=st.integers(0, 2**31 - 1),
    group_configs=st.lists(configs, min_size=1, max_size=2),
    group_draw=st.lists(st.integers(0, 1), min_size=5, max_size=5),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    impl=st.sampled_from(IMPLS),
)
def test_matches_reference_on_drawn_problems(
    reference: Any,
    ref_config: Any,
    shapes: list[tuple[int, ...]],
    zero: list[bool],
    seed: int,
    group_configs: list[dict[str, Any]],
    group_draw: list[int],
    dtype: torch.dtype,
    impl: str,
) -> None:
    cfgs = [ref_config(**c) for c in group_configs]
    group_of = [k % len(cfgs) for k in group_draw[: len(shapes)]]
    weights, grads = make_problem(seed, shapes, zero=zero[: len(shapes)])
    got, _ = run_lamb(weights, grads, cfgs, group_of, dtype=dtype, impl=impl)
    want = reference(weights, grads, cfgs, group_of)
    assert_matches(got, want, dtype)


SWITCHES = {
    "bias_correction_off": {"bias_correction": False},
    "l2_weight_decay": {"decoupled": False, "weight_decay": 0.1},
    "no_layer_adaptation": {"adaptation": False},
    "phi_bounds": {"phi_bounds": (0.5, 1.5)},
    "trust_ratio_bounds": {"ratio_bounds": (0.5, 2.0)},
    "grad_clipping": {"max_grad_norm": 0.05},
    "no_weight_decay": {"weight_decay": 0.0},
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("switch", sorted(SWITCHES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_each_switch_matches_reference_and_changes_the_result(
    reference: Any, ref_config: Any, impl: str, switch: str, dtype: torch.dtype
) -> None:
    shapes = [(16,), (4, 8), (3,), ()]
    weights, grads = make_problem(7, shapes, zero=[False, False, True, False])
    weights = [w * 3 for w in weights]  # ||w|| far from 1, so phi bounds bite
    base = ref_config(lr=0.05)
    cfg = base.with_(**SWITCHES[switch])
    got, _ = run_lamb(weights, grads, [cfg], [0] * 4, dtype=dtype, impl=impl)
    assert_matches(got, reference(weights, grads, [cfg], [0] * 4), dtype)
    # The switch must matter on this problem, or the comparison above proves nothing.
    plain, _ = run_lamb(weights, grads, [base], [0] * 4, dtype=dtype, impl=impl)
    assert any(
        not torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(got, plain, strict=True)
    )


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_are_never_written(impl: str) -> None:
    weights, grads = make_problem(3, [(5,), (2, 3)], grad_rate=1.0, steps=1)
    params = [w.clone().requires_grad_() for w in weights]
    opt = Lamb(
        params, weight_decay=0.1, decoupled_weight_decay=False, max_grad_norm=0.01, impl=impl
    )  # type: ignore[arg-type]
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g.clone()  # type: ignore[union-attr]
    opt.step()
    for p, g in zip(params, grads[0], strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


def test_trust_ratio_is_one_for_zero_weight_and_zero_update() -> None:
    # A zero weight (||w|| = 0) takes a plain Adam step: w = -lr * m^/(sqrt(v^)+eps).
    p = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    opt = Lamb([p], lr=0.1, weight_decay=0.0, eps=0.0)
    p.grad = torch.tensor([1.0, -2.0, 3.0, -4.0], dtype=torch.float64)
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([-0.1, 0.1, -0.1, 0.1], dtype=p.dtype))
    # ||u|| = 0 (zero gradient, no decay): ratio 1 rather than 0/0, so w stays put.
    q = torch.ones(3, dtype=torch.float64, requires_grad=True)
    opt = Lamb([q], lr=0.1, weight_decay=0.0)
    q.grad = torch.zeros(3, dtype=torch.float64)
    opt.step()
    assert torch.equal(q.detach(), torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_state_and_master_weights(
    impl: str, low: torch.dtype
) -> None:
    weights, grads = make_problem(11, [(6,), (3, 4)], grad_rate=1.0, steps=5)
    weights = [w.to(low).float() for w in weights]  # representable in the low dtype
    grads = [[g.to(low).float() for g in row] for row in grads]  # type: ignore[union-attr]
    params = [w.to(low).requires_grad_() for w in weights]
    opt = Lamb(params, lr=0.01, master_weights=True, impl=impl)  # type: ignore[arg-type]
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = g.to(low)  # type: ignore[union-attr]
        opt.step()
    # The fp32 master copy follows exactly the run of an fp32 model on the same gradients.
    fp32, _ = run_lamb(weights, grads, [_Cfg()], [0, 0], dtype=torch.float32, impl=impl, lr=0.01)
    for p, want in zip(params, fp32, strict=True):
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(state["master"], want)
        assert torch.equal(p.detach(), want.to(low))
    # Without master weights the state is still fp32 and the result close.
    params2 = [w.to(low).requires_grad_() for w in weights]
    opt2 = Lamb(params2, lr=0.01, impl=impl)  # type: ignore[arg-type]
    for row in grads:
        for p, g in zip(params2, row, strict=True):
            p.grad = g.to(low)  # type: ignore[union-attr]
        opt2.step()
    for p, want in zip(params2, fp32, strict=True):
        assert opt2.state[p]["exp_avg"].dtype == torch.float32 and "master" not in opt2.state[p]
        torch.testing.assert_close(p.detach().float(), want, rtol=2e-2, atol=2e-2)


class _Cfg:
    """Empty per-group overrides: Lamb's constructor arguments apply."""

    def lamb_kwargs(self) -> dict[str, Any]:
        return {}


def test_closure_is_evaluated_with_grad_and_its_loss_returned() -> None:
    w = torch.ones(3, requires_grad=True)
    opt = Lamb([w], lr=0.1)

    def closure() -> float:
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return float(loss.detach())

    assert opt.step(closure) == 3.0
    assert w.grad is not None and not torch.equal(w.detach(), torch.ones(3))


def test_lr_scheduler_drives_the_learning_rate(reference: Any, ref_config: Any) -> None:
    weights, grads = make_problem(5, [(8,), (2, 2)], grad_rate=1.0, steps=12)
    params = [w.double().requires_grad_() for w in weights]
    cfg = ref_config(lr=0.1)
    opt = Lamb(params, **cfg.lamb_kwargs())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    lrs = []
    for row in grads:
        lrs.append([opt.param_groups[0]["lr"]])
        for p, g in zip(params, row, strict=True):
            p.grad = g.double()  # type: ignore[union-attr]
        opt.step()
        sched.step()
    assert [r[0] for r in lrs] == [0.1] * 4 + [0.05] * 4 + [0.025] * 4
    want = reference(weights, grads, [cfg], [0, 0], lrs=lrs)
    assert_matches([p.detach() for p in params], want, torch.float64)
