"""Facts about this process's machine and threads, for heartbeats and stack dumps, and
kernel names for ms-health's own threads.

The facts are read on the heartbeat sender's thread, never in the training loop.
Torch is never imported from here: GPU facts are read only when the training process
has imported torch itself and CUDA is available.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

__all__ = [
    "KERNEL_NAME_PREFIX",
    "cpu_facts",
    "gpu_facts",
    "host_name",
    "name_thread",
    "named",
    "thread_stacks",
]

#: What every ms-health thread's kernel name starts with (``top -H``, ``ps -L``, and
#: ``/proc/<pid>/task/<tid>/comm``, where a benchmark adds up their CPU).
KERNEL_NAME_PREFIX = "ms-health-"


def name_thread(role: str) -> None:
    """Name the calling thread ``ms-health-<role>`` for the kernel as well (15 bytes
    at most, Linux; nothing elsewhere). Python names its threads only for itself: the
    kernel would show each as its process's name, ``python``."""
    name = (KERNEL_NAME_PREFIX + role)[:15]
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name)
    except OSError:  # not Linux, or no /proc
        pass


def named(role: str, target: Callable[..., None]) -> Callable[..., None]:
    """``target`` for a thread that first names itself (:func:`name_thread`)."""

    def run(*args: Any, **kwargs: Any) -> None:
        name_thread(role)
        target(*args, **kwargs)

    return run


def host_name() -> str:
    """This machine's name as the heartbeat's ``host`` (never empty)."""
    # short enough that "<host>/<GROUP_RANK>" fits the record's 256 chars
    return (socket.gethostname() or "localhost")[:200]


def cpu_facts() -> dict[str, Any]:
    """CPU model, logical cores and total memory, from /proc where it exists."""
    facts: dict[str, Any] = {"cpu_cores": os.cpu_count() or 0}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()[:200]
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    facts["memory_bytes"] = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    return facts


def gpu_facts(local_rank: int) -> dict[str, Any] | None:
    """The GPU this rank most likely drives, or None where that cannot be known yet.

    Returns ``{}`` once it is known that there is none (torch imported, no CUDA), so the
    caller can stop asking. The device is ``local_rank`` modulo the visible devices,
    torchrun's convention; the sender's thread cannot see the training thread's
    current device.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return None  # the loop may import it later
    try:
        if not torch.cuda.is_available():
            return {}
        count = torch.cuda.device_count()
        index = local_rank % count
        props = torch.cuda.get_device_properties(index)
        return {
            "gpu_model": str(props.name)[:200],
            "gpu_memory_bytes": int(props.total_memory),
            "gpu_index": index,
            "gpu_count": count,
        }
    except Exception:  # a broken driver must not stop heartbeats
        return {}


def thread_stacks() -> str:
    """Every Python thread's current stack, innermost call last, as one text."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        name = names.get(ident, "?")
        note = " (the heartbeat sender, answering this dump)" if ident == me else ""
        parts.append(f'Thread {ident:#x} "{name}"{note}, most recent call last:\n')
        parts.extend(traceback.format_stack(frame))
        parts.append("\n")
    return "".join(parts)
