"""Each README variant row reproduces its peer, step for step, in every implementation.

The peers are not dependencies. Each is restated below as a plain float64 loop
from its published algorithm (the file it was read from is named in each
docstring; read, not copied), sharing no code with ms_optim or with the other
references. Each test builds ``Lamb`` exactly as the README's variant table says
and compares the weights after every step. The problem has parameters without a
gradient on some steps (one gets its first gradient at step 3, one whole step
has none), so step counting per parameter and per group give different results,
and gradients large enough for clipping at 1.0 to bite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ms_optim import Lamb

LR = 0.05
STEPS = 9
SHAPES = [(6,), (3, 4), (5,), (), (40,)]
# Group 0: weight matrices (decayed); group 1: "biases and norms" (no decay).
GROUP_OF = [0, 0, 1, 1, 0]
# Steps on which a parameter has no gradient (p.grad = None).
NO_GRAD = {1: {2, 5}, 2: {0, 1, 2}, 3: {6}, 4: {4}}
ALL_NONE_STEP = 7  # no parameter has a gradient: the group counters still advance

Weights = list[torch.Tensor]
Grads = list[list[torch.Tensor | None]]


def problem(seed: int = 0) -> tuple[Weights, Grads]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) * 2 for s in SHAPES]
    weights[4].zero_()  # a zero weight: trust ratio 1
    grads: Grads = []
    for step in range(STEPS):
        row: list[torch.Tensor | None] = []
        for i, s in enumerate(SHAPES):
            g = torch.randn(s, generator=gen, dtype=torch.float64) * 0.5
            row.append(None if step in NO_GRAD.get(i, ()) or step == ALL_NONE_STEP else g)
        grads.append(row)
    return weights, grads


def _norm(x: torch.Tensor) -> float:
    return math.sqrt(float((x * x).sum()))


# -- the peers, restated in float64 --------------------------------------------------


def deepspeed_fused_lamb(
    weights: Weights,
    grads: Grads,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
) -> list[Weights]:
    """DeepSpeed ``FusedLamb`` (deepspeed/ops/lamb/fused_lamb.py and
    csrc/lamb/fused_lamb_cuda_kernel.cu, microsoft/DeepSpeed): a step count per
    parameter; the update is built from the raw moments, and the bias correction
    scales the step size, lr sqrt(1 - b2^t) / (1 - b1^t); the coefficient
    ||w|| / ||u|| is clamped into [min_coeff, max_coeff] when both norms are
    non-zero, else 1. Defaults: eps 1e-8, no decay, no clipping (max_grad_norm 0).
    """
    b1, b2 = betas
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    t = [0] * len(w)
    history = []
    for row in grads:
        for i, g in enumerate(row):
            if g is None:
                continue
            t[i] += 1
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            update = m[i] / (v[i].sqrt() + eps) + weight_decay * w[i]
            w_norm, u_norm = _norm(w[i]), _norm(update)
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            step_size = lr * math.sqrt(1 - b2 ** t[i]) / (1 - b1 ** t[i])
            w[i] = w[i] - step_size * coeff * update
        history.append([x.clone() for x in w])
    return history


def torch_optimizer_lamb(
    weights: Weights,
    grads: Grads,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    clamp_value: float = 10.0,
    debias: bool = False,
) -> list[Weights]:
    """torch-optimizer ``Lamb`` (torch_optimizer/lamb.py, jettify/pytorch-optimizer):
    a step count per parameter; ``debias`` multiplies the step size by
    sqrt(1 - b2^t) / (1 - b1^t), the moments themselves are never corrected;
    ||w|| is clamped into [0, clamp_value]; ratio 1 when either norm is 0.
    Defaults: no decay, debias off.
    """
    b1, b2 = betas
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    t = [0] * len(w)
    history = []
    for row in grads:
        for i, g in enumerate(row):
            if g is None:
                continue
            t[i] += 1
            m[i] = m[i] * b1 + g * (1 - b1)
            v[i] = v[i] * b2 + g * g * (1 - b2)
            correction = math.sqrt(1 - b2 ** t[i]) / (1 - b1 ** t[i]) if debias else 1.0
            w_norm = min(max(_norm(w[i]), 0.0), clamp_value)
            adam_step = m[i] / (v[i].sqrt() + eps)
            if weight_decay != 0:
                adam_step = adam_step + weight_decay * w[i]
            a_norm = _norm(adam_step)
            ratio = 1.0 if w_norm == 0 or a_norm == 0 else w_norm / a_norm
            w[i] = w[i] - lr * correction * ratio * adam_step
        history.append([x.clone() for x in w])
    return history


def apex_fused_lamb(
    weights: Weights,
    grads: Grads,
    decays: list[float],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    grad_averaging: bool = True,
    max_grad_norm: float = 1.0,
) -> list[Weights]:
    """Apex ``FusedLAMB`` (apex/optimizers/fused_lamb.py and
    csrc/multi_tensor_lamb.cu, NVIDIA/apex), ``adam_w_mode=True``,
    ``use_nvlamb=False``: the global norm of all gradients divides them by
    norm / max_grad_norm when it exceeds max_grad_norm; one step count per param
    group, advanced on every ``step()``; m takes (1 - b1) g, or g without grad
    averaging; decay enters u; the trust ratio applies only where the group's
    weight decay is non-zero (and both norms are). ``decays[i]``: parameter i's
    group weight decay.
    """
    b1, b2 = betas
    beta3 = 1 - b1 if grad_averaging else 1.0
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    group_t: dict[int, int] = {}
    history = []
    for row in grads:
        total = math.sqrt(sum(float((g * g).sum()) for g in row if g is not None))
        divisor = total / max_grad_norm if total > max_grad_norm else 1.0
        for k in sorted(set(GROUP_OF)):
            group_t[k] = group_t.get(k, 0) + 1
        for i, g in enumerate(row):
            if g is None:
                continue
            t = group_t[GROUP_OF[i]]
            g = g / divisor
            m[i] = b1 * m[i] + beta3 * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat = m[i] / (1 - b1**t)
            v_hat = v[i] / (1 - b2**t)
            update = m_hat / (v_hat.sqrt() + eps) + decays[i] * w[i]
            scale = lr
            if decays[i] != 0:
                w_norm, u_norm = _norm(w[i]), _norm(update)
                if w_norm != 0 and u_norm != 0:
                    scale = lr * w_norm / u_norm
            w[i] = w[i] - scale * update
        history.append([x.clone() for x in w])
    return history


def timm_lamb(
    weights: Weights,
    grads: Grads,
    decays: list[float],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    grad_averaging: bool = True,
    max_grad_norm: float = 1.0,
    trust_clip: bool = False,
    always_adapt: bool = False,
    decoupled_decay: bool = False,
) -> list[Weights]:
    """timm ``Lamb`` (timm/optim/lamb.py, huggingface/pytorch-image-models): global
    clipping as Apex; one step count per param group, advanced on every
    ``step()``; u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps); with decay, either
    u += wd w or, with ``decoupled_decay``, w -= lr wd w first (so ||w|| is taken
    after it); the trust ratio (1 if a norm is 0, at most 1 with ``trust_clip``)
    applies where decay is non-zero or ``always_adapt``.
    """
    b1, b2 = betas
    beta3 = 1 - b1 if grad_averaging else 1.0
    w = [x.clone() for x in weights]
    m = [torch.zeros_like(x) for x in w]
    v = [torch.zeros_like(x) for x in w]
    group_t: dict[int, int] = {}
    history = []
    for row in grads:
        total = math.sqrt(sum(float((g * g).sum()) for g in row if g is not None))
        divisor = max(total / max_grad_norm, 1.0)
        for k in sorted(set(GROUP_OF)):
            group_t[k] = group_t.get(k, 0) + 1
        for i, g in enumerate(row):
            if g is None:
                continue
            t = group_t[GROUP_OF[i]]
            g = g / divisor
            m[i] = b1 * m[i] + beta3 * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = v[i].sqrt() / math.sqrt(1 - b2**t) + eps
            update = (m[i] / (1 - b1**t)) / denom
            wd = decays[i]
            if wd != 0:
                if decoupled_decay:
                    w[i] = w[i] - lr * wd * w[i]
                else:
                    update = update + wd * w[i]
            if wd != 0 or always_adapt:
                w_norm, u_norm = _norm(w[i]), _norm(update)
                ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                if trust_clip:
                    ratio = min(ratio, 1.0)
                update = update * ratio
            w[i] = w[i] - lr * update
        history.append([x.clone() for x in w])
    return history


# -- ms configured as the README's variant table says --------------------------------


def run_ms(
    weights: Weights,
    grads: Grads,
    groups: list[dict[str, Any]],
    *,
    impl: str,
    dtype: torch.dtype,
    **kwargs: Any,
) -> list[Weights]:
    params = [w.to(dtype).clone().requires_grad_() for w in weights]
    param_groups = [
        {"params": [p for p, k in zip(params, GROUP_OF, strict=True) if k == g], **extra}
        for g, extra in enumerate(groups)
    ]
    opt = Lamb(param_groups, lr=LR, impl=impl.split("-")[0], **kwargs)  # type: ignore[arg-type]
    _use_small_blocks(opt, impl)
    history = []
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = None if g is None else g.to(dtype)
        opt.step()
        # Parameters in optimizer order (group after group) back to problem order.
        history.append([p.detach().double().clone() for p in params])
    return history


def _use_small_blocks(opt: Lamb, impl: str) -> None:
    # Test-sized tensors: compile every tensor (the default threshold is 65,536
    # elements), give Triton several blocks per tensor, and run foreach both
    # untiled (its CUDA path) and in tiles that cut tensors (its CPU path).
    if impl.startswith("foreach-"):
        from ms_optim._foreach import ForeachImpl

        tile = impl.removeprefix("foreach-")
        opt._impl = ForeachImpl(cpu_tile=None if tile == "untiled" else int(tile))
    elif impl == "compiled":
        from ms_optim._compiled import CompiledImpl

        opt._impl = CompiledImpl(min_numel=1)
    elif impl == "triton":
        from ms_optim._triton_lamb import TritonImpl

        opt._impl = TritonImpl(block_size=16)


DECAYED = {"weight_decay": 0.01}
PLAIN = {"weight_decay": 0.0, "layer_adaptation": False}  # as lamb_param_groups builds


def _ds(w: Weights, g: Grads) -> list[Weights]:
    return deepspeed_fused_lamb(w, g, lr=LR, weight_decay=0.01)


def _to(debias: bool) -> Callable[[Weights, Grads], list[Weights]]:
    return lambda w, g: torch_optimizer_lamb(w, g, lr=LR, debias=debias)


def _decays(wd: float = 0.01) -> list[float]:
    return [wd if k == 0 else 0.0 for k in GROUP_OF]


#: name: (peer reference, ms param-group extras, ms Lamb kwargs, the kwargs of the
#: closest ms configuration without the new switch, which must *not* match).
VARIANTS: dict[str, tuple[Any, list[dict[str, Any]], dict[str, Any], dict[str, Any]]] = {
    "deepspeed": (
        _ds,
        [{}, {}],
        {
            "eps": 1e-8,
            "weight_decay": 0.01,
            "trust_ratio_bounds": (0.01, 10.0),
            "step_size_bias_correction": True,
        },
        {"step_size_bias_correction": False},
    ),
    "torch-optimizer": (
        _to(debias=False),
        [{}, {}],
        {"weight_decay": 0.0, "bias_correction": False, "weight_norm_bounds": (0.0, 10.0)},
        {"bias_correction": True},
    ),
    "torch-optimizer-debias": (
        _to(debias=True),
        [{}, {}],
        {
            "weight_decay": 0.0,
            "step_size_bias_correction": True,
            "weight_norm_bounds": (0.0, 10.0),
        },
        {"step_size_bias_correction": False},
    ),
    "apex": (
        lambda w, g: apex_fused_lamb(w, g, _decays(), lr=LR),
        [DECAYED, PLAIN],
        {"max_grad_norm": 1.0, "step_count": "group"},
        {"step_count": "param"},
    ),
    "apex-no-grad-averaging": (
        lambda w, g: apex_fused_lamb(w, g, _decays(), lr=LR, grad_averaging=False),
        [DECAYED, PLAIN],
        {"max_grad_norm": 1.0, "step_count": "group", "grad_averaging": False},
        {"grad_averaging": True},
    ),
    "timm": (
        lambda w, g: timm_lamb(w, g, _decays(), lr=LR),
        [DECAYED, PLAIN],
        {"max_grad_norm": 1.0, "step_count": "group"},
        {"step_count": "param"},
    ),
    "timm-decoupled-decay": (
        lambda w, g: timm_lamb(w, g, _decays(0.3), lr=LR, decoupled_decay=True),
        [{"weight_decay": 0.3}, PLAIN],  # large decay, so the placement shows
        {"max_grad_norm": 1.0, "step_count": "group", "decay_in_update": False},
        {"decay_in_update": True},
    ),
    "timm-no-averaging-trust-clip-always-adapt": (
        lambda w, g: timm_lamb(
            w, g, _decays(), lr=LR, grad_averaging=False, trust_clip=True, always_adapt=True
        ),
        [DECAYED, {"weight_decay": 0.0}],
        {
            "max_grad_norm": 1.0,
            "step_count": "group",
            "grad_averaging": False,
            "trust_ratio_bounds": (0.0, 1.0),
        },
        {"grad_averaging": True},
    ),
}
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 3e-6, "atol": 3e-6}}


def check_variant(name: str, impl: str, dtype: torch.dtype) -> None:
    ref, groups, kwargs, _ = VARIANTS[name]
    weights, grads = problem()
    want = ref(weights, grads)
    got = run_ms(weights, grads, groups, impl=impl, dtype=dtype, **kwargs)
    for step, (g_row, w_row) in enumerate(zip(got, want, strict=True)):
        for i, (a, b) in enumerate(zip(g_row, w_row, strict=True)):
            torch.testing.assert_close(
                a, b, **TOL[dtype], msg=lambda m, s=step, i=i: f"{name} step {s} param {i}: {m}"
            )


@pytest.mark.parametrize(
    "impl",
    [
        "single",
        "foreach",
        pytest.param("foreach-untiled", marks=pytest.mark.slow),
        pytest.param("foreach-7", marks=pytest.mark.slow),
        "auto",
    ],
)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_row_matches_its_peer(name: str, impl: str) -> None:
    check_variant(name, impl, torch.float64)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_without_the_new_switch_the_peer_is_not_matched(name: str) -> None:
    # The comparison above proves something only if the switch matters here.
    ref, groups, kwargs, without = VARIANTS[name]
    weights, grads = problem()
    want = ref(weights, grads)[-1]
    got = run_ms(weights, grads, groups, impl="single", dtype=torch.float64, **kwargs | without)
    assert any(
        not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got[-1], want, strict=True)
    )


def test_old_readme_deepspeed_row_is_off_on_step_one() -> None:
    # 0.1.0's README row (bias correction in the moments) against DeepSpeed's rule.
    weights, grads = problem()
    want = deepspeed_fused_lamb(weights, grads, lr=LR)[0][0] - weights[0]
    got = run_ms(
        weights, grads, [{}, {}], impl="single", dtype=torch.float64,
        eps=1e-8, weight_decay=0.0, trust_ratio_bounds=(0.01, 10.0),
    )[0][0] - weights[0]  # fmt: skip
    assert float((got - want).norm() / want.norm()) > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_row_matches_its_peer_compiled(name: str) -> None:
    check_variant(name, "compiled", torch.float32)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("apex-no-grad-averaging", marks=pytest.mark.slow),
        "timm-decoupled-decay",
        pytest.param("deepspeed", marks=pytest.mark.slow),
        pytest.param("timm-no-averaging-trust-clip-always-adapt", marks=pytest.mark.slow),
    ],
)
def test_variant_row_matches_its_peer_triton(name: str) -> None:
    pytest.importorskip("triton")
    check_variant(name, "triton", torch.float32)


def test_group_step_counter_is_saved_and_resumed() -> None:
    weights, grads = problem()
    kwargs: dict[str, Any] = {"max_grad_norm": 1.0, "step_count": "group"}
    want = run_ms(weights, grads, [DECAYED, PLAIN], impl="foreach", dtype=torch.float64, **kwargs)

    params = [w.clone().requires_grad_() for w in weights]
    groups = [
        {"params": [p for p, k in zip(params, GROUP_OF, strict=True) if k == g], **extra}
        for g, extra in enumerate([DECAYED, PLAIN])
    ]
    opt = Lamb(groups, lr=LR, impl="foreach", **kwargs)
    half = 4
    for row in grads[:half]:
        for p, g in zip(params, row, strict=True):
            p.grad = g
        opt.step()
    sd = opt.state_dict()
    assert sd["ms_optim_format"] == 2  # 0.1.0 must refuse it, not ignore step_count
    assert [g["group_step"] for g in sd["param_groups"]] == [half, half]
    resumed = [p.detach().clone().requires_grad_() for p in params]
    groups2 = [
        {"params": [p for p, k in zip(resumed, GROUP_OF, strict=True) if k == g], **extra}
        for g, extra in enumerate([DECAYED, PLAIN])
    ]
    opt2 = Lamb(groups2, lr=LR, impl="foreach", **kwargs)
    opt2.load_state_dict(sd)
    for row in grads[half:]:
        for p, g in zip(resumed, row, strict=True):
            p.grad = g
        opt2.step()
    for a, b in zip(resumed, want[-1], strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)


def test_old_readme_torch_optimizer_row_misses_weight_decay() -> None:
    # 0.1.0's row left ms's default weight_decay=0.01 in place of the peer's 0.
    weights, grads = problem()
    want = torch_optimizer_lamb(weights, grads, lr=LR)[-1]
    old_row = {"bias_correction": False, "weight_norm_bounds": (0.0, 10.0)}
    got = run_ms(weights, grads, [{}, {}], impl="single", dtype=torch.float64, **old_row)[-1]
    assert any(
        not torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got, want, strict=True)
    )
    fixed = run_ms(
        weights, grads, [{}, {}], impl="single", dtype=torch.float64, weight_decay=0.0, **old_row
    )[-1]
    for a, b in zip(fixed, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
