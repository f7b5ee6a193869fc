"""Small helpers the benchmark scripts share: machine facts and peak-memory probes.

Peak memory on CPU comes from the kernel's own accounting: ``/proc/self/status``
``VmHWM`` (the resident high-water mark) after writing ``5`` to
``/proc/self/clear_refs``, which resets that mark (Linux only). Run each probe in a
fresh process with ``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors go back
to the kernel at once and the mark sees every case's own temporaries.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "probe_env", "reset_peak", "run_probe", "vm_bytes"]


def vm_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    if match is None:
        raise KeyError(f"no {key} in /proc/self/status")
    return int(match.group(1)) * 1024


def reset_peak() -> int:
    """Reset the resident high-water mark; return the resident bytes now."""
    Path("/proc/self/clear_refs").write_text("5")
    return vm_bytes("VmRSS")


def probe_env() -> dict[str, str]:
    """The environment for a peak-memory subprocess (see the module docstring)."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def run_probe(argv: list[str], timeout: float = 900.0) -> str | None:
    """Run ``python argv...`` as a probe; its last stdout line, or None (error printed)."""
    proc = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=probe_env(),
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        print(
            f"probe {argv} failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr
        )
        return None
    return lines[-1]


def machine_info(**versions: str) -> dict[str, Any]:
    """CPU, cores, memory, platform and the given package versions, for a JSON record."""
    import torch

    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "load_average": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **versions,
    }
