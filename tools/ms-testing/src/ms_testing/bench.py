"""Small helpers the benchmark scripts share: machine facts, peak-memory probes, and a
confidence interval for a median of paired ratios.

Peak memory on CPU comes from the kernel's own accounting: ``/proc/self/status``
``VmHWM`` (the resident high-water mark) after writing ``5`` to
``/proc/self/clear_refs``, which resets that mark (Linux only). Run each probe in a
fresh process with ``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors go back
to the kernel at once and the mark sees every case's own temporaries.
"""

from __future__ import annotations

import math
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "cpu_seconds",
    "machine_info",
    "median_ci",
    "probe_env",
    "reset_peak",
    "run_probe",
    "vm_bytes",
]


def vm_bytes(key: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    if match is None:
        raise KeyError(f"no {key} in /proc/self/status")
    return int(match.group(1)) * 1024


def cpu_seconds(pid: int | str = "self", thread: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) or, given
    ``thread`` (a native thread id), of that thread alone: ``/proc``'s ``stat``."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    with open(path, "rb") as f:
        stat = f.read()
    # utime and stime, the 14th and 15th fields, counted after the ")" that ends the name
    fields = stat[stat.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """A distribution-free confidence interval for the median of ``values``:
    ``(low, high, coverage)``, the order statistics ``x(k)`` and ``x(n+1-k)`` with the
    largest ``k`` whose coverage, ``1 - 2 P(B <= k - 1)`` for ``B ~ Binomial(n, 1/2)``,
    is at least ``level`` (the sign test's interval: it assumes only independent
    values). With too few values for ``level`` it is the whole range, at the coverage
    that has."""
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"values must be finite numbers, got {v!r} at index {i}")
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("values must not be empty")

    def coverage(k: int) -> float:  # of [x(k), x(n+1-k)]: 1 - 2 P(B <= k - 1)
        return 1 - 2 * sum(math.comb(n, j) for j in range(k)) / (1 << n)

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)
