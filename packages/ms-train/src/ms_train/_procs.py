"""The launcher's process tree: ranks that die with it, and finding what is left.

torchrun's agent starts each rank in a session of its own, so a signal to the
launcher's process group (a terminal's Ctrl-C, ``kill -9 -PGID``) never reaches the
ranks, and a dead launcher leaves them training as orphans. A rank therefore asks the
kernel for SIGKILL when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), and where
that is not available a thread watches its parent pid instead. Each rank's helpers (the
ms-data reader, the ms-ckpt writer) watch their own parent, the rank, and unlink their
shared memory when it is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from pathlib import Path

__all__ = ["children", "die_with_parent", "environ", "session_members", "starttime"]

_PR_SET_PDEATHSIG = 1
_WATCH_EVERY_S = 0.5


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when ``parent`` (its parent now) dies.

    A parent already gone (the launcher died while this process started) ends this
    process at once. The parent-death signal fires when the *thread* that started the
    process exits; the launcher's agent thread outlives its ranks.
    """
    armed = False
    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
    if not armed:
        threading.Thread(target=_watch, args=(parent,), name="ms-train-parent", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_WATCH_EVERY_S)
    os.kill(os.getpid(), signal.SIGKILL)


def children(pid: int | None = None) -> list[int]:
    """The direct children of ``pid`` (default: this process), from /proc."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):  # a child is listed by its forker
            path = f"/proc/{pid}/task/{tid}/children"
            with contextlib.suppress(OSError, ValueError), open(path, "rb") as f:
                found.update(int(p) for p in f.read().split())
    return sorted(found)


def starttime(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot), which tells a reused pid apart;
    None once it is gone or dead (a zombie not yet reaped runs no more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def environ(pid: int) -> dict[bytes, bytes]:
    """The environment process ``pid`` was started with (empty when unreadable)."""
    with contextlib.suppress(OSError):
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return dict(p.split(b"=", 1) for p in pairs if b"=" in p)
    return {}


def worker_children() -> list[int]:
    """This process's children that torch elastic started as workers (their environment
    names the elastic run); not helpers of its own, such as node diagnostics."""
    return [pid for pid in children() if b"TORCHELASTIC_RUN_ID" in environ(pid)]


def session_members(sessions: set[int]) -> list[int]:
    """Live processes (zombies excluded) in any of ``sessions``."""
    members: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields: state, ppid, pgrp, session, ...
        if fields[0] not in ("Z", "X") and int(fields[3]) in sessions:
            members.append(int(stat.parent.name))
    return members
