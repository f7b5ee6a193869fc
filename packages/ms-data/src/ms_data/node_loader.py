"""``NodeLoader``: tree-based loading, one reader per node, batches through shared memory.

MegaScale (NSDI 2024, section 3.4) removes redundant data loaders: the tensor-parallel
ranks of a machine need identical inputs, and separate loaders compete for disk
bandwidth. Here local rank 0 starts one reader process per node; it reads, decompresses
and packs (``dataset.sample(g)``) every local data-parallel rank's micro-batch of step
``t`` into one slot of a shared-memory ring (``ms_data._shm_ring``), up to ``depth``
steps ahead; each local rank copies its slice out.

**Rank layout.** ``local_world_size = tp_size * dp_local`` with TP innermost: local rank
``l`` reads dp slice ``l // tp_size`` (its TP index is ``l % tp_size``); the node's dp
slices are the global dp ranks ``dp_first .. dp_first + dp_local - 1``. Step ``t`` gives
dp rank ``r`` the samples ``g`` in ``[t*GB, (t+1)*GB)`` with ``g % dp_size == r``, in
order, ``GB = dp_size * micro_batch`` (docs/design.md).

**Dtype.** The ring holds the corpus's token dtype (uint16 or uint32, the widest of the
shards; the dataset keeps eos and pad ids within it): 4x (2x) less shared memory and
copy traffic than int64. The reader checks every sample fits; ranks get int64.

**Names.** ``/dev/shm/ms_data_<job>_<name>_d<dp_first>_s<step>``: ``<job>`` is
``job_id``, else torchrun's ``TORCHELASTIC_RUN_ID`` joined with ``MASTER_ADDR:MASTER_PORT``
(the run id alone is ``"none"`` unless ``--rdzv-id`` is given); ``dp_first`` tells the
nodes of one host apart; ``step`` is the ring's first step (each ``load_state_dict``
after the start opens a new ring there). Every part comes from the arguments and the
state, which the ranks share, not from what a process did before: a rank that loaded
its state before its first batch and one that loaded it after agree. The ranks of a
node agree on the name without talking to each other, so outside torchrun ``job_id``
is required unless there is a single local rank. A process never attaches again to a
segment one of its loaders has left: after a ``load_state_dict`` back to the same step,
or in a loader rebuilt with the same name, it waits for local rank 0's new ring.

**Cleanup.** Local rank 0 owns the segment: ``close()``, the context manager, garbage
collection and interpreter exit (``weakref.finalize``) stop the reader and unlink it;
SIGINT/SIGTERM unlink it and then chain to the previous handler (``ms_data._cleanup``;
``signal_cleanup=False`` leaves the signals to a caller that closes the loader itself);
a reader whose parent died unlinks it; at start, local rank 0 unlinks every
``ms_data_*`` segment whose creator is dead (SIGKILLed runs).

**Data wait.** ``stats()`` (and the attributes of the same names): ``data_wait_s``,
the seconds a rank spent in ``next()`` before its batch was ready, over ``wall_s``, the
seconds between consecutive batches, is ``data_wait_fraction``: with one batch per
step, the share of step time lost to data. The first batch after each start (the
reader's start-up, a few seconds) counts apart, in ``startup_wait_s``. Polling costs up
to 1 ms of extra latency on a batch that was not ready (``Backoff``); a ready batch
costs its copy-out (``copy_s``).

**Faults.** A rank waiting for a step checks, every 10 ms, the reader's recorded failure
(raised with the original message, at the step it happened), its liveness (pid and
start time; a zombie counts as dead), and ``timeout``: it raises ``NodeLoaderError``,
never hangs. The reader exits when local rank 0 dies or asks it to, and records a
failure when another attached rank's process dies, so the other ranks raise too.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import numpy as np
import torch

from ms_data import _cleanup
from ms_data._layout import RankLayout, check_int, segment_namespace
from ms_data._reader import ReaderArgs
from ms_data._shm_ring import (
    PREFIX,
    Backoff,
    RingSpec,
    ShmRing,
    ShmSpaceError,
    check_platform,
    describe_segment,
    shm_free_bytes,
    space_message,
    sweep_stale,
)

__all__ = ["NodeLoader", "NodeLoaderError"]

_STATE_VERSION = 1
# How often a waiting rank checks the reader's liveness and its own deadline.
_CHECK_EVERY_S = 0.01
# How long close() waits for the reader to exit before it kills it.
_READER_EXIT_S = 5.0
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
# Inodes of the segments any loader of this process has attached to (tmpfs does not
# reuse inode numbers). Per process, not per loader: a loader rebuilt with the same name
# and first step must not attach to the old loader's ring, which local rank 0 may not
# have closed yet when this rank asks.
_LEFT: set[int] = set()
# SIGINT and SIGTERM are ignored before anything else runs (they reach the reader when
# Ctrl-C hits the terminal's process group or torchrun signals a rank's group); the
# reader's fate is its parent's to decide, and a traceback from it helps no one.
_BOOTSTRAP = (
    "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
    "from ms_data._reader import main; main(sys.stdin.buffer)"
)


class NodeLoaderError(RuntimeError):
    """The reader failed, died or stalled, or the ring could not be set up."""


class NodeLoader:
    """This rank's micro-batches, read once per node and shared through /dev/shm.

    An iterator of int64 tensors of shape ``(micro_batch, seq_len + 1)``; it never ends.
    Every local rank of the node builds one with the same arguments (the rank layout
    comes from torchrun's environment unless given). Nothing starts until the first
    batch is asked for, so :meth:`load_state_dict` can come first at no cost.

    Args:
        dataset: a picklable object with ``seq_len`` and ``sample(g)`` returning int64
            ``(seq_len + 1,)`` (``PackedDataset``); its ``next_index``, if any, is the
            start and must be a multiple of the global batch.
        micro_batch: samples per data-parallel rank per step.
        tp_size: tensor-parallel degree; it must divide ``local_world_size``.
        dp_rank, dp_size: global data-parallel rank and degree; default
            ``RANK // tp_size`` and ``WORLD_SIZE // tp_size`` (no pipeline
            parallelism: with it, pass them).
        local_rank, local_world_size: default ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``,
            else 0 and 1.
        depth: ring slots; the reader runs up to ``depth`` steps ahead.
        timeout: seconds a rank waits for one batch (the first includes the reader's
            start, a few seconds) or for local rank 0's segment to appear.
        job_id: namespace of the segment names; see the module docstring.
        name: tells several loaders of one job apart (``"train"``, ``"val"``).
        reader_threads: threads of the reader process that build steps (still one
            process per node), up to ``depth`` steps at once, published in order;
            only local rank 0's value is used. 1 (the default) builds them in the
            reader's main thread: only decompression and reads release the GIL, and
            on a 2-core machine 2 threads measured slower than 1
            (``ms_data._reader``).
        signal_cleanup: on SIGINT and SIGTERM, stop the reader and unlink the segment
            at once, then hand the signal on (the default: a loop that dies of the
            signal leaves nothing). ``False`` for a caller that handles those signals
            itself and closes the loader when it is done: a training loop that
            finishes its step and checkpoints on a signal still needs its batches,
            and with the default the reader would be gone. A hard kill still leaves
            nothing that the next start does not sweep.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        micro_batch: int,
        tp_size: int = 1,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        depth: int = 4,
        timeout: float = 60.0,
        job_id: str | None = None,
        name: str = "train",
        reader_threads: int = 1,
        signal_cleanup: bool = True,
    ) -> None:
        for arg, value in (
            ("micro_batch", micro_batch),
            ("tp_size", tp_size),
            ("depth", depth),
            ("reader_threads", reader_threads),
        ):
            check_int(arg, value, minimum=1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        if not isinstance(signal_cleanup, bool):
            raise TypeError(f"signal_cleanup must be a bool, got {signal_cleanup!r}")
        self.signal_cleanup = signal_cleanup
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"name must match {_NAME_RE.pattern}, got {name!r}")
        try:
            check_platform()
        except RuntimeError as e:
            raise NodeLoaderError(str(e)) from None
        if not callable(getattr(dataset, "sample", None)) or not hasattr(dataset, "seq_len"):
            raise TypeError(
                "dataset must have seq_len and sample(g) (a PackedDataset), got "
                f"{type(dataset).__name__}"
            )
        self.dataset = dataset
        self.micro_batch = int(micro_batch)
        self.tp_size = int(tp_size)
        self.depth = int(depth)
        self.reader_threads = int(reader_threads)
        self.timeout = float(timeout)
        self.name = name
        self.seq_len = int(dataset.seq_len)
        #: Where this rank sits on its node and in the data-parallel group.
        self.layout = RankLayout.resolve(
            tp_size=self.tp_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
        )
        self.local_rank = self.layout.local_rank
        self.local_world_size = self.layout.local_world_size
        self.dp_rank = self.layout.dp_rank
        self.dp_size = self.layout.dp_size
        self.dp_index = self.layout.dp_index
        self.tp_rank = self.layout.tp_rank
        self.dp_first = self.layout.dp_first
        self.global_batch = self.dp_size * self.micro_batch
        self._namespace = segment_namespace(job_id, name, self.layout)
        self.dtype = _ring_dtype(dataset)

        start = int(getattr(dataset, "next_index", 0))
        if start % self.global_batch:
            raise ValueError(
                f"dataset.next_index must be a multiple of the global batch dp_size * "
                f"micro_batch = {self.global_batch} (a step boundary), got {start}"
            )
        self._step = start // self.global_batch
        # At construction, on every rank: a full /dev/shm is an error now, with the
        # numbers, not a SIGBUS or a hang later. ShmRing.create checks again (and
        # reserves the memory) when the ring is made.
        spec = self._spec()
        needed, free = spec.total_bytes, shm_free_bytes()
        if free is not None and needed > free:
            raise NodeLoaderError(space_message(spec, needed, free))

        self._ring: ShmRing | None = None
        self._reader: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._signal_key: int | None = None
        self._closed = False
        self.segment_name: str | None = None
        # The data-wait metric (stats()). The first batch of every ring start (the
        # reader's start-up) counts apart, in startup_wait_s.
        #: Batches delivered.
        self.batches = 0
        #: Seconds spent waiting for a batch that was not ready yet (copy-out excluded).
        self.data_wait_s = 0.0
        #: Wall seconds from each batch's return to the next one's (start-ups excluded).
        self.wall_s = 0.0
        #: Seconds the first batch of each start waited (reader start-up).
        self.startup_wait_s = 0.0
        #: Seconds spent copying slices out of the ring.
        self.copy_s = 0.0
        #: The last batch's wait.
        self.last_wait_s = 0.0
        self._starting = True
        self._last_done_at: float | None = None

    def _spec(self) -> RingSpec:
        return RingSpec(
            depth=self.depth,
            n_ranks=self.local_world_size,
            tp_size=self.tp_size,
            micro_batch=self.micro_batch,
            row_len=self.seq_len + 1,
            dtype=self.dtype,
            dp_first=self.dp_first,
            dp_size=self.dp_size,
            start_step=self._step,
        )

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> NodeLoader:
        return self

    def __next__(self) -> torch.Tensor:
        if self._closed:
            raise NodeLoaderError(f"NodeLoader {self.name!r} is closed")
        ring = self._ring if self._ring is not None else self._start()
        step = self._step
        # t1: when the take that succeeded began; before it the rank waited for data,
        # after it, it copied (and checked the copy against its digest).
        t0 = t1 = time.perf_counter()
        raw = ring.take(step, self.dp_index)
        if raw is None:
            raw, t1 = self._wait(ring, step)
        out = torch.from_numpy(raw.astype(np.int64))
        # After the checked copy, and dependent on the check: the slot may be reused.
        ring.consumed[self.local_rank] = step
        t2 = time.perf_counter()
        self._step += 1
        self.batches += 1
        self.last_wait_s = t1 - t0
        self.copy_s += t2 - t1
        if self._starting or self._last_done_at is None:
            self.startup_wait_s += t1 - t0
            self._starting = False
        else:
            self.data_wait_s += t1 - t0
            self.wall_s += t2 - self._last_done_at
        self._last_done_at = t2
        return out

    def _wait(self, ring: ShmRing, step: int) -> tuple[np.ndarray, float]:
        """Poll until step ``step``'s slice is published and whole; raise on failure or
        timeout. Returns the slice and when the successful take began."""
        backoff = Backoff()
        deadline = time.monotonic() + self.timeout
        next_check = 0.0
        began = time.perf_counter()
        while (raw := ring.take(step, self.dp_index)) is None:
            failure = ring.failure()
            if failure is not None and step >= failure[0]:
                raise self._reader_failure(ring, step, failure)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_EVERY_S
                alive = self._reader_alive(ring)
                if alive is False and ring.take(step, self.dp_index) is None:
                    failure = ring.failure()
                    if failure is not None:
                        raise self._reader_failure(ring, step, failure)
                    raise NodeLoaderError(
                        f"the NodeLoader reader process (pid {ring.reader_pid}, "
                        f"{self._reader_exit()}) is gone; local rank {self.local_rank} was "
                        f"waiting for step {step} from segment {ring.name}"
                    )
                if alive is None and not ring.creator_alive():
                    raise NodeLoaderError(
                        f"local rank 0 (pid {ring.creator_pid}) died before it started the "
                        f"reader of segment {ring.name}"
                    )
                if now >= deadline:
                    age = ring.heartbeat_age()
                    beat = "never beat" if age is None else f"last heartbeat {age:.1f}s ago"
                    raise NodeLoaderError(
                        f"local rank {self.local_rank} waited {self.timeout:.1f}s (timeout) "
                        f"for step {step} from segment {ring.name}; the reader (pid "
                        f"{ring.reader_pid}) is alive but slow or stuck ({beat}). Raise "
                        "timeout if reading a step can take that long"
                    )
            backoff.sleep()
            began = time.perf_counter()
        return raw, began

    def _reader_alive(self, ring: ShmRing) -> bool | None:
        if self._reader is not None:
            return self._reader.poll() is None
        return ring.reader_alive()

    def _reader_exit(self) -> str:
        if self._reader is None or self._reader.returncode is None:
            return "exit status unknown to this rank"
        code = self._reader.returncode
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _reader_failure(
        self, ring: ShmRing, step: int, failure: tuple[int, str, BaseException | None]
    ) -> NodeLoaderError:
        at, text, exc = failure
        err = NodeLoaderError(
            f"the NodeLoader reader process (pid {ring.reader_pid}) failed at step "
            f"{at} (local rank {self.local_rank} asked for step {step}): {text}"
        )
        err.__cause__ = exc
        return err

    # -- start and stop -------------------------------------------------------------------

    def _start(self) -> ShmRing:
        self._starting = True
        name = f"{PREFIX}{self._namespace}_s{self._step}"
        self.segment_name = name
        spec = self._spec()
        if self.local_rank == 0:
            self._ring = self._create(name, spec)
        else:
            self._ring = self._attach(name, spec)
            self._finalizer = weakref.finalize(
                self, _detach, self._ring, self.local_rank, os.getpid()
            )
        return self._ring

    def _create(self, name: str, spec: RingSpec) -> ShmRing:
        sweep_stale()
        try:
            ring = ShmRing.create(name, spec)
        except ShmSpaceError as e:
            raise NodeLoaderError(str(e)) from e
        except FileExistsError:
            raise NodeLoaderError(
                f"shared-memory segment {name} already exists and is alive "
                f"({describe_segment(name)}): another job on this host with the same job_id, "
                "or a NodeLoader of this process with the same name that is still open"
            ) from None
        try:
            payload = pickle.dumps(
                ReaderArgs(name, spec, os.getpid(), self.reader_threads)
            ) + pickle.dumps(self.dataset)
        except Exception as e:
            ring.unlink()
            ring.close()
            raise TypeError(f"dataset must be picklable to reach the reader process: {e!r}") from e
        reader = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP], stdin=subprocess.PIPE)
        assert reader.stdin is not None
        try:
            pickle.dump(list(sys.path), reader.stdin)
            reader.stdin.write(payload)
            reader.stdin.close()
        except OSError:
            pass  # the reader died at once; the first wait reports it
        ring.set_reader(reader.pid)
        ring.register_rank(0)
        self._reader = reader
        me = os.getpid()
        self._finalizer = weakref.finalize(self, _shutdown, ring, reader, me, False)
        if self.signal_cleanup:
            self._signal_key = _cleanup.on_signal(lambda: _shutdown(ring, reader, me, True))
        return ring

    def _attach(self, name: str, spec: RingSpec) -> ShmRing:
        deadline = time.monotonic() + self.timeout
        backoff = Backoff(cap=0.01)
        while True:
            ring = ShmRing.try_attach(name, spec, skip=_LEFT)
            if ring is not None:
                ring.register_rank(self.local_rank)
                _LEFT.add(ring.inode)
                return ring
            if time.monotonic() >= deadline:
                raise NodeLoaderError(
                    f"local rank {self.local_rank} waited {self.timeout:.1f}s for local rank 0 "
                    f"to create the shared-memory segment {name} "
                    f"({describe_segment(name) if os.path.exists('/dev/shm/' + name) else 'absent'}"
                    "); every local rank must build a NodeLoader with the same job_id and name"
                )
            backoff.sleep()

    def close(self) -> None:
        """Stop the reader and unlink the segment (local rank 0) or detach (the others)."""
        self._closed = True
        self._stop()

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        if self._signal_key is not None:
            _cleanup.remove(self._signal_key)
            self._signal_key = None
        self._ring = None
        self._reader = None

    def __enter__(self) -> NodeLoader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def reader_pid(self) -> int | None:
        """The node's reader process, once started."""
        return None if self._ring is None else self._ring.reader_pid

    # -- resume ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The next step this rank will load."""
        return self._step

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "step", "next_index", "global_batch", ..., "dataset"}``.

        ``next_index = step * global_batch`` is the global sample index of the next
        step; ``dataset`` is the dataset's own state at that index, when it has one.
        """
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "step": self._step,
            "next_index": self._step * self.global_batch,
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
        }
        if callable(getattr(self.dataset, "state_dict", None)):
            ds = dict(self.dataset.state_dict())
            ds["next_index"] = state["next_index"]
            state["dataset"] = ds
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``; a running reader is stopped and restarts from there.

        Every local rank must call it (the ring is rebuilt). ``dp_size`` may differ from
        the saved one as long as the saved ``next_index`` falls on a step boundary of
        this loader's global batch.
        """
        if self._closed:
            raise NodeLoaderError(f"NodeLoader {self.name!r} is closed")
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"state version must be {_STATE_VERSION} (what this NodeLoader reads), "
                f"got {state.get('version')!r}"
            )
        if state.get("seq_len") != self.seq_len:
            raise ValueError(
                f"cannot resume: state seq_len is {state.get('seq_len')!r}, this loader's "
                f"dataset has {self.seq_len}"
            )
        next_index = state.get("next_index")
        check_int("state['next_index']", next_index, minimum=0)
        assert isinstance(next_index, int)
        if next_index % self.global_batch:
            raise ValueError(
                f"cannot resume: state next_index {next_index} is not a step boundary of this "
                f"loader's global batch dp_size * micro_batch = {self.global_batch} (it was "
                f"saved with global batch {state.get('global_batch')!r})"
            )
        if "dataset" in state and callable(getattr(self.dataset, "load_state_dict", None)):
            # The dataset refuses a state of another stream (seed, corpus, ...).
            self.dataset.load_state_dict(state["dataset"])
        self._stop()
        self._step = next_index // self.global_batch

    # -- the data-wait metric ----------------------------------------------------------

    @property
    def data_wait_fraction(self) -> float:
        """Seconds waited for data over wall seconds between batches (start-ups excluded).

        With one batch per training step this is the share of step time lost to data.
        """
        return self.data_wait_s / self.wall_s if self.wall_s > 0 else 0.0

    def stats(self) -> dict[str, float | int]:
        """This rank's data-wait metric and counters (the attributes of the same names)."""
        return {
            "step": self._step,
            "batches": self.batches,
            "data_wait_s": self.data_wait_s,
            "data_wait_fraction": self.data_wait_fraction,
            "wall_s": self.wall_s,
            "startup_wait_s": self.startup_wait_s,
            "last_wait_s": self.last_wait_s,
            "copy_s": self.copy_s,
        }


def _shutdown(ring: ShmRing, reader: subprocess.Popen[bytes], owner: int, fast: bool) -> None:
    """Local rank 0's cleanup: stop the reader, unlink the segment, unmap.

    ``fast`` (from a signal handler) does not wait for the reader and keeps the
    mapping, which the interrupted frame may still be reading. A forked child (a
    DataLoader worker) inherits the finalizer and the signal handler, and Ctrl-C
    reaches it too: only the ``owner`` process may act.
    """
    if os.getpid() != owner:
        return
    ring.request_stop()
    # The name goes first (every process that uses the ring has it mapped by now): a
    # kill of this process while it waits for the reader then leaves nothing behind.
    ring.unlink()
    if fast:
        if reader.poll() is None:
            reader.kill()  # it ignores SIGTERM (see _BOOTSTRAP)
        return
    try:
        reader.wait(_READER_EXIT_S)
    except subprocess.TimeoutExpired:
        reader.kill()
        reader.wait()
    ring.close()


def _detach(ring: ShmRing, local_rank: int, owner: int) -> None:
    if os.getpid() != owner:
        return  # a forked child must not release its parent's slot
    ring.detach_rank(local_rank)
    ring.close()


def _ring_dtype(dataset: Any) -> str:
    corpus = getattr(dataset, "corpus", None)
    shards = getattr(corpus, "shards", None)
    if not shards:
        return "int64"
    widest = max((np.dtype(s.dtype) for s in shards), key=lambda d: d.itemsize)
    return widest.name if widest.name in ("uint16", "uint32") else "int64"
