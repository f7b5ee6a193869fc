"""``impl="auto"``, the default: per device, the fastest implementation that runs there.

- CUDA: the fused Triton kernels when Triton imports (two launches per bucket),
  else foreach.
- CPU: ``torch.compile`` (two fused passes per large tensor) when inductor finds
  a C++ compiler, else foreach. On a GPT-like 61M-parameter step it is several
  times faster than foreach (README, "Measured numbers"); the price is the first
  step of a new model, which compiles (about 10 s for 61M parameters on an
  shared 2-core CPU, cached on disk after). Tensors under ``MIN_NUMEL`` (65,536)
  elements never compile, and a CPU bucket without a larger tensor goes to
  foreach without probing for a compiler (which imports inductor: seconds), so
  small models pay nothing.
- Anything else: foreach.

Every implementation computes the same step (the tests hold each to the float64
reference), so the choice changes speed, not results beyond round-off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ms_optim._bucket import Bucket, LambImpl
from ms_optim._compiled import MIN_NUMEL
from ms_optim._foreach import ForeachImpl

__all__ = ["AutoImpl", "has_cpp_compiler"]


def has_cpp_compiler() -> bool:
    """Whether inductor finds a C++ compiler, which ``torch.compile`` needs on CPU."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except (ImportError, RuntimeError, OSError):  # InvalidCxxCompiler is a RuntimeError
        return False
    return True


def _triton_impl() -> LambImpl | None:
    try:
        from ms_optim._triton_lamb import TritonImpl
    except ImportError:
        return None
    return TritonImpl()


class AutoImpl:
    """Dispatches each bucket to the implementation chosen for its device.

    ``cpu_compiler`` and ``triton`` probe whether the compiled and Triton paths
    can run; a probe runs once, at the first bucket on such a device.
    """

    def __init__(
        self,
        cpu_compiler: Callable[[], bool] = has_cpp_compiler,
        triton: Callable[[], LambImpl | None] = _triton_impl,
    ) -> None:
        self._cpu_compiler = cpu_compiler
        self._triton = triton
        self._chosen: dict[str, LambImpl] = {}
        self._foreach = ForeachImpl()

    def pick(self, device: torch.device) -> LambImpl:
        """The implementation used for tensors on ``device``."""
        impl = self._chosen.get(device.type)
        if impl is None:
            impl = self._choose(device)
            self._chosen[device.type] = impl
        return impl

    def _choose(self, device: torch.device) -> LambImpl:
        if device.type == "cuda":
            triton = self._triton()
            if triton is not None:
                return triton
        elif device.type == "cpu" and self._cpu_compiler():
            from ms_optim._compiled import CompiledImpl

            return CompiledImpl()
        return ForeachImpl()

    def moments(self, b: Bucket) -> tuple[Any, torch.Tensor, torch.Tensor]:
        device = b.weights[0].device if b.weights else torch.device("cpu")
        if device.type == "cpu" and all(w.numel() < MIN_NUMEL for w in b.weights):
            impl: LambImpl = self._foreach  # what CompiledImpl would do with them anyway
        else:
            impl = self.pick(device)
        carry, w_sq, u_sq = impl.moments(b)
        return (impl, carry), w_sq, u_sq

    def apply(self, b: Bucket, carry: Any, ratios: torch.Tensor) -> None:
        impl, inner = carry
        impl.apply(b, inner, ratios)
