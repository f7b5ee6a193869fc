"""Stopping a run on a signal: finish the step, save, account for it, exit.

A cluster scheduler sends SIGTERM some time before it preempts a job, and a person
presses Ctrl-C; both mean "finish the step, commit a checkpoint of it, say so, exit"
(DESIGN.md, a job's life). The first SIGINT or SIGTERM only sets a flag; the trainer
looks at it after every step. The ranks may see the signal at different steps, so with
several ranks the flag is agreed on with a MAX all-reduce of one integer per step, on a
gloo group (a CPU tensor: on NCCL the check would synchronize the GPU every step); a
single process reads the flag and pays nothing. The final save is bounded by
``checkpoint.grace_s`` from the signal: a save that has not committed by then is
abandoned, and the account names the newest committed step instead.

A second signal means "stop now": the handler kills the checkpoint writer (what it was
writing stays uncommitted), stops the data loader, says which step is the newest
committed one and ends the process at once.

Under the ``ms-train`` launcher the first stop does not travel as a signal: the
launcher writes a stop file (:data:`STOP_FILE` in its report folder, holding the
signal's number and how many stops it was asked for) that the ranks read after every
step, as if each had received the signal. A signal that reaches a rank still starting
up (importing, joining the process group, loading a checkpoint) would kill it, its
elastic agent would restart the ranks, and on several nodes an agent whose ranks
stopped well would wait for the others in its exit barrier while those wait for it in
a new rendezvous. A rank that starts after the file was written stops after its first
step like the others; the grace period runs from the file's time. A signal that
reaches a rank is its first stop, even when the file exists (a scheduler may signal
every process of the job); it is the second when the rank had a stop already or the
file says the launcher had two. A rank stopped at once under the launcher exits 0, so
that its agent does not restart the ranks.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.distributed as dist

from ms_ckpt import CheckpointError

if TYPE_CHECKING:
    from ms_ckpt import Checkpointer, SaveHandle

__all__ = ["STOP_FILE", "StopRequest", "Stopped"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: The file in the launcher's report folder that asks the ranks to stop.
STOP_FILE = "stop"


class Stopped(Exception):
    """Training stopped on SIGINT or SIGTERM after finishing a step.

    Attributes:
        signum: the signal that asked for the stop.
        step: the step the run reached (every rank the same).
        committed: the newest committed checkpoint step (``step`` when the final save
            made it), or None when there is none.
        checkpoint_dir: the checkpoint root.
        problem: why the final save did not commit ("" when it did).
    """

    def __init__(
        self,
        signum: int,
        step: int,
        committed: int | None,
        checkpoint_dir: str,
        problem: str = "",
    ) -> None:
        self.signum = signum
        self.step = step
        self.committed = committed
        self.checkpoint_dir = checkpoint_dir
        self.problem = problem
        super().__init__(self.account())

    @property
    def exit_status(self) -> int:
        """The shell's convention for a process ended by the signal: 128 + its number."""
        return 128 + self.signum

    def account(self) -> str:
        """One line: where the run stopped, what is committed, how to go on."""
        if not self.problem and self.committed == self.step:
            saved = f"checkpoint step {self.step} committed at {_step_path(self)}"
        else:
            saved = f"the final checkpoint did not commit ({self.problem}); " + newest_committed(
                self.committed, self.checkpoint_dir
            )
        return f"stopped at step {self.step}; {saved}; run the same command to resume"


def _step_path(s: Stopped) -> str:
    return f"{s.checkpoint_dir.rstrip('/')}/step-{s.step:08d}"


def newest_committed(step: int | None, checkpoint_dir: str) -> str:
    """The part of an account that names the newest committed checkpoint."""
    if step is None:
        return f"no checkpoint is committed under {checkpoint_dir}, a rerun starts fresh"
    return (
        f"newest committed checkpoint: step {step} at {checkpoint_dir.rstrip('/')}/step-{step:08d}"
    )


class StopRequest:
    """SIGINT/SIGTERM handlers for one rank's training loop.

    ``install()`` takes over both signals (from the main thread only: Python's rule;
    elsewhere it does nothing) and ``restore()`` puts the previous handlers back. The
    first signal is recorded; :meth:`agreed` says whether the ranks stop after the
    step just done. A second signal calls ``at_once(signum)``, which must end the
    process.

    Args:
        grace_s: seconds from the first signal that the final save may take.
        at_once: what a second signal does (it must not return normally).
        world_size: ranks of the job; more than one needs torch.distributed initialized.
        stop_file: a file whose appearance asks for a stop as a first signal would (it
            holds the signal's number); the launcher's, or None.
    """

    def __init__(
        self,
        grace_s: float,
        at_once: Callable[[int], None],
        world_size: int = 1,
        stop_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self.grace_s = grace_s
        self.at_once = at_once
        self.world_size = world_size
        self.stop_file = None if stop_file is None else os.fspath(stop_file)
        #: The first signal's number, 0 until one arrives.
        self.signum = 0
        self.received_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._flag: torch.Tensor | None = None
        if world_size > 1:
            # The flag travels on CPU: a gloo group unless the default group is gloo.
            if dist.get_backend() == "gloo":
                self._group = dist.group.WORLD
            else:
                self._group = dist.new_group(backend="gloo")
            self._flag = torch.zeros(1, dtype=torch.int64)

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in _SIGNALS:
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handler)
        return self

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            if signal.getsignal(sig) == self._handler:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if not self.signum and self._requested() < 2:
            if not self.signum:  # the file was not there: this signal is the first
                self.signum = signum
                self.received_at = time.monotonic()
            return
        self.at_once(self.signum)

    def _requested(self) -> int:
        """How many stops the stop file asks for (0 without one); the first is
        recorded as a first signal would be, dated by the file."""
        if self.stop_file is None:
            return 0
        try:
            with open(self.stop_file) as f:
                fields = f.read().split()
            age = max(0.0, time.time() - os.stat(self.stop_file).st_mtime)
        except OSError:
            return 0
        signum = int(fields[0]) if fields and fields[0].isdigit() else int(signal.SIGTERM)
        count = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 1
        if not self.signum:
            self.signum, self.received_at = signum, time.monotonic() - age
        return count

    def deadline(self) -> float:
        """When the final save must have committed (monotonic clock)."""
        start = self.received_at if self.received_at is not None else time.monotonic()
        return start + self.grace_s

    def agreed(self) -> int:
        """After a step: the signal every rank stops on, or 0 to go on (collective with
        several ranks: each rank calls it after each step)."""
        if not self.signum:
            self._requested()
        if self._flag is None:
            return self.signum
        self._flag.fill_(self.signum)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        agreed = int(self._flag.item())
        if agreed and not self.signum:  # another rank's signal: the deadline runs from now
            self.signum, self.received_at = agreed, time.monotonic()
        return agreed

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (collective with several ranks)."""
        if self._flag is None:
            return ok
        self._flag.fill_(int(ok))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(self._flag.item())


def finish(
    stop: StopRequest,
    step: int,
    *,
    state: Callable[[int], dict[str, Any]],
    checkpointer: Checkpointer,
    in_flight: SaveHandle | None,
    checkpoint_dir: str,
) -> Stopped:
    """Commit a checkpoint of ``step`` within the grace period; the account of the stop.

    Args:
        stop: the request the ranks agreed to stop on.
        step: the step every rank has finished.
        state: the checkpoint state of a step (the trainer's).
        checkpointer: saves it, and says which step is committed.
        in_flight: the newest save not collected yet (None if none); when it already
            saves ``step`` it is waited for instead of saving again.
        checkpoint_dir: the checkpoint root, for the account.
    """
    problem = ""
    handle = in_flight
    try:
        if handle is not None and handle.step != step:  # an earlier save still in flight
            handle.wait(timeout=max(0.0, stop.deadline() - time.monotonic()))
        if handle is None or handle.step != step:
            handle = checkpointer.save(step, state(step))
        handle.wait(timeout=max(0.0, stop.deadline() - time.monotonic()))
    except TimeoutError:
        problem = f"not committed within checkpoint.grace_s = {stop.grace_s:g} s"
    except CheckpointError as e:
        problem = str(e).split("\n", 1)[0]
    # Rank 0's save commits last (it merges every rank's part): this also waits for it.
    if not stop.all_ok(not problem):
        problem = problem or "another rank's part did not commit"
        checkpointer.abort()  # do not wait at close for a save that is abandoned
    committed = step if not problem else checkpointer.latest_step()
    return Stopped(stop.signum, step, committed, checkpoint_dir, problem)


def stop_at_once(
    first: int,
    *,
    checkpointer: Checkpointer,
    close_loader: Callable[[], None],
    checkpoint_dir: str,
    stream: TextIO | None,
    under_launcher: bool,
) -> None:
    """A second signal: abandon the save in flight, stop the loader, say what is
    committed, end the process with 128 + the ``first`` signal's number.

    The rank that reports (``stream``: rank 0's, flushed first; None on the others)
    says it, unless the ``ms-train`` launcher started the rank (``under_launcher``):
    the launcher then says it once the ranks are gone, and the rank exits 0, so that
    its elastic agent does not restart the ranks into a stop.
    """
    status = 0 if under_launcher else 128 + first
    try:
        checkpointer.abort()
        close_loader()
        if stream is not None and not under_launcher:
            stream.flush()
            line = newest_committed(checkpointer.latest_step(), checkpoint_dir)
            print(
                f"\nms-train: stopped at once on a second signal; {line}; "
                "run the same command to resume",
                file=sys.stderr,
                flush=True,
            )
    finally:
        os._exit(status)
