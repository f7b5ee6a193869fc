"""What the tests inject into the stage-2 writer process: hooks
(``Checkpointer(hook=...)``) and a filesystem that fails its writes (``fs=...``).

The writer unpickles them by module name (the tests put this folder on ``sys.path`` and
the writer inherits it). This module imports no torch, so that the writer does not
import it either (``test_checkpointer`` checks that it does not).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from collections.abc import Collection
from typing import Any

from fsspec.implementations.local import LocalFileOpener, LocalFileSystem


class PauseAt:
    """Hold stage 2 at ``point`` for ``seconds`` (on ``steps`` only, if given), ending
    early once the trainer that built this hook is gone, so that a test can kill a
    process while the writer sits at that point."""

    def __init__(self, point: str, seconds: float, steps: Collection[int] | None = None) -> None:
        self.point, self.seconds = point, seconds
        self.steps = None if steps is None else frozenset(steps)
        self.trainer = os.getpid()

    def _trainer_alive(self) -> bool:
        # In the writer the trainer is the parent; with stage2="inline" it is this process.
        return self.trainer in (os.getpid(), os.getppid())

    def __call__(self, point: str, step: int) -> None:
        if point != self.point or (self.steps is not None and step not in self.steps):
            return
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline and self._trainer_alive():
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


class FailAt:
    """Fail stage 2 at ``point`` (on ``steps`` only, if given) with ``OSError(err)``, as a
    full disk there would."""

    def __init__(
        self, point: str, steps: Collection[int] | None = None, err: int = errno.ENOSPC
    ) -> None:
        self.point, self.err = point, err
        self.steps = None if steps is None else frozenset(steps)

    def __call__(self, point: str, step: int) -> None:
        if point == self.point and (self.steps is None or step in self.steps):
            raise OSError(self.err, os.strerror(self.err), f"injected at {point!r}")


class RecordModules:
    """At the start of stage 2, write this process's pid and the torch modules it has
    imported to the JSON file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, point: str, step: int) -> None:
        if point == "stage2":
            torch = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
            report = {"pid": os.getpid(), "torch_modules": torch}
            with open(self.path, "w") as f:
                json.dump(report, f)


class _FaultyOpener(LocalFileOpener):  # type: ignore[misc]
    def __init__(self, *args: Any, flag: str, err: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._flag, self._err = flag, err

    def write(self, data: Any) -> int:
        if os.path.exists(self._flag):
            raise OSError(self._err, os.strerror(self._err), self.path)
        return int(self.f.write(data))


class FaultyFileSystem(LocalFileSystem):  # type: ignore[misc]
    """The local filesystem, except that every write raises ``OSError(err)`` while the
    file ``flag`` exists: a real error through the real writer's code path."""

    def __init__(self, flag: str, err: int = errno.ENOSPC, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flag, self.err = flag, err

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "w" in mode or "a" in mode:
            return _FaultyOpener(path, mode, fs=self, flag=self.flag, err=self.err, **kwargs)
        return super()._open(path, mode, block_size, **kwargs)
