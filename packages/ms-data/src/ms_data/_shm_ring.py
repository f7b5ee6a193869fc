"""A POSIX shared-memory ring of fixed-shape batches, shared by unrelated processes.

One segment (``/dev/shm/<name>``) holds a header of int64 fields, then ``depth``
slots. A slot holds one training step for every data-parallel rank of the node:
``(dp_local, micro_batch, row_len)`` of the ring dtype.

Synchronisation is by sequence counters, no locks, so that processes that share
nothing but the segment's name (torchrun ranks, the reader) can use it:

- the reader fills slot ``t % depth`` with step ``t``, stores a digest of each dp
  slice (``sums``), then stores ``ready[slot] = t``;
- local rank ``l`` waits until ``ready[t % depth] == t``, copies its slice, checks the
  copy against its digest (retrying until it matches), then stores ``consumed[l] = t``;
- the reader writes step ``t`` only once ``min(consumed) >= t - depth``: every rank
  has copied the step the slot held before (back-pressure).

**Memory order.** Each counter has a single writer and is an aligned 8-byte word,
whose stores and loads are single-copy atomic on every 64-bit target (x86-64,
AArch64, POWER, s390x, RISC-V); other machines are refused (``check_platform``).
Their order is another matter: x86 keeps stores in order (TSO), but ARM and POWER
may show another core the counter before the payload, and Python exposes no fence.
So nothing here relies on order; every record one process publishes to another is
checked, seqlock-style, by its reader: the slot's payload, the header's fixed
fields, the reader's failure record each carry a 64-bit blake2b digest, in one
8-byte word written after the data and keyed by the step (or the record's own
fields), and whoever reads them retries until the digest matches what it copied.
A counter seen before its payload, or a stale digest from the slot's previous step,
fails the check (a false match has probability 2^-64). Costs: one blake2b pass over
each rank's slice per step on both sides, a few microseconds per KiB, at the ring's
rate of one step per training step; no system call, so a ready batch still costs
only its copy. The other direction needs no digest: a rank's store of
``consumed[l]`` depends on the result of the check, which depends on every byte it
copied, and no CPU makes a store visible before the branch it depends on resolves,
so the reader cannot see a slot freed before the rank has read it; the reader in
turn writes a slot only after a branch on ``consumed``. The reader process sees
the header and the initial counters because it is started (fork, exec, a pipe)
after rank 0 wrote them.

The header also records who created the segment and who reads for it (pid, process
start time, boot id), so that a later run can tell a stale segment from a live one
without talking to anyone, and a rank can tell a dead reader from a slow one.

Segments are opened as files under /dev/shm, which is what ``shm_open`` does on Linux,
not through ``multiprocessing.shared_memory.SharedMemory``: before Python 3.13 that
class registers every attach with the ``resource_tracker``, which then unlinks the
segment when the attaching process exits and warns about a "leak"; unregistering
right after does not help when processes share one tracker (the children of one
``mp.spawn`` or of the test harness): they race on its set of names and it prints
KeyError tracebacks. Ownership and cleanup are ours (``node_loader``). Linux only, like
the /proc liveness checks.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import pickle
import platform
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from ms_data._procs import boot_id, pid_namespace, process_alive, process_starttime

__all__ = [
    "PREFIX",
    "SHM_DIR",
    "Backoff",
    "RingSpec",
    "ShmRing",
    "ShmSpaceError",
    "check_platform",
    "describe_segment",
    "digest",
    "shm_free_bytes",
    "space_message",
    "sweep_stale",
]

SHM_DIR = "/dev/shm"
#: Every segment this package creates is named ``PREFIX...``; the stale sweep looks
#: at these names only.
PREFIX = "ms_data_"
MAGIC = 0x31617461645F736D  # b"ms_data1" little-endian
# 2: slot digests, header and failure digests (memory order, see above).
VERSION = 2
#: Ring dtypes a header can name (the index is stored).
DTYPES = ("uint8", "uint16", "uint32", "int32", "int64")
_ERROR_TEXT_BYTES = 16384
_ERROR_PICKLE_BYTES = 16384
_ALIGN = 4096
# A segment whose header never got written (its creator died between shm_open and
# the header) is unlinked by the sweep only once it is this old.
_UNINITIALISED_GRACE_S = 600.0

# Header fields, one int64 each.
_MAGIC, _VERSION, _INIT_DONE, _TOTAL_BYTES = 0, 1, 2, 3
_DEPTH, _N_RANKS, _TP_SIZE, _MICRO_BATCH, _ROW_LEN, _DTYPE = 4, 5, 6, 7, 8, 9
_DP_FIRST, _DP_SIZE, _START_STEP = 10, 11, 12
_CREATOR_PID, _CREATOR_START, _BOOT_HI, _BOOT_LO = 13, 14, 15, 16
_READER_PID, _READER_START, _READER_STATE, _HEARTBEAT_NS = 17, 18, 19, 20
_STOP, _ERROR_STEP, _ERROR_TEXT_LEN, _ERROR_PICKLE_LEN = 21, 22, 23, 24
_PID_NS = 25
_HEAD_SUM, _ERROR_SUM = 26, 27
_N_FIELDS = 32
# Written once by the creator before _INIT_DONE; covered by _HEAD_SUM.
_FIXED = (
    _MAGIC,
    _VERSION,
    _TOTAL_BYTES,
    _DEPTH,
    _N_RANKS,
    _TP_SIZE,
    _MICRO_BATCH,
    _ROW_LEN,
    _DTYPE,
    _DP_FIRST,
    _DP_SIZE,
    _START_STEP,
    _CREATOR_PID,
    _CREATOR_START,
    _BOOT_HI,
    _BOOT_LO,
    _PID_NS,
)
#: Machines whose aligned 8-byte loads and stores are single-copy atomic (the protocol
#: needs nothing else from the hardware); ``platform.machine()`` names.
ATOMIC_64_MACHINES = frozenset(
    {"x86_64", "amd64", "aarch64", "arm64", "ppc64le", "ppc64", "s390x", "riscv64"}
)

# Reader states.
STARTING, RUNNING, FAILED, EXITED = 0, 1, 2, 3
#: ``consumed[l]`` of a rank that has detached: it never holds the reader back.
DETACHED = np.iinfo(np.int64).max


class ShmSpaceError(RuntimeError):
    """/dev/shm has less free space than the ring needs."""


def check_platform(machine: str | None = None, pointer_bits: int | None = None) -> None:
    """Refuse a machine whose 8-byte counters could be torn (a 32-bit CPU).

    ``machine`` and ``pointer_bits`` default to this interpreter's; passing them
    checks another machine. Raises ``RuntimeError`` naming the machine.
    """
    machine = platform.machine() if machine is None else machine
    bits = (64 if sys.maxsize > 2**32 else 32) if pointer_bits is None else pointer_bits
    if machine.lower() not in ATOMIC_64_MACHINES or bits != 64:
        raise RuntimeError(
            f"the NodeLoader ring needs single-copy atomic 8-byte loads and stores (a 64-bit "
            f"CPU: {', '.join(sorted(ATOMIC_64_MACHINES))}) and a 64-bit Python, got machine "
            f"{machine!r} with {bits}-bit pointers; use a DataLoader per rank there"
        )


def digest(key: int, *parts: Any) -> int:
    """64-bit blake2b of ``key`` and the bytes of ``parts``, as a signed int64."""
    h = hashlib.blake2b(key.to_bytes(8, "little", signed=True), digest_size=8)
    for part in parts:
        h.update(part)
    return int.from_bytes(h.digest(), "little", signed=True)


@dataclass(frozen=True)
class RingSpec:
    """The shape of one ring; every process that opens it must agree on all of it."""

    #: Number of slots (steps in flight).
    depth: int
    #: Local ranks that consume from the ring (local world size).
    n_ranks: int
    #: Tensor-parallel degree; local rank ``l`` reads dp slice ``l // tp_size``.
    tp_size: int
    #: Samples per data-parallel rank per step.
    micro_batch: int
    #: Tokens per sample (``seq_len + 1``).
    row_len: int
    #: Element type in the ring, one of ``DTYPES``.
    dtype: str
    #: Global data-parallel rank of this node's first dp slice.
    dp_first: int
    #: Global data-parallel degree.
    dp_size: int
    #: The first step the reader produces.
    start_step: int

    @property
    def dp_local(self) -> int:
        return self.n_ranks // self.tp_size

    @property
    def slot_shape(self) -> tuple[int, int, int]:
        return (self.dp_local, self.micro_batch, self.row_len)

    @property
    def slot_bytes(self) -> int:
        return self.dp_local * self.micro_batch * self.row_len * np.dtype(self.dtype).itemsize

    @property
    def header_bytes(self) -> int:
        raw = 8 * (_N_FIELDS + self.depth + 3 * self.n_ranks + self.depth * self.dp_local)
        return _round_up(raw + _ERROR_TEXT_BYTES + _ERROR_PICKLE_BYTES, _ALIGN)

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.depth * _round_up(self.slot_bytes, _ALIGN)

    def describe(self) -> str:
        return (
            f"depth={self.depth} slots x (dp_local={self.dp_local}, "
            f"micro_batch={self.micro_batch}, seq_len+1={self.row_len}) {self.dtype} "
            f"= {self.depth} x {self.slot_bytes} bytes + {self.header_bytes} header bytes"
        )

    def _fields(self) -> dict[int, int]:
        return {
            _DEPTH: self.depth,
            _N_RANKS: self.n_ranks,
            _TP_SIZE: self.tp_size,
            _MICRO_BATCH: self.micro_batch,
            _ROW_LEN: self.row_len,
            _DTYPE: DTYPES.index(self.dtype),
            _DP_FIRST: self.dp_first,
            _DP_SIZE: self.dp_size,
            _START_STEP: self.start_step,
        }


_FIELD_NAMES = {
    _DEPTH: "depth",
    _N_RANKS: "local_world_size",
    _TP_SIZE: "tp_size",
    _MICRO_BATCH: "micro_batch",
    _ROW_LEN: "seq_len+1",
    _DTYPE: "dtype",
    _DP_FIRST: "first dp rank of the node",
    _DP_SIZE: "dp_size",
    _START_STEP: "start step",
}


class Backoff:
    """Polling sleep that starts at ``first`` seconds and doubles up to ``cap``.

    The cost of polling instead of blocking: a waiter notices new data up to ``cap``
    (1 ms) late once it has been waiting for a while, plus the kernel's timer slack
    (~50 us per sleep). With prefetch the data is normally there before anyone asks.
    """

    def __init__(self, first: float = 20e-6, cap: float = 1e-3) -> None:
        self.first = first
        self.cap = cap
        self.delay = first

    def sleep(self) -> None:
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)

    def reset(self) -> None:
        self.delay = self.first


class ShmRing:
    """One mapping of a ring segment. Create with :meth:`create` or :meth:`attach`."""

    def __init__(self, shm: _Segment, spec: RingSpec) -> None:
        self.name = shm.name
        self.spec = spec
        self._shm = shm
        #: The segment's inode: tells this ring from a later one of the same name.
        self.inode = shm.inode
        buf = shm.buf
        d, n = spec.depth, spec.n_ranks
        self.header: np.ndarray[Any, np.dtype[np.int64]] = np.ndarray(
            (_N_FIELDS,), np.int64, buffer=buf
        )
        dl = spec.dp_local
        arrays = np.ndarray((d + 3 * n + d * dl,), np.int64, buffer=buf, offset=8 * _N_FIELDS)
        #: ``ready[s]``: the step slot ``s`` holds, -1 for none yet.
        self.ready = arrays[:d]
        #: ``consumed[l]``: the last step local rank ``l`` copied out.
        self.consumed = arrays[d : d + n]
        #: ``rank_pid[l]``, ``rank_start[l]``: who local rank ``l`` is (0: not attached).
        self.rank_pid = arrays[d + n : d + 2 * n]
        self.rank_start = arrays[d + 2 * n : d + 3 * n]
        #: ``sums[s, i]``: digest of dp slice ``i`` of the step slot ``s`` holds.
        self.sums = arrays[d + 3 * n :].reshape(d, dl)
        text_at = 8 * (_N_FIELDS + d + 3 * n + d * dl)
        self._error_text = np.ndarray((_ERROR_TEXT_BYTES,), np.uint8, buffer=buf, offset=text_at)
        self._error_pickle = np.ndarray(
            (_ERROR_PICKLE_BYTES,), np.uint8, buffer=buf, offset=text_at + _ERROR_TEXT_BYTES
        )
        slot_stride = _round_up(spec.slot_bytes, _ALIGN)
        itemsize = np.dtype(spec.dtype).itemsize
        #: ``slots[s]`` is one step: (dp_local, micro_batch, row_len).
        self.slots: np.ndarray[Any, Any] = np.ndarray(
            (d, *spec.slot_shape),
            np.dtype(spec.dtype),
            buffer=buf,
            offset=spec.header_bytes,
            strides=(slot_stride, *_c_strides(spec.slot_shape, itemsize)),
        )

    # -- opening ------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, spec: RingSpec) -> ShmRing:
        """Create the segment (it must not exist), reserve its memory, write the header."""
        needed = spec.total_bytes
        free = shm_free_bytes()
        if free is not None and needed > free:
            raise ShmSpaceError(space_message(spec, needed, free))
        try:
            shm = _Segment(name, create=True, size=needed)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise ShmSpaceError(space_message(spec, needed, shm_free_bytes() or 0)) from e
            raise
        ring = cls(shm, spec)
        h = ring.header
        h[_TOTAL_BYTES] = needed
        for index, value in spec._fields().items():
            h[index] = value
        h[_CREATOR_PID] = os.getpid()
        h[_CREATOR_START] = process_starttime(os.getpid()) or 0
        h[_BOOT_HI], h[_BOOT_LO] = boot_id()
        h[_PID_NS] = pid_namespace()
        h[_READER_STATE] = STARTING
        h[_ERROR_STEP] = -1
        ring.ready[:] = -1
        ring.consumed[:] = spec.start_step - 1
        h[_VERSION] = VERSION
        h[_MAGIC] = MAGIC
        h[_HEAD_SUM] = _header_digest(h)
        h[_INIT_DONE] = 1  # last: attachers wait for it (and check _HEAD_SUM)
        return ring

    @classmethod
    def try_attach(cls, name: str, spec: RingSpec, *, skip: Collection[int] = ()) -> ShmRing | None:
        """Attach to a live, initialised segment of this name; None while there is none.

        A segment whose inode is in ``skip`` (one this process has left) counts as
        none. Raises ``ValueError`` when the live segment was made for a different
        ring (the ranks of a node disagree on their arguments).
        """
        try:
            shm = _Segment(name, create=False)
        except FileNotFoundError:
            return None  # not there yet
        if shm.inode in skip:
            shm.close()  # the ring this rank left; its successor is not there yet
            return None
        if shm.size < 8 * _N_FIELDS:  # created, not sized yet
            shm.close()
            return None
        head = np.ndarray((_N_FIELDS,), np.int64, buffer=shm.buf).copy()
        if head[_INIT_DONE] != 1 or head[_MAGIC] != MAGIC:
            shm.close()  # being written
            return None
        if head[_VERSION] != VERSION and head[_VERSION] != 0:  # 0: not visible here yet
            shm.close()
            raise ValueError(
                f"shared-memory segment {name} has ring format version {head[_VERSION]}, "
                f"this ms_data writes version {VERSION}: the ranks of this node run "
                "different ms_data versions"
            )
        if head[_HEAD_SUM] != _header_digest(head) or not _owner_alive(head):
            # Written but not all visible to this CPU yet (weak memory order), or stale:
            # its creator will replace it. Either way, look again later.
            shm.close()
            return None
        wrong = [
            f"{_FIELD_NAMES[i]}: local rank 0 has {head[i]}, this rank {v}"
            for i, v in spec._fields().items()
            if head[i] != v
        ]
        if wrong or shm.size < spec.total_bytes:
            shm.close()
            raise ValueError(
                f"shared-memory segment {name} was made for a different NodeLoader: "
                + "; ".join(wrong or [f"size {shm.size} < {spec.total_bytes}"])
                + " (every local rank must pass the same arguments and state)"
            )
        return cls(shm, spec)

    # -- the data path ----------------------------------------------------------------

    def publish(self, step: int) -> None:
        """Make step ``step``, already written to its slot, available to the ranks."""
        slot = step % self.spec.depth
        for i in range(self.spec.dp_local):
            self.sums[slot, i] = digest(step, self.slots[slot, i])
        self.ready[slot] = step  # last; the ranks check the digests anyway

    def take(self, step: int, dp_index: int) -> np.ndarray[Any, Any] | None:
        """A copy of dp slice ``dp_index`` of step ``step``; None until it is all visible.

        None while the slot holds another step, and while the copy does not match the
        slice's digest: the counter became visible before the payload or the digest.
        """
        slot = step % self.spec.depth
        if self.ready[slot] != step:
            return None
        out: np.ndarray[Any, Any] = self.slots[slot, dp_index].copy()
        if digest(step, out) != self.sums[slot, dp_index]:
            return None
        return out

    # -- header access --------------------------------------------------------------

    @property
    def reader_state(self) -> int:
        return int(self.header[_READER_STATE])

    @property
    def stop_requested(self) -> bool:
        return bool(self.header[_STOP])

    def request_stop(self) -> None:
        self.header[_STOP] = 1

    def heartbeat(self) -> None:
        self.header[_HEARTBEAT_NS] = time.monotonic_ns()

    def heartbeat_age(self) -> float | None:
        """Seconds since the reader's last heartbeat (CLOCK_MONOTONIC is system-wide)."""
        ns = int(self.header[_HEARTBEAT_NS])
        return None if ns == 0 else (time.monotonic_ns() - ns) / 1e9

    def set_reader(self, pid: int) -> None:
        self.header[_READER_START] = process_starttime(pid) or 0
        self.header[_READER_PID] = pid

    @property
    def reader_pid(self) -> int:
        return int(self.header[_READER_PID])

    def reader_alive(self) -> bool | None:
        """True or False; None while no reader has been recorded yet."""
        pid = self.reader_pid
        if pid == 0:
            return None
        return process_alive(pid, int(self.header[_READER_START]))

    @property
    def creator_pid(self) -> int:
        return int(self.header[_CREATOR_PID])

    def creator_alive(self) -> bool:
        return _owner_alive(self.header)

    def set_running(self) -> None:
        self.heartbeat()
        self.header[_READER_STATE] = RUNNING

    def set_exited(self) -> None:
        if self.reader_state != FAILED:
            self.header[_READER_STATE] = EXITED

    def register_rank(self, local_rank: int) -> None:
        pid = os.getpid()
        self.rank_start[local_rank] = process_starttime(pid) or 0
        self.rank_pid[local_rank] = pid

    def detach_rank(self, local_rank: int) -> None:
        self.consumed[local_rank] = DETACHED
        self.rank_pid[local_rank] = 0

    def dead_ranks(self) -> list[tuple[int, int]]:
        """(local rank, pid) of every attached rank whose process is gone."""
        return [
            (lr, int(pid))
            for lr, (pid, start) in enumerate(zip(self.rank_pid, self.rank_start, strict=True))
            if pid != 0 and not process_alive(int(pid), int(start))
        ]

    # -- errors -----------------------------------------------------------------------

    def fail(self, step: int, text: str, exc: BaseException | None = None) -> None:
        """Record the reader's failure at ``step``; ranks raise it once they get there."""
        raw = text.encode("utf-8", "replace")[:_ERROR_TEXT_BYTES]
        self._error_text[: len(raw)] = np.frombuffer(raw, np.uint8)
        self.header[_ERROR_TEXT_LEN] = len(raw)
        blob = b""
        if exc is not None:
            with contextlib.suppress(Exception):
                blob = pickle.dumps(exc)
        if 0 < len(blob) <= _ERROR_PICKLE_BYTES:
            self._error_pickle[: len(blob)] = np.frombuffer(blob, np.uint8)
            self.header[_ERROR_PICKLE_LEN] = len(blob)
        else:
            blob = b""
        self.header[_ERROR_STEP] = step
        self.header[_ERROR_SUM] = _error_digest(step, raw, blob)
        self.header[_READER_STATE] = FAILED

    def failure(self) -> tuple[int, str, BaseException | None] | None:
        """The recorded failure: its step, its text, and the exception itself when it
        unpickles; None while there is none, or it is not all visible yet."""
        if self.reader_state != FAILED:
            return None
        step = int(self.header[_ERROR_STEP])
        n_text = int(self.header[_ERROR_TEXT_LEN])
        n_pickle = int(self.header[_ERROR_PICKLE_LEN])
        if not (0 <= n_text <= _ERROR_TEXT_BYTES and 0 <= n_pickle <= _ERROR_PICKLE_BYTES):
            return None
        raw = self._error_text[:n_text].tobytes()
        blob = self._error_pickle[:n_pickle].tobytes()
        if self.header[_ERROR_SUM] != _error_digest(step, raw, blob):
            return None
        exc: BaseException | None = None
        if blob:
            with contextlib.suppress(Exception):
                loaded = pickle.loads(blob)
                if isinstance(loaded, BaseException):
                    exc = loaded
        return step, raw.decode("utf-8", "replace"), exc

    # -- closing ----------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the name, unless it now names someone else's newer segment."""
        path = os.path.join(SHM_DIR, self.name)
        try:
            if self.inode and os.stat(path).st_ino != self.inode:
                return
        except FileNotFoundError:
            return
        _unlink(self.name)

    def close(self) -> None:
        """Unmap. Views handed out earlier must be gone (copies are fine)."""
        for attr in ("header", "ready", "consumed", "rank_pid", "rank_start", "sums", "slots"):
            self.__dict__.pop(attr, None)
        self.__dict__.pop("_error_text", None)
        self.__dict__.pop("_error_pickle", None)
        with contextlib.suppress(BufferError):
            self._shm.close()


def _header_digest(head: np.ndarray[Any, np.dtype[np.int64]]) -> int:
    return digest(VERSION, np.ascontiguousarray(head[list(_FIXED)]))


def _error_digest(step: int, text: bytes, blob: bytes) -> int:
    lengths = np.array([len(text), len(blob)], np.int64)
    return digest(step, lengths, text, blob)


def _owner_alive(head: np.ndarray[Any, np.dtype[np.int64]]) -> bool:
    """Whether the creator recorded in a header still runs on this boot.

    A creator in another pid namespace (a container sharing this /dev/shm) cannot be
    checked from here and counts as alive: its segment is not ours to remove.
    """
    if (int(head[_BOOT_HI]), int(head[_BOOT_LO])) != boot_id():
        return False
    if int(head[_PID_NS]) != pid_namespace():
        return True
    return process_alive(int(head[_CREATOR_PID]), int(head[_CREATOR_START]))


# -- the segment namespace ---------------------------------------------------------------


def shm_free_bytes() -> int | None:
    """Bytes an unprivileged process can still allocate in /dev/shm, None without one."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def sweep_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink ``prefix*`` segments whose creator is dead; return their names.

    Only the creator's liveness counts: the reader never needs the name after it has
    attached, and it unlinks by inode, so removing the name under an orphaned reader
    is safe. Segments of other users (no permission) are left alone.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            with open(entry.path, "rb") as f:
                raw = f.read(8 * _N_FIELDS)
            age = time.time() - entry.stat().st_mtime
        except OSError:
            continue
        if len(raw) < 8 * _N_FIELDS:
            head = None
        else:
            head = np.frombuffer(raw, np.int64)
            if head[_MAGIC] != MAGIC or head[_INIT_DONE] != 1:
                head = None
        if head is None:
            if age < _UNINITIALISED_GRACE_S:
                continue  # probably being created right now
        elif _owner_alive(head):
            continue
        with contextlib.suppress(FileNotFoundError, PermissionError):
            _unlink(entry.name)
            removed.append(entry.name)
    return removed


def describe_segment(name: str) -> str:
    """Creator and reader of an existing segment, for error messages."""
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            head = np.frombuffer(f.read(8 * _N_FIELDS), np.int64)
    except (OSError, ValueError):
        return "unreadable"
    if len(head) < _N_FIELDS or head[_MAGIC] != MAGIC:
        return "not an initialised ms_data ring"
    return f"created by pid {head[_CREATOR_PID]}, reader pid {head[_READER_PID]}"


# -- helpers ---------------------------------------------------------------------------


class _Segment:
    """``/dev/shm/<name>``, mapped read-write."""

    def __init__(self, name: str, *, create: bool, size: int = 0) -> None:
        self.name = name
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                # tmpfs allocates pages on first touch; a full /dev/shm would then kill
                # the writer with SIGBUS mid-run. Reserving now makes it ENOSPC here.
                os.posix_fallocate(fd, 0, size)
            st = os.fstat(fd)
            self.inode = st.st_ino
            self.size = st.st_size
            self._mmap = mmap.mmap(fd, self.size) if self.size else None
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    def close(self) -> None:
        self.buf.release()
        if self._mmap is not None:
            self._mmap.close()


def _unlink(name: str) -> None:
    os.unlink(os.path.join(SHM_DIR, name))


def space_message(spec: RingSpec, needed: int, free: int) -> str:
    return (
        f"the NodeLoader ring needs {needed} bytes ({needed / 2**20:.1f} MiB) of shared "
        f"memory but {SHM_DIR} has {free} bytes ({free / 2**20:.1f} MiB) free: "
        f"{spec.describe()}. Lower depth or micro_batch, or give the container more "
        "shared memory (docker run --shm-size, a larger tmpfs on /dev/shm)"
    )


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))
