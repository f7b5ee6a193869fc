"""The foreach path's CPU tiling (small tensors packed, large ones cut) changes no result.

Production tiles are 2^20 elements, far beyond test sizes; a 7-element tile makes
every shape here cross tile boundaries, and ``None`` runs the untiled path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ms_optim import Lamb
from ms_optim._foreach import ForeachImpl

SHAPES = [(), (1,), (7,), (3, 5), (2, 9), (64,), (5,)]
STEPS = 21


@pytest.mark.parametrize(
    ("tile", "dtype"),
    [
        (7, torch.float32),
        (None, torch.float32),
        (None, torch.float64),
        # Tiny tiles mean many small ops: seconds each.
        pytest.param(7, torch.float64, marks=pytest.mark.slow),
        pytest.param(3, torch.float64, marks=pytest.mark.slow),
        pytest.param(3, torch.float32, marks=pytest.mark.slow),
    ],
)
def test_tiled_foreach_matches_reference(
    reference: Any, ref_config: Any, tile: int | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]
    weights[3].zero_()
    grads: list[list[torch.Tensor | None]] = [
        [
            None if (i == 1 and s % 3 == 0) else torch.randn(sh, generator=gen, dtype=torch.float64)
            for i, sh in enumerate(SHAPES)
        ]
        for s in range(STEPS)
    ]
    variants = [
        ref_config(lr=0.05),
        ref_config(lr=0.05, decoupled=False, weight_decay=0.1, bias_correction=False),
        ref_config(lr=0.05, max_grad_norm=0.5, ratio_bounds=(0.01, 10.0), phi_bounds=(0.5, 3.0)),
    ]
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-6, "atol": 2e-6}
    for cfg in variants:
        params = [w.to(dtype, copy=True).requires_grad_() for w in weights]
        opt = Lamb(params, impl="foreach", **cfg.lamb_kwargs())
        opt._impl = ForeachImpl(cpu_tile=tile)
        for row in grads:
            for p, g in zip(params, row, strict=True):
                p.grad = None if g is None else g.to(dtype)
            opt.step()
        want = reference(weights, grads, [cfg], [0] * len(SHAPES))
        for i, (p, w) in enumerate(zip(params, want, strict=True)):
            torch.testing.assert_close(
                p.detach().double(), w, **tol, msg=lambda m, i=i: f"param {i}: {m}"
            )
