"""The stale-segment sweep on real /dev/shm files and real processes: it unlinks the
segments of a dead owner (or of a recycled pid), never those of a live owner, of
another pid namespace, or of another package."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ms_ckpt import _shm

SHM = Path(_shm.SHM_DIR)
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm (Linux)")


def dead_process() -> tuple[int, int]:
    """The pid and start time of a process that has exited and been reaped."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    start = _shm.process_starttime(proc.pid)
    assert start is not None
    proc.communicate(timeout=60)
    return proc.pid, start


@pytest.mark.shm_dead_owner
def test_sweep_removes_only_segments_whose_owner_is_gone() -> None:
    ns = _shm.pid_namespace()
    assert ns is not None
    me, my_start = os.getpid(), _shm.process_starttime(os.getpid())
    assert my_start is not None
    dead, dead_start = dead_process()
    tag = uuid.uuid4().hex[:8]
    names = {
        "dead owner": f"ms_ckpt_{ns}_{dead}_{dead_start}_{tag}",
        "recycled pid": f"ms_ckpt_{ns}_{me}_{my_start - 1}_{tag}",
        "live owner": f"ms_ckpt_{ns}_{me}_{my_start}_{tag}",
        "other pid namespace": f"ms_ckpt_{ns + 1}_{dead}_{dead_start}_{tag}",
        "not ours": f"ms_ckptx_{ns}_{dead}_{dead_start}_{tag}",
        "unknown owner": f"ms_ckpt_x_{tag}",
    }
    for name in names.values():
        (SHM / name).write_bytes(b"\0" * 64)
    try:
        removed = _shm.sweep_stale()
        left = {what for what, name in names.items() if (SHM / name).exists()}
    finally:
        for name in names.values():
            (SHM / name).unlink(missing_ok=True)
    assert left == {"live owner", "other pid namespace", "not ours", "unknown owner"}
    assert {names["dead owner"], names["recycled pid"]} <= set(removed)


def test_segment_name_records_this_process() -> None:
    name = _shm.segment_name()
    assert name.startswith(_shm.PREFIX) and _shm.owner_alive(name)
    ns, pid, start = name.removeprefix(_shm.PREFIX).split("_")[:3]
    assert (int(ns), int(pid)) == (_shm.pid_namespace(), os.getpid())
    assert int(start) == _shm.process_starttime(os.getpid())
