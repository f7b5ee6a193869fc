"""A one-line progress bar for ``ms-data build``, on a terminal only.

Written here rather than taken from tqdm so that ms-data depends on nothing beyond
fsspec and zstandard. It draws only when its stream is a TTY: logs, pipes and CI
output stay free of carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]

_WIDTH = 28
_INTERVAL_S = 0.1  # redraws per second are capped; a redraw costs a write syscall


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """Bytes of input done out of ``total``, documents and tokens so far, rate and ETA."""

    def __init__(
        self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = total
        self.done = 0
        self.docs = 0
        self.tokens = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._last_len = 0

    def update(self, nbytes: int, *, docs: int = 0, tokens: int = 0) -> None:
        self.done += nbytes
        self.docs += docs
        self.tokens += tokens
        now = time.monotonic()
        if self.enabled and now - self._last_draw >= _INTERVAL_S:
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._last_draw = now
        frac = 1.0 if self.total <= 0 else min(1.0, self.done / self.total)
        filled = int(frac * _WIDTH)
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        eta = _duration((self.total - self.done) / rate) if rate > 0 and frac < 1 else "-"
        line = (
            f"{frac:4.0%} [{'#' * filled}{'.' * (_WIDTH - filled)}] "
            f"{_mb(self.done)}/{_mb(self.total)} MB  {self.docs:,} docs  "
            f"{self.tokens:,} tokens  {_mb(rate)} MB/s  ETA {eta}"
        )
        pad = " " * max(0, self._last_len - len(line))
        self._last_len = len(line)
        self.stream.write("\r" + line + pad)
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line."""
        if self.enabled:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
