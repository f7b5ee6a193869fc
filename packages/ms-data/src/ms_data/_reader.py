"""The node's reader process: packs every local rank's micro-batches into the ring.

Started by local rank 0 as a plain ``python -c`` subprocess (not multiprocessing's
``spawn``, which re-imports the training script's ``__main__``: a script without a
``__main__`` guard would start training again in the reader). Its stdin carries
rank 0's ``sys.path``, then the ``ReaderArgs``, then the pickled dataset. It runs until
local rank 0 asks it to stop, or until a process it serves is gone:

- local rank 0 (its parent) died: it unlinks the segment (no one else will) and exits;
- another attached local rank died: it records the fact as its failure, so that the
  ranks still alive raise instead of waiting for a step that can never be freed, and
  stays until local rank 0 stops it or dies (then it unlinks the segment).

A failure while reading or packing (a corrupt shard) is recorded in the header with
the step it happened at, the message and the pickled exception; each rank raises it
when it reaches that step. SIGINT and SIGTERM are ignored: Ctrl-C reaches the whole
process group and torchrun signals a rank's whole group, while the reader's fate is
its parent's to decide (a rank stopping gracefully still reads its last step).

With ``threads > 1`` the steps are built by a pool of that many threads, up to
``depth`` steps at once: a step is submitted once its slot is free (the same
back-pressure as one thread), a thread builds the whole step into its slot, and the
main thread publishes the steps strictly in order. A failure surfaces at the step
it belongs to: the steps before it are published first. zstd decompression (about
40% of a shuffled sample's cost), file reads and crc32 release the GIL, but the
rest is Python, and on the 2-core machine of tools/bench/data/node_loading.py the
GIL hand-offs cost more than the overlap gains: 2 threads built 0.6x (one task per
sample) to 0.9x (one task per step) the samples per second of 1, hence the default
of 1 (NodeLoader's ``reader_threads``).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ms_data._shm_ring import RingSpec, ShmRing

__all__ = ["ReaderArgs", "main", "reader_main"]

# How often a waiting reader checks that its parent and the ranks still run.
_LIVENESS_EVERY_S = 0.05
# A full ring holds ``depth`` steps ahead of the ranks. Each wake-up of the reader
# preempts one of the trainer's compute threads on a small machine, and the others
# then wait for it at their next barrier. So a reader facing a full ring sleeps until
# ``burst`` (half the ring) slots are free, not one, first for as long as the ranks
# should take to free them at their measured pace, then polling; it may notice them
# late by this fraction of the time the ranks take to use the ``depth - burst`` steps
# they still hold, never later than _MAX_POLL_S: nobody waits on a late refill.
_LATE_FRACTION = 0.25
_MAX_POLL_S = 0.05
_MIN_POLL_S = 1e-3
# The first sleep on a full ring, at the ranks' pace, is at most this long: a reader
# asleep notices a stop request or a dead parent only when it wakes.
_MAX_FIRST_SLEEP_S = 0.25


@dataclass(frozen=True)
class ReaderArgs:
    #: Segment name (without the leading slash).
    name: str
    spec: RingSpec
    #: Local rank 0, which created the segment and started this process.
    parent_pid: int
    #: Threads that build samples; 1 builds them in the main thread.
    threads: int = 1


class _Stop(Exception):
    """The reader should exit quietly (stop requested, or its parent is gone)."""


def main(stream: BinaryIO) -> None:
    """Entry point of ``python -c`` (node_loader's bootstrap has set ``sys.path``)."""
    args = pickle.load(stream)
    reader_main(args, stream.read())


def reader_main(args: ReaderArgs, dataset_pickle: bytes) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ring = ShmRing.try_attach(args.name, args.spec)
    if ring is None:
        # Local rank 0 closed (or died) before this process came up.
        sys.exit(0)
    reader = _Reader(ring, args.parent_pid, args.threads)
    code = 0
    try:
        # Unpickled here, not before: a dataset that cannot open its shards in this
        # process is a failure the ranks should read, like any other.
        reader.dataset = pickle.loads(dataset_pickle)
        ring.set_running()
        reader.run()
    except _Stop:
        ring.set_exited()
    except BaseException as e:
        # The ranks get the original message; they raise it at the step it belongs to.
        text = f"{type(e).__name__}: {e}\n\nin the reader:\n{traceback.format_exc()}"
        ring.fail(reader.step, text, e)
        code = 1
    finally:
        if code:
            _await_owner(ring, args.parent_pid)
        if os.getppid() != args.parent_pid:
            ring.unlink()
        ring.close()
    sys.exit(code)


def _await_owner(ring: ShmRing, parent_pid: int) -> None:
    """After a failure, stay until local rank 0 stops this reader or dies: whichever
    comes, the segment gets unlinked, by rank 0 or by this process. Leaving at once
    forfeits that: when the whole node is killed, another rank is often seen dead a few
    milliseconds before rank 0 is, and nobody would be left to unlink."""
    while not ring.stop_requested and os.getppid() == parent_pid:
        time.sleep(_LIVENESS_EVERY_S)


class _Reader:
    def __init__(self, ring: ShmRing, parent_pid: int, threads: int = 1) -> None:
        self.ring = ring
        self.threads = threads
        self.dataset: Any = None
        self.parent_pid = parent_pid
        spec = ring.spec
        #: The step being produced (or waited for).
        self.step = spec.start_step
        self.global_batch = spec.dp_size * spec.micro_batch
        dtype = np.dtype(spec.dtype)
        self.bounds: tuple[int, int] | None = None
        if dtype != np.int64:
            info = np.iinfo(dtype)
            self.bounds = (int(info.min), int(info.max))
        self.last_check = 0.0
        #: Steps refilled per wake-up once the ring was full (at most ``depth``, so a
        #: rank waiting for a step never waits for the reader to wait for it).
        self.burst = max(1, spec.depth // 2)
        #: When and at which step the last wait for a full ring ended, and the ranks'
        #: smoothed seconds per step while it is full; None: not yet known.
        self.last_free: tuple[float, int] | None = None
        self.step_time: float | None = None

    def run(self) -> None:
        if self.threads > 1:
            self.run_threads()
        else:
            self.run_inline()

    def indices(self, step: int) -> list[tuple[int, int, int]]:
        """``(i, j, g)``: row ``i``, column ``j`` of step ``step``'s slot takes sample ``g``."""
        spec = self.ring.spec
        # The global stream rule (docs/design.md): dp rank r of step t takes the g in
        # [t*GB, (t+1)*GB) with g % dp_size == r, in order.
        return [
            (i, j, step * self.global_batch + spec.dp_first + i + j * spec.dp_size)
            for i in range(spec.dp_local)
            for j in range(spec.micro_batch)
        ]

    def run_threads(self) -> None:
        spec = self.ring.spec
        pending: deque[Future[None]] = deque()  # steps self.step, self.step + 1, ...
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ms-data-reader")
        try:
            while True:
                step = self.step
                # Submit every step whose slot is free, at most depth steps (distinct
                # slots; detached ranks free every slot).
                while len(pending) < spec.depth and self.is_free(step + len(pending)):
                    submit = step + len(pending)
                    slot = self.ring.slots[submit % spec.depth]
                    pending.append(pool.submit(self.fill_step, slot, submit))
                if not pending:
                    self.wait_free(step)
                    continue
                while True:
                    done, _ = wait([pending[0]], _LIVENESS_EVERY_S)
                    self.ring.heartbeat()
                    self.check_alive()
                    if done:
                        break
                pending.popleft().result()  # raises the step's failure, in step order
                self.ring.publish(step)  # after the payload
                self.step = step + 1
        finally:
            # The threads write into the segment: let them finish before it is closed.
            pool.shutdown(wait=True, cancel_futures=True)

    def fill_step(self, slot: Any, step: int) -> None:
        for i, j, g in self.indices(step):
            slot[i, j] = self.checked(self.dataset.sample(g), g)

    def is_free(self, step: int) -> bool:
        return int(self.ring.consumed.min()) >= step - self.ring.spec.depth

    def run_inline(self) -> None:
        spec = self.ring.spec
        while True:
            step = self.step
            self.wait_free(step)
            slot = self.ring.slots[step % spec.depth]
            for i in range(spec.dp_local):
                rank = spec.dp_first + i
                for j in range(spec.micro_batch):
                    # The global stream rule (docs/design.md): dp rank r of step t takes
                    # the g in [t*GB, (t+1)*GB) with g % dp_size == r, in order.
                    g = step * self.global_batch + rank + j * spec.dp_size
                    slot[i, j] = self.checked(self.dataset.sample(g), g)
                self.ring.heartbeat()
                self.check_alive()
            self.ring.publish(step)  # after the payload
            self.step = step + 1

    def checked(self, sample: Any, g: int) -> Any:
        row_len = self.ring.spec.row_len
        if not isinstance(sample, np.ndarray) or sample.shape != (row_len,):
            raise ValueError(
                f"dataset.sample({g}) must return an array of shape ({row_len},), got "
                f"{type(sample).__name__} of shape {getattr(sample, 'shape', None)}"
            )
        if self.bounds is not None and sample.size:
            lo, hi = int(sample.min()), int(sample.max())
            if lo < self.bounds[0] or hi > self.bounds[1]:
                raise ValueError(
                    f"dataset.sample({g}) holds token ids in [{lo}, {hi}], outside the "
                    f"ring dtype {self.ring.spec.dtype} {list(self.bounds)}"
                )
        return sample

    def wait_free(self, step: int) -> None:
        """Block until every local rank has copied out the step this slot held before.

        If it has not yet, wait until ``burst`` slots are free (steps ``step .. step +
        burst - 1``): the next calls then find their slots free without sleeping.
        """
        if self.is_free(step):
            return
        last = step + self.burst - 1
        if self.step_time is None:
            # Pace unknown (the first waits): back off from 1 ms, so that a free slot is
            # noticed within about the time already waited.
            delay, then, cap = _MIN_POLL_S, 2 * _MIN_POLL_S, _MAX_POLL_S
        else:
            # The ranks free a slot per step: sleep a little less than they should need,
            # then look again at short intervals.
            cap = self.poll_cap(self.step_time)
            missing = last - self.ring.spec.depth - int(self.ring.consumed.min())
            delay = min(_MAX_FIRST_SLEEP_S, max(cap, 0.9 * missing * self.step_time))
            then = max(_MIN_POLL_S, cap / 8)
        while not self.is_free(last):
            self.ring.heartbeat()
            self.check_alive()
            time.sleep(delay)
            delay, then = then, min(cap, 2 * then)
        now = time.monotonic()
        if self.last_free is not None and step > self.last_free[1]:
            per_step = (now - self.last_free[0]) / (step - self.last_free[1])
            prev = self.step_time
            if prev is not None:
                # A pause of the ranks (a checkpoint, an eval) is not their pace: one
                # such sample would make the next first sleeps long enough to starve them.
                per_step = min(per_step, 4 * prev)
            self.step_time = per_step if prev is None else 0.75 * prev + 0.25 * per_step
        self.last_free = (now, step)

    def poll_cap(self, step_time: float) -> float:
        """The longest sleep between two looks at a full ring (see _LATE_FRACTION)."""
        ahead = max(self.ring.spec.depth - self.burst, 1) * step_time
        return min(_MAX_POLL_S, max(_MIN_POLL_S, _LATE_FRACTION * ahead))

    def check_alive(self) -> None:
        if self.ring.stop_requested:
            raise _Stop
        now = time.monotonic()
        if now - self.last_check < _LIVENESS_EVERY_S:
            return
        self.last_check = now
        if os.getppid() != self.parent_pid:
            raise _Stop  # local rank 0 is gone; reader_main unlinks the segment
        dead = self.ring.dead_ranks()
        if dead:
            who = ", ".join(f"local rank {lr} (pid {pid})" for lr, pid in dead)
            raise RuntimeError(f"{who} exited without closing its NodeLoader")
