"""Checkpoint saves that fail softly: a failed save is logged and counted and training
goes on; ``checkpoint.max_failures`` failed saves in a row end the run.

A failed stage 2 (ENOSPC, EACCES, a dead writer) leaves the committed checkpoints as
they were, and the model in memory is intact, so the run loses nothing by going on: the
next save may well succeed (space freed, a storage hiccup over). A run that cannot save
at all should not train for days on work it cannot keep, hence the limit.

A save's outcome is known only when its stage 2 ends; it is collected at the next save
(which would wait for it anyway) and at the end. With several ranks every rank takes the
same verdict: rank 0 commits a step only when every rank's part is written, so its
verdict is the step's, and any rank's own failure is gathered too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ms_ckpt import Checkpointer, CheckpointWriteError, SaveHandle
from ms_train.errors import JobError

__all__ = ["SaveFailuresError", "Saves"]


class SaveFailuresError(JobError):
    """``checkpoint.max_failures`` checkpoint saves in a row failed."""


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]


class Saves:
    """The saves of one training run through ``checkpointer``.

    Args:
        checkpointer: saves and commits.
        max_failures: failed saves in a row that end the run (``checkpoint.max_failures``).
        log: where failures and retries are reported (rank 0's stream).
        group: the process group whose ranks save together (None: this process alone);
            every rank's outcome is gathered over it.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        *,
        max_failures: int,
        log: Callable[[str], None],
        group: Any = None,
    ) -> None:
        self.checkpointer = checkpointer
        self.max_failures = max_failures
        self.log = log
        self.group = group
        #: saves of this run that failed, in all
        self.failures = 0
        #: the steps of the failed saves since the last one that committed
        self.failed_in_a_row: list[int] = []
        self._pending: tuple[int, SaveHandle | None, str | None] | None = None

    @property
    def in_flight(self) -> SaveHandle | None:
        """The newest save's handle while its outcome is not collected yet, else None."""
        return None if self._pending is None else self._pending[1]

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Collect the previous save's outcome (raising after too many failures in a row),
        then start saving ``step`` (stage 1 now, stage 2 in the background)."""
        self.collect()
        try:
            self._pending = (step, self.checkpointer.save(step, state), None)
        except (CheckpointWriteError, OSError) as e:  # stage 1: host memory, /dev/shm
            self._pending = (step, None, f"saving step {step} failed in stage 1: {e}")

    def finish(self, state: Callable[[], dict[str, Any]]) -> None:
        """Wait for the last save. The final checkpoint is what a rerun resumes from, so a
        failed one is saved again, until it commits or fails ``max_failures`` times in a
        row counting the failures before it (then ``SaveFailuresError``)."""
        while self._pending is not None:
            step = self._pending[0]
            if self.collect():
                return
            self.log(f"ms-train: saving the final checkpoint of step {step} again")
            self.save(step, state())

    def collect(self) -> bool:
        """Wait for the save in flight and count its outcome (True: committed, or nothing
        was in flight). Raises ``SaveFailuresError`` at ``max_failures`` in a row."""
        if self._pending is None:
            return True
        step, handle, error = self._pending
        self._pending = None
        if handle is not None:
            try:
                handle.wait()
            except CheckpointWriteError as e:
                error = str(e)
        errors = self._gather(error)
        if not any(errors):
            self.failed_in_a_row.clear()
            return True
        # Rank 0's error is the step's (it says which rank failed); else the first one.
        rank, message = next((r, e) for r, e in enumerate(errors) if e)
        reason = _first_line(message) if rank == 0 else f"rank {rank}: {_first_line(message)}"
        self.failures += 1
        self.failed_in_a_row.append(step)
        latest = self.checkpointer.latest_step()
        newest = (
            "none is committed yet"
            if latest is None
            else f"the newest committed is step {latest} under {self.checkpointer.url}"
        )
        n, limit = len(self.failed_in_a_row), self.max_failures
        if n >= limit:
            steps = ", ".join(map(str, self.failed_in_a_row))
            raise SaveFailuresError(
                f"{n} checkpoint saves in a row failed (steps {steps}; checkpoint.max_failures "
                f"= {limit}), the last with: {reason}. Of the checkpoints, {newest}; fix the "
                "cause and rerun to resume from it"
            )
        self.log(
            f"ms-train: warning: {reason} ({n} failed save(s) in a row; the run stops at "
            f"checkpoint.max_failures = {limit}; of the checkpoints, {newest}); training "
            "goes on"
        )
        return False

    def _gather(self, error: str | None) -> list[str | None]:
        """Every rank's error (None: its part of the save went through), in rank order."""
        if self.group is None:
            return [error]
        out: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, error, group=self.group)
        return out
