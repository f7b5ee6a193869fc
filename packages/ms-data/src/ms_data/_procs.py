"""Which process is which, across unrelated processes of one host (Linux /proc).

A pid alone does not name a process for good: pids are recycled. The pair (pid,
start time since boot) does; the boot id tells a segment left over from before a
reboot (on a /dev/shm that survived it); the pid namespace tells whether a pid
recorded by another process means anything here (containers sharing /dev/shm).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["boot_id", "pid_namespace", "process_alive", "process_starttime"]


def process_starttime(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``), or None.

    Together with the pid it names a process for good: a recycled pid has another
    start time. None when the process is gone, a zombie, or /proc is missing.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the fields follow the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def process_alive(pid: int, starttime: int = 0) -> bool:
    """Whether ``pid`` runs (not a zombie) and, if ``starttime`` is given, is that process."""
    if pid <= 0:
        return False
    if os.path.isdir("/proc"):
        now = process_starttime(pid)
        return now is not None and (starttime == 0 or now == starttime)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def boot_id() -> tuple[int, int]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            raw = bytes.fromhex(f.read().strip().replace("-", ""))
    except (OSError, ValueError):
        return (0, 0)
    hi, lo = np.frombuffer(raw[:16], np.int64)
    return int(hi), int(lo)


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
