"""One run per directory: an exclusive lock on a run's out dir and checkpoint dir.

Two runs in one directory interleave their metrics and race for the same checkpoint
steps. So a run holds ``<dir>/.ms-train.lock`` in each of its directories with
``fcntl.flock`` for its whole life; the file says who holds it (JSON: host, pid, start
time, command). A second run is refused at once with a ``RunLockedError`` naming the
holder. The kernel releases a flock when its holder dies, however it dies (SIGKILL
included), so a lock file whose lock is free but which still names a run is a stale
lock: it is taken over, and the takeover is logged. A run that ends cleanly empties the
file before it lets go, so the next run starts without a takeover message.

With several ranks, rank 0 alone takes the lock, before anything of the run writes, and
every rank learns the outcome and fails with the same error.

Across hosts on a shared filesystem: Linux's NFS client (v3 with lockd, v4) turns a
flock into a whole-file lock the server arbitrates, so a run on another host is refused
as well, and its host is named in the message. When a host dies holding the lock, the
server frees it only when that host's lease expires (about 90 s on NFSv4), and a run
started before then is refused, naming the dead run. Filesystems without lock support
(some FUSE and object-store mounts, Lustre mounted without ``flock``) fail the flock
call: the run then goes on without the lock and says so. A checkpoint dir that is not a
local path (``s3://``, ``memory://``) is not locked.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from ms_train.errors import JobError

__all__ = [
    "LOCK_NAME",
    "RunLock",
    "RunLockedError",
    "lock_job",
    "lock_run",
]

LOCK_NAME = ".ms-train.lock"
# A holder writes its details right after it takes the lock; a contender that finds the
# lock taken but the file empty waits this long for them before it reports an unknown
# holder (the holder may also be emptying it on its way out).
_DETAILS_WAIT_S = 2.0


class RunLockedError(JobError):
    """Another live run holds the out dir or the checkpoint dir; the message names it."""


def _holder_text(info: dict[str, Any]) -> str:
    host = info.get("host", "?")
    here = "" if host == socket.gethostname() else " (another host)"
    command = info.get("command")
    text = f"pid {info.get('pid', '?')} on host {host}{here}, started {info.get('started', '?')}"
    return text + (f", command: {command}" if command else "")


def _read_details(f: IO[str]) -> dict[str, Any] | None:
    f.seek(0)
    try:
        info = json.loads(f.read() or "null")
    except ValueError:  # torn by a holder that died while writing it
        return None
    return info if isinstance(info, dict) else None


class RunLock:
    """The locks a run holds; :meth:`release` lets them go (closing the files does too,
    and the kernel does when the process dies)."""

    def __init__(self, files: Sequence[IO[str]] = ()) -> None:
        self._files = list(files)

    @property
    def paths(self) -> list[str]:
        """The lock files held."""
        return [f.name for f in self._files]

    def release(self) -> None:
        """Empty each lock file (no takeover for the next run), unlock and close it."""
        files, self._files = self._files, []
        for f in files:
            try:
                f.truncate(0)
                f.flush()
            except OSError:
                pass  # the lock still goes; the next run just logs a takeover
            finally:
                f.close()


def _lock_one(
    field: str, directory: Path, details: str, log: Callable[[str], None]
) -> IO[str] | None:
    """Lock ``directory`` (the config ``field`` names it) or raise ``RunLockedError``;
    None where the filesystem cannot lock."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        f = open(directory / LOCK_NAME, "a+")  # noqa: SIM115 - held until release()
    except OSError as e:
        raise JobError(
            f"{field}: cannot create the run lock {directory / LOCK_NAME}: "
            f"{e.strerror or e} (the directory must be writable)"
        ) from e
    deadline = time.monotonic() + _DETAILS_WAIT_S
    while True:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _read_details(f)
            if holder is None and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            f.close()
            who = _holder_text(holder) if holder else "a run whose details are not written"
            raise RunLockedError(
                f"{field} {directory} is in use by another run ({who}); wait for it to "
                f"end or stop it, or choose another {field}"
            ) from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                f.close()
                raise
            log(
                f"ms-train: warning: {field} {directory}: this filesystem cannot lock files "
                f"({e.strerror}); running without the one-run-per-directory lock"
            )
            f.close()
            return None
    stale = _read_details(f)
    if stale:
        log(
            f"ms-train: {field} {directory}: took over the lock of a run that is gone "
            f"({_holder_text(stale)})"
        )
    f.seek(0)
    f.truncate(0)
    f.write(details)
    f.flush()
    return f


def lock_run(
    dirs: Sequence[tuple[str, str]],
    *,
    log: Callable[[str], None],
    command: Sequence[str] | None = None,
) -> RunLock:
    """Lock every ``(config field, directory)`` of ``dirs`` for this process.

    A directory that is not a local path (an fsspec URL other than ``file://``) is
    skipped, and so is one that is the same as an earlier one. Raises
    ``RunLockedError`` naming the live holder (nothing stays locked then); logs through
    ``log`` when it takes over a stale lock.
    """
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    details = json.dumps(
        {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": started,
            "command": shlex.join(sys.argv if command is None else command),
        }
    )
    held: list[IO[str]] = []
    seen: set[str] = set()
    try:
        for field, where in dirs:
            path = where.removeprefix("file://")
            if "://" in path:
                continue
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            f = _lock_one(field, Path(path), details, log)
            if f is not None:
                held.append(f)
    except BaseException:
        RunLock(held).release()
        raise
    return RunLock(held)


def lock_job(
    dirs: Sequence[tuple[str, str]],
    *,
    rank: int,
    agree: Callable[[Any], Any],
    log: Callable[[str], None],
) -> RunLock:
    """:func:`lock_run` on rank 0; ``agree(value)`` gives every rank rank 0's ``value``
    (collective), so that every rank of a refused run raises the same error. Ranks
    other than 0 get an empty ``RunLock``."""
    lock, outcome, error = RunLock(), None, None
    if rank == 0:
        try:
            lock = lock_run(dirs, log=log)
        except JobError as e:
            outcome, error = (isinstance(e, RunLockedError), str(e)), e
        except BaseException as e:
            # The other ranks wait for the outcome: tell them, then fail with the cause.
            agree((False, f"rank 0 could not lock the run directories: {type(e).__name__}: {e}"))
            raise
    outcome = agree(outcome)
    if outcome is None:
        return lock
    if error is not None:
        raise error
    locked, message = outcome
    raise (RunLockedError if locked else JobError)(message)
