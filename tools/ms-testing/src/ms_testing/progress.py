"""Watch a run's progress from outside: the steps its ``metrics.jsonl`` gains, and when.

ms-train writes one JSON line per logged step (``train.log_every = 1`` logs each). A
fault-injection test or benchmark polls the file and stamps each new step with the
time it first saw it (``time.monotonic()``), which is what "time from the fault to
regained progress" is measured with: the first step beyond the furthest one reached
before the fault.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["Progress"]


class Progress:
    """Tail ``metrics.jsonl`` under ``out_dir``; call :meth:`poll` often."""

    def __init__(self, out_dir: str | Path) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self._offset = 0
        self._partial = b""
        self._file: tuple[int, int] | None = None
        #: (step, monotonic time first seen, record) in the order written; a step trained
        #: again after a restart appears again.
        self.seen: list[tuple[int, float, dict[str, object]]] = []

    def poll(self) -> int:
        """Read what was appended; the number of new records."""
        try:
            with open(self.path, "rb") as f:
                ident = os.fstat(f.fileno())
                if (ident.st_ino, ident.st_dev) != self._file or ident.st_size < self._offset:
                    # A resumed run rewrites the file (its records up to the resume step,
                    # under a new inode): read it again from the start. Steps seen again
                    # are recorded again, with the new time.
                    self._file, self._offset, self._partial = (ident.st_ino, ident.st_dev), 0, b""
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return 0
        now = time.monotonic()
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for the next poll
        new = 0
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                self.seen.append((record["step"], now, record))
                new += 1
        return new

    @property
    def furthest(self) -> int:
        """The highest step seen so far (0 before any)."""
        return max((s for s, _, _ in self.seen), default=0)

    def first_beyond(self, step: int, after: float) -> float | None:
        """When a step above ``step`` was first seen at or after ``after``, or None."""
        for s, t, _ in self.seen:
            if s > step and t >= after:
                return t
        return None

    def wait_for(self, step: int, timeout: float, alive: object = None) -> float:
        """Poll until a step >= ``step`` is seen; its time. ``alive()``, when given, is
        checked on the way (a job that ended stops the wait). Raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            for s, t, _ in self.seen:
                if s >= step:
                    return t
            if alive is not None and not alive():  # type: ignore[operator]
                raise TimeoutError(f"the job ended before step {step} ({self.path})")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no step {step} in {timeout} s ({self.path})")
            time.sleep(0.02)
