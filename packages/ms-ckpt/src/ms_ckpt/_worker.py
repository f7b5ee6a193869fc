"""The long-lived stage-2 writer process.

Started as a fresh interpreter (``subprocess``, not ``fork``: forking a process with
CUDA or many threads is unsafe; and not ``multiprocessing``'s spawn, which re-imports the
trainer's main module and so fails in scripts without an ``if __name__ == "__main__"``
guard). It talks over a socket pair wrapped as a ``multiprocessing`` connection; the
first message is the pickled filesystem, root and stage-2 hook. It imports no torch
(``ms_ckpt/__init__`` loads the torch-side modules lazily): a writer starts in a
fraction of the time.

It maps the trainer's host buffer by shared-memory name and writes one job at a
time, answering ``("ok", step)`` or ``("error", step, message, errno)``. When the trainer
dies it stops without committing: an orphan that went on to commit could move ``latest``
under a restarted job.
"""

from __future__ import annotations

import os
import sys
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any

from ms_ckpt._layout import ParentGone
from ms_ckpt._writer import Hook, describe, run_job


def run(fd: int, parent_pid: int, nice: int = 0) -> None:
    """Entry point of the writer interpreter: ``fd`` is its end of the socket pair;
    ``nice`` lowers its CPU priority below the trainer's."""
    if nice:
        os.nice(nice)
    conn = Connection(fd)
    try:
        fs, root, hook = conn.recv()
    except (EOFError, OSError):
        return
    main(conn, fs, root, parent_pid, hook)


def main(conn: Connection, fs: Any, root: str, parent_pid: int, hook: Hook | None) -> None:
    segments: dict[str, shared_memory.SharedMemory] = {}

    def alive() -> bool:
        return os.getppid() == parent_pid

    try:
        while True:
            try:
                job = conn.recv()
            except (EOFError, OSError):
                return
            if job is None:
                return
            seg = segments.get(job["pool"])
            if seg is None and job["pool"]:
                for old in segments.values():  # the trainer grew its pool: drop the old map
                    old.close()
                segments.clear()
                seg = segments[job["pool"]] = _attach(job["pool"])
            buf = seg.buf if seg is not None and seg.buf is not None else memoryview(b"")
            try:
                run_job(fs, root, job, buf, alive, hook)
            except ParentGone:
                return
            except Exception as e:
                conn.send(("error", job["step"], describe(e), getattr(e, "errno", None)))
            else:
                conn.send(("ok", job["step"]))
            del buf
    finally:
        for seg in segments.values():
            seg.close()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map the trainer's segment without adopting it: the trainer unlinks it. (Before
    Python 3.13 attaching registers it with this interpreter's resource tracker, which
    would unlink it when the writer exits.)"""
    seg = shared_memory.SharedMemory(name=name)
    if sys.version_info < (3, 13):
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg
