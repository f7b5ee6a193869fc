"""A stage-2 hook that fails chosen saves, for ``Checkpointer(hook=...)``.

The checkpoint writer process unpickles it by module name (the tests put this folder on
``sys.path`` and the writer inherits it); it imports no torch. It keeps its count in the
writer process, which outlives a failed save.
"""

from __future__ import annotations

import errno
import os


class FailSaves:
    """Fail stage 2 of the first ``times[step]`` saves of each listed step with ENOSPC,
    as a full disk would, before anything of the step is written."""

    def __init__(self, times: dict[int, int]) -> None:
        self.left = dict(times)

    def __call__(self, point: str, step: int) -> None:
        if point == "stage2" and self.left.get(step, 0) > 0:
            self.left[step] -= 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"injected, step {step}")
