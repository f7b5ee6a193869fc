"""impl="auto", the default: which implementation each device gets."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ms_optim import Lamb
from ms_optim._auto import AutoImpl, has_cpp_compiler
from ms_optim._compiled import CompiledImpl
from ms_optim._foreach import ForeachImpl


@pytest.mark.slow  # the probe imports inductor and runs the compiler: seconds
def test_default_is_auto_and_cpu_gets_the_compiled_path_when_it_can_build() -> None:
    opt = Lamb([torch.zeros(3, requires_grad=True)])
    assert opt.impl == "auto"
    assert isinstance(opt._impl, AutoImpl)
    want = CompiledImpl if has_cpp_compiler() else ForeachImpl
    assert type(opt._impl.pick(torch.device("cpu"))) is want


def test_without_a_compiler_or_triton_auto_falls_back_to_foreach() -> None:
    auto = AutoImpl(cpu_compiler=lambda: False, triton=lambda: None)
    assert type(auto.pick(torch.device("cpu"))) is ForeachImpl
    assert type(auto.pick(torch.device("cuda"))) is ForeachImpl
    assert type(auto.pick(torch.device("meta"))) is ForeachImpl


def test_cuda_gets_triton_and_each_device_is_probed_once() -> None:
    probes: list[str] = []
    sentinel = ForeachImpl(cpu_tile=None)  # stands for the Triton impl: any LambImpl

    def triton() -> ForeachImpl:
        probes.append("triton")
        return sentinel

    def compiler() -> bool:
        probes.append("compiler")
        return True

    auto = AutoImpl(cpu_compiler=compiler, triton=triton)
    for _ in range(3):
        assert auto.pick(torch.device("cuda")) is sentinel
        assert type(auto.pick(torch.device("cpu"))) is CompiledImpl
    assert probes == ["triton", "compiler"]


def test_small_cpu_tensors_take_foreach_without_probing_for_a_compiler(
    reference: Any, ref_config: Any
) -> None:
    probes: list[str] = []

    def compiler() -> bool:
        probes.append("compiler")
        return True

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=gen) for s in [(8, 8), (5,)]]
    grads = [[torch.randn(w.shape, generator=gen) for w in weights] for _ in range(3)]
    params = [w.clone().requires_grad_() for w in weights]
    opt = Lamb(params, lr=0.05)
    opt._impl = AutoImpl(cpu_compiler=compiler)
    for row in grads:
        for p, g in zip(params, row, strict=True):
            p.grad = g
        opt.step()
    assert probes == []  # no inductor import for a model of small tensors
    want = reference(weights, grads, [ref_config(lr=0.05)], [0, 0])
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.detach().double(), w, rtol=2e-6, atol=2e-6)
