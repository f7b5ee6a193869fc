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


# `make test` runs two pytest lanes side by side (see the Makefile). The jobs lane takes
# the slow tests under these paths: whole jobs (launchers, torchrun, ranks, faults). The
# rest lane takes everything else but the tests marked shm_dead_owner: those leave a
# dead process's /dev/shm segments on purpose and check them, and both lanes start
# processes that sweep such segments (a job's ranks, a Checkpointer, a NodeLoader), so
# they run alone after the lanes.
JOBS_LANE_PATHS = (
    "tests/test_dist.py",
    "tests/test_run_command.py",
    "packages/ms-health/tests/",
    "packages/ms-train/tests/",
)


def in_jobs_lane(item: pytest.Item, root: str) -> bool:
    if item.get_closest_marker("shm_dead_owner") is not None:
        return False
    where = os.path.relpath(item.path, root).replace(os.sep, "/")
    return item.get_closest_marker("slow") is not None and where.startswith(JOBS_LANE_PATHS)


# First, so that `-m lane_jobs` sees the marker it adds.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = str(config.rootpath)
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available here")
    for item in items:
        if in_jobs_lane(item, root):
            item.add_marker(pytest.mark.lane_jobs)
        if not _HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip)
