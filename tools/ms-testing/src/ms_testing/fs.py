"""A local filesystem under ``counting://`` that counts the bytes read, across processes.

Tests use it to prove I/O claims with real reads: that reading one document of a shard
touches only its chunks, and that a node's shards are read once, not once per rank.
Every read appends one record ``[pid, bytes, path]`` to a counter file under an
``fcntl`` lock, so any number of processes (spawned ones included) add to one total.

The counter file is the ``counter`` argument, or else the ``MS_TESTING_COUNTER``
environment variable at the time of the read, which child processes inherit:

    os.environ[COUNTER_ENV] = str(tmp_path / "reads")
    reader = ShardReader("counting:///abs/path/shard-00000.mss")
    ...
    assert read_counts(tmp_path / "reads").total == expected

``counting://`` is registered with fsspec through the ``fsspec.specs`` entry point of
this package, so ``fsspec.filesystem("counting")`` and URLs work in every process
where ms-testing is installed. Files open unbuffered for reading: the bytes counted
are exactly the bytes the caller asked the operating system for, with no read-ahead.
"""

from __future__ import annotations

import fcntl
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsspec.implementations.local import LocalFileOpener, LocalFileSystem
from fsspec.utils import stringify_path

__all__ = ["COUNTER_ENV", "CountingFileSystem", "ReadCounts", "read_counts", "reset_counts"]

COUNTER_ENV = "MS_TESTING_COUNTER"
_PREFIX = "counting://"


def _append(counter: str, record: list[Any]) -> None:
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(counter, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one whole line per read, whatever the writers
        os.write(fd, line)
    finally:
        os.close(fd)  # releases the lock


class _CountingRaw(io.RawIOBase):
    """An unbuffered file whose every read reports its size."""

    def __init__(self, raw: io.FileIO, record: Callable[[int], None]) -> None:
        super().__init__()
        self._raw = raw
        self._record = record

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._raw.readinto(buffer)
        if n:
            self._record(n)
        return n or 0

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(pos, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    @property
    def raw(self) -> io.FileIO:
        return self._raw

    def close(self) -> None:
        self._raw.close()
        super().close()


class _CountingOpener(LocalFileOpener):  # type: ignore[misc]
    f: Any
    fs: Any
    path: str
    compression: str | None

    def _open(self) -> None:
        if self.f is None or self.f.closed:
            if self.compression:
                raise ValueError(f"CountingFileSystem does not decompress, got {self.compression}")
            fs: CountingFileSystem = self.fs
            path = self.path
            self.f = _CountingRaw(io.FileIO(path, "rb"), lambda n: fs.record(path, n))
            self.size = self.f.seek(0, io.SEEK_END)
            self.f.seek(0)


class CountingFileSystem(LocalFileSystem):  # type: ignore[misc]
    """The local filesystem as ``counting://``, recording every byte read.

    Writes are not counted. ``counter``: the counter file; None reads
    ``MS_TESTING_COUNTER`` at each read.
    """

    protocol = ("counting",)

    def __init__(self, counter: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counter = None if counter is None else os.fspath(counter)

    def counter_file(self) -> str:
        counter = self.counter or os.environ.get(COUNTER_ENV)
        if not counter:
            raise ValueError(
                f"CountingFileSystem needs a counter file: pass counter= or set {COUNTER_ENV}"
            )
        return counter

    def record(self, path: str, nbytes: int) -> None:
        """Add ``nbytes`` read from ``path`` to the counter file."""
        _append(self.counter_file(), [os.getpid(), nbytes, path])

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = stringify_path(path)
        if text.startswith(_PREFIX):
            text = text[len(_PREFIX) :]
        return str(LocalFileSystem._strip_protocol(text))

    def unstrip_protocol(self, name: str) -> str:
        return _PREFIX + self._strip_protocol(name)

    def _open(
        self, path: str, mode: str = "rb", block_size: int | None = None, **kwargs: Any
    ) -> Any:
        if mode != "rb":
            return super()._open(path, mode, block_size, **kwargs)
        return _CountingOpener(self._strip_protocol(path), mode, fs=self, **kwargs)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        # shutil copies behind the file objects' back: count the source's size.
        super().cp_file(path1, path2, **kwargs)
        if self.isfile(path1):
            self.record(self._strip_protocol(path1), self.size(path1))


@dataclass(frozen=True)
class ReadCounts:
    """What a counter file holds: totals over every process that read."""

    #: Bytes read in all.
    total: int = 0
    #: Read calls that returned data.
    calls: int = 0
    #: Bytes read per file path.
    by_path: dict[str, int] = field(default_factory=dict)
    #: Bytes read per process id.
    by_pid: dict[int, int] = field(default_factory=dict)


def read_counts(counter: str | os.PathLike[str]) -> ReadCounts:
    """Sum a counter file; an absent file is zero reads."""
    try:
        with open(counter, "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            lines = f.read().splitlines()
    except FileNotFoundError:
        return ReadCounts()
    by_path: dict[str, int] = {}
    by_pid: dict[int, int] = {}
    total = 0
    for line in lines:
        pid, n, path = json.loads(line)
        total += n
        by_path[path] = by_path.get(path, 0) + n
        by_pid[pid] = by_pid.get(pid, 0) + n
    return ReadCounts(total, len(lines), by_path, by_pid)


def reset_counts(counter: str | os.PathLike[str]) -> None:
    """Start a counter file over at zero."""
    fd = os.open(counter, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
