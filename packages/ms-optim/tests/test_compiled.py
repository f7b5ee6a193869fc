"""impl="compiled" (torch.compile of the two fused phases) against the reference.

Compiling costs tens of seconds the first time on this machine (inductor caches
on disk afterwards), so one test covers several switches over one problem.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ms_optim import Lamb
from ms_optim._compiled import CompiledImpl

SHAPES = [(), (1,), (7,), (3, 5), (64,)]
STEPS = 21


@pytest.mark.slow
# By default only tensors of 65,536+ elements get compiled calls (the rest take the
# foreach path); lower the threshold so that every tensor (1), or a mix (8), is compiled.
@pytest.mark.parametrize("min_numel", [1, 8])
def test_compiled_matches_reference_for_each_variant(
    reference: Any, ref_config: Any, min_numel: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    weights[2].zero_()
    grads: list[list[torch.Tensor | None]] = [
        [
            None if (i == 1 and s % 3 == 0) else torch.randn(sh, generator=gen)
            for i, sh in enumerate(SHAPES)
        ]
        for s in range(STEPS)
    ]
    variants = [
        ref_config(lr=0.05),
        ref_config(lr=0.05, decoupled=False, weight_decay=0.1, bias_correction=False),
        ref_config(lr=0.05, max_grad_norm=0.5, ratio_bounds=(0.01, 10.0), adaptation=True),
    ]
    for cfg in variants:
        params = [w.clone().requires_grad_() for w in weights]
        opt = Lamb(params, impl="compiled", **cfg.lamb_kwargs())
        opt._impl = CompiledImpl(min_numel=min_numel)
        for row in grads:
            for p, g in zip(params, row, strict=True):
                p.grad = g
            opt.step()
        want = reference(weights, grads, [cfg], [0] * len(SHAPES))
        for i, (p, w) in enumerate(zip(params, want, strict=True)):
            torch.testing.assert_close(
                p.detach().double(), w, rtol=2e-6, atol=2e-6, msg=lambda m, i=i: f"param {i}: {m}"
            )


@pytest.mark.slow
def test_compiled_falls_back_for_non_contiguous_params(reference: Any, ref_config: Any) -> None:
    base = torch.randn(4, 6)
    weight = base.t()  # a non-contiguous parameter
    p = weight.clone().t().contiguous().t().requires_grad_()  # same strides as weight
    assert not p.is_contiguous()
    opt = Lamb([p], lr=0.05, impl="compiled")
    g = torch.randn(6, 4)
    p.grad = g
    opt.step()
    want = reference([weight], [[g]], [ref_config(lr=0.05)], [0])
    torch.testing.assert_close(p.detach().double(), want[0], rtol=2e-6, atol=2e-6)


@pytest.mark.slow
def test_many_configurations_in_one_process_do_not_exhaust_recompiles() -> None:
    # Each combination of switches used to be a recompile of the same function;
    # past dynamo's limit (8) fullgraph=True made the ninth a hard error.
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(s, generator=gen) for s in [(5, 7), (33,)]]
    grads = [[torch.randn(w.shape, generator=gen) for w in weights] for _ in range(2)]
    configs = [
        {
            "bias_correction": bc,
            "decoupled_weight_decay": dec,
            "decay_in_update": in_update,
            "max_grad_norm": clip,
            "step_size_bias_correction": step_size,
            "weight_decay": 0.1,
        }
        for bc in (True, False)
        for dec, in_update in ((True, True), (True, False), (False, True))
        for clip in (None, 0.5)
        for step_size in (False, True)
    ]
    assert len(configs) == 24
    for kwargs in configs:
        finals = []
        for impl in ("compiled", "foreach"):
            params = [w.clone().requires_grad_() for w in weights]
            opt = Lamb(params, lr=0.05, impl=impl, **kwargs)  # type: ignore[arg-type]
            if impl == "compiled":
                opt._impl = CompiledImpl(min_numel=1)
            for row in grads:
                for p, g in zip(params, row, strict=True):
                    p.grad = g
                opt.step()
            finals.append([p.detach() for p in params])
        for a, b in zip(*finals, strict=True):
            torch.testing.assert_close(
                a, b, rtol=2e-6, atol=2e-6, msg=lambda m, k=kwargs: f"{k}: {m}"
            )
