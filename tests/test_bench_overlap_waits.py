"""The overlap benchmark's wait breakdown, on event logs written by hand: what it adds up
is what ms-parallel spent waiting and stepping, each span counted once."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from _workspace import ROOT

from ms_parallel.events import EventLog


@pytest.fixture(scope="module")
def overlap() -> ModuleType:
    path = ROOT / "tools" / "bench" / "parallel" / "overlap.py"
    spec = importlib.util.spec_from_file_location("bench_overlap", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_waits_add_up_per_op_type_across_buckets(overlap: ModuleType) -> None:
    log = EventLog()
    log("reduce_scatter", "wait_begin", 1.0, chunk=1, bucket=1)
    log("reduce_scatter", "wait_end", 1.5, chunk=1, bucket=1)
    log("reduce_scatter", "wait_begin", 1.5, chunk=0, bucket=0)
    log("reduce_scatter", "wait_end", 1.75, chunk=0, bucket=0)
    log("all_gather", "wait_begin", 3.0, chunk=0, bucket=0)
    log("all_gather", "wait_end", 3.125, chunk=0, bucket=0)
    # the latency backend's own events carry no wait: not counted
    log("all_gather", "issue", 2.0, latency=0.1, bytes=8)
    log("all_gather", "complete", 2.1, latency=0.1, bytes=8)
    assert overlap.waited(log) == {"reduce_scatter": 0.75, "all_gather": 0.125}


def test_chunks_stepped_in_one_call_count_their_span_once(overlap: ModuleType) -> None:
    """With prefetch_chunks=p, ZeroDataParallel.step steps the chunks after p + 1 in one
    call and reports a begin and an end for each of them at the same moments."""
    log = EventLog()
    log("optimizer", "compute_begin", 1.0, chunk=0)
    log("optimizer", "compute_end", 1.25, chunk=0)
    for k in (1, 2, 3):
        log("optimizer", "compute_begin", 2.0, chunk=k)
    for k in (1, 2, 3):
        log("optimizer", "compute_end", 2.5, chunk=k)
    # a forward chunk's compute is not the optimizer's
    log("chunk", "compute_begin", 3.0, chunk=0)
    log("chunk", "compute_end", 4.0, chunk=0)
    assert overlap.waited(log) == {"optimizer": 0.75}


def test_a_wait_cut_off_by_the_log_is_not_counted(overlap: ModuleType) -> None:
    """The log is cleared after the warm-up steps: an end without its begin counts
    nothing, and so does a begin without its end."""
    log = EventLog()
    log("all_gather", "wait_end", 1.0, chunk=0, bucket=0)
    log("optimizer", "compute_end", 1.0, chunk=2)
    log("reduce_scatter", "wait_begin", 2.0, chunk=0, bucket=0)
    assert overlap.waited(log) == {}
