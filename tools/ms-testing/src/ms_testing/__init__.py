"""Dev-only test harness shared by the ms packages' tests.

Not a dependency of any published package; installed into the development
environment by ``make test``.
"""

from ms_testing.dist import RankFailure, RankOutcome, RunReport, launch, run_ranks
from ms_testing.fs import (
    COUNTER_ENV,
    CountingFileSystem,
    ReadCounts,
    read_counts,
    reset_counts,
)
from ms_testing.triton import interpreter_enabled, use_triton_interpreter

__all__ = [
    "COUNTER_ENV",
    "CountingFileSystem",
    "RankFailure",
    "RankOutcome",
    "ReadCounts",
    "RunReport",
    "interpreter_enabled",
    "launch",
    "read_counts",
    "reset_counts",
    "run_ranks",
    "use_triton_interpreter",
]
