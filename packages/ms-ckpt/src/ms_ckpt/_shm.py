"""Names of the host-buffer segments, and the sweep of segments whose owner is dead.

Normally the trainer unlinks its segment (``finalize``, exit) and, when the trainer
alone is killed, its ``multiprocessing`` resource tracker does. When the whole process
tree is SIGKILLed (a job scheduler ending a job) the tracker dies too, and a segment of
about 1.25x the state stays in /dev/shm until reboot. So every segment is named after
its owner, ``ms_ckpt_<pid namespace>_<pid>_<start time>_<random>``, and a process about
to create one first unlinks every ``ms_ckpt_`` segment of its pid namespace whose owner
is gone. The start time tells a recycled pid from the owner; a segment of another pid
namespace (a container sharing /dev/shm) is never touched, since its pid means nothing
here. Linux only (/proc); elsewhere segments get a random name and nothing is swept.

Torch-free: the writer process imports this package's stage-2 modules only.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid

SHM_DIR = "/dev/shm"
PREFIX = "ms_ckpt_"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)_(\d+)_(\d+)_[0-9a-f]+$")


def process_starttime(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses; the fields follow the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def segment_name() -> str:
    """A fresh segment name that records this process as its owner (when it can)."""
    token = uuid.uuid4().hex[:12]
    ns, pid = pid_namespace(), os.getpid()
    start = process_starttime(pid)
    if ns is None or start is None:
        return f"{PREFIX}x_{token}"  # not sweepable: no /proc to prove the owner dead
    return f"{PREFIX}{ns}_{pid}_{start}_{token}"


def owner_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` may still use it. Unknown
    owners (another pid namespace, a name this module did not make) count as alive."""
    m = _NAME_RE.match(name)
    if m is None or int(m.group(1)) != pid_namespace():
        return True
    pid, start = int(m.group(2)), int(m.group(3))
    return process_starttime(pid) == start


def sweep_stale() -> list[str]:
    """Unlink ms-ckpt segments whose owner is dead; return their names.

    Only the owner needs the name: a writer still attached to a swept segment keeps its
    mapping (unlink removes the name, not the pages), and it stops anyway once it sees
    its trainer gone. Segments of other users (no permission) are left alone.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(PREFIX) and not owner_alive(name):
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
    return removed
