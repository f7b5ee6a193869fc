"""Workspace-wide pytest set-up, loaded before any test module.

On a machine without CUDA every Triton kernel must run in Triton's interpreter,
and Triton reads that choice when a kernel is defined, so it is made here,
before any package under test is imported.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from ms_testing import use_triton_interpreter

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    use_triton_interpreter()

# Interpreted kernels and process start-up make per-example times uneven, so no
# per-example deadline; CI draws the same examples every run.
settings.register_profile(
    "ms",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")),
    print_blob=True,
)
settings.load_profile("ms")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
