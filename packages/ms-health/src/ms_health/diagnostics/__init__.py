"""Node diagnostics: is a suspect node fit to rejoin the job?

MegaScale tests a node the driver suspects (after a crash, a hang, a straggler) before
it goes back into the job: links inside the node and to its neighbours, and the devices
themselves. Here that is three checks, each returning a :class:`CheckResult`:

- :func:`collective_check`: an all-reduce across the group and an all-to-all inside the
  node, values verified, each bounded by a timeout (gloo on CPU, NCCL on GPUs);
- :func:`matmul_check`: a matmul against a float64 reference, and its throughput;
- :func:`memory_bandwidth_check`: host memory copy bandwidth.

:func:`diagnose_node` runs them in fresh processes on this node, bounded, and returns a
:class:`NodeReport`; ``python -m ms_health.diagnostics`` does the same from a shell and
exits 1 when the node fails. Nothing here imports torch until a check runs.
"""

from ms_health.diagnostics.collective import collective_check
from ms_health.diagnostics.compute import (
    MATMUL_TOLERANCE,
    matmul_check,
    matmul_error,
    memory_bandwidth_check,
)
from ms_health.diagnostics.config import DiagnosticsConfig
from ms_health.diagnostics.result import CheckResult, NodeReport, ProcessReport
from ms_health.diagnostics.runner import diagnose_node, parse_endpoint

__all__ = [
    "MATMUL_TOLERANCE",
    "CheckResult",
    "DiagnosticsConfig",
    "NodeReport",
    "ProcessReport",
    "collective_check",
    "diagnose_node",
    "matmul_check",
    "matmul_error",
    "memory_bandwidth_check",
    "parse_endpoint",
]
