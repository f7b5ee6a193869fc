"""The fused Triton kernels against the float64 reference.

On CPU they run under Triton's interpreter (the workspace conftest sets
TRITON_INTERPRET=1 before any kernel is defined), about 2 ms per program, so
the tensors are small and the block is 16 elements: several blocks per tensor,
a ragged last block, and a 0-d tensor all show up in a grid of a few programs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ms_optim import Lamb

pytest.importorskip("triton")

from ms_optim._triton_lamb import TritonImpl

SHAPES = [(), (3,), (40,), (2, 5)]
STEPS = 21


def problem(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor | None]]]:
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in SHAPES]
    weights[1].zero_()  # zero norm: ratio 1
    grads: list[list[torch.Tensor | None]] = [
        [
            None if (i == 3 and s == 2) else torch.randn(sh, generator=gen)
            for i, sh in enumerate(SHAPES)
        ]
        for s in range(STEPS)
    ]
    return weights, grads


def run(
    weights: list[torch.Tensor],
    grads: list[list[torch.Tensor | None]],
    kwargs: dict[str, Any],
    device: str = "cpu",
    block_size: int = 16,
) -> list[torch.Tensor]:
    params = [w.to(device).clone().requires_grad_() for w in weights]
    opt = Lamb(params, impl="triton", **kwargs)
    opt._impl = TritonImpl(block_size=block_size)  # small blocks: several per tensor
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = None if g is None else g.to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


CONFIGS = {
    "paper": {},
    "l2-no-bias-correction": {"decoupled": False, "weight_decay": 0.1, "bias_correction": False},
    "clipped-bounded": {
        "max_grad_norm": 0.5,
        "ratio_bounds": (0.01, 10.0),
        "phi_bounds": (0.5, 2.0),
    },
    "no-adaptation": {"adaptation": False},
}


@pytest.mark.parametrize(
    "name",
    # Under the interpreter each case takes about a second: one in the fast tier.
    [n if n == "paper" else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CONFIGS)],
)
def test_triton_matches_reference(reference: Any, ref_config: Any, name: str) -> None:
    cfg = ref_config(lr=0.05, **CONFIGS[name])
    weights, grads = problem(1)
    got = run(weights, grads, cfg.lamb_kwargs())
    want = reference(weights, grads, [cfg], [0] * len(SHAPES))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            a.double(), b, rtol=2e-6, atol=2e-6, msg=lambda m, i=i: f"param {i}: {m}"
        )


@pytest.mark.slow
def test_triton_low_precision_goes_through_fp32_master(reference: Any, ref_config: Any) -> None:
    weights, grads = problem(2)
    weights = [w.half().float() for w in weights]
    grads = [[None if g is None else g.half().float() for g in row] for row in grads]
    params = [w.half().requires_grad_() for w in weights]
    opt = Lamb(params, lr=0.05, impl="triton", master_weights=True)
    opt._impl = TritonImpl(block_size=16)
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = None if g is None else g.half()
        opt.step()
    want = reference(weights, grads, [ref_config(lr=0.05)], [0] * len(SHAPES))
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(opt.state[p]["master"].double(), w, rtol=2e-6, atol=2e-6)
        assert torch.equal(p.detach(), opt.state[p]["master"].half())


def test_block_size_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="block_size must be a power of two, got 24"):
        TritonImpl(block_size=24)


@pytest.mark.gpu
def test_triton_on_cuda_matches_foreach() -> None:
    weights, grads = problem(3)
    got = run(weights, grads, {"max_grad_norm": 1.0}, device="cuda", block_size=1024)
    params = [w.cuda().requires_grad_() for w in weights]
    opt = Lamb(params, max_grad_norm=1.0)
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = None if g is None else g.cuda()
        opt.step()
    for a, b in zip(got, params, strict=True):
        torch.testing.assert_close(a, b.detach().cpu(), rtol=1e-5, atol=1e-6)
