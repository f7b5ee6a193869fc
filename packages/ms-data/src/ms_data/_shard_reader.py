"""``ShardReader``: one shard read by ranged reads (docs/format.md).

Opening reads the header, the footer and the index, once, and checks all three;
after that a read fetches only the chunks it overlaps, in one ranged read, and
checks each (crc32, zstd's checksum, length). A reader pickles as its URL (plus an
explicit filesystem, if one was given), so a loader process reopens the shard
instead of receiving its contents.

Local files are read with ``os.pread`` on a descriptor kept open (``_LocalFiles``)
rather than through ``fsspec``'s ``cat_file``, which opens and closes the file on every
call: for a shuffled sample that touches one small chunk, the open, the close and
fsspec's path handling cost as much as the decompression.
"""

from __future__ import annotations

import operator
import os
import threading
from collections import OrderedDict
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
import zstandard
from fsspec.implementations.local import LocalFileSystem

from ms_data import _format as fmt
from ms_data._shard_common import ChunkCorruptError, ShardError, resolve

__all__ = ["ShardReader"]

# verify() reads chunks in ranged reads of about this many bytes.
_VERIFY_READ_BYTES = 16 << 20
# Local shards kept open per process; a corpus of thousands of shards must not use up
# the process's file descriptors (often 1024).
_MAX_OPEN_FILES = 64


class _LocalFiles:
    """Read-only descriptors of local shards, the least recently used closed first.

    ``pread`` does not move a file offset, so threads and forked children (DataLoader
    workers inherit the descriptors) can share one descriptor. Reads hold the lock so
    that an eviction never closes a descriptor another thread is reading from (whose
    number the kernel could hand to an unrelated file meanwhile).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._fds: OrderedDict[str, int] = OrderedDict()

    def after_fork(self) -> None:
        # Another thread may have held the lock when the process forked.
        self._lock = threading.Lock()

    def forget(self, path: str) -> None:
        """Close ``path``'s descriptor: a new reader must see the file now at that path."""
        with self._lock:
            fd = self._fds.pop(path, None)
            if fd is not None:
                os.close(fd)

    def pread(self, path: str, start: int, end: int) -> bytes:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                self._fds[path] = fd
                if len(self._fds) > self.limit:
                    os.close(self._fds.popitem(last=False)[1])
            else:
                self._fds.move_to_end(path)
            return os.pread(fd, end - start, start)


_local_files = _LocalFiles(_MAX_OPEN_FILES)
os.register_at_fork(after_in_child=_local_files.after_fork)


class ShardReader:
    """Reads one shard by ranged reads; footer and index are read once, at construction.

    Picklable: a copy reopens the shard by its URL (and the explicit ``fs``, if one
    was given) and refuses a file that changed since (different footer).
    """

    path: str
    dtype: np.dtype[np.unsignedinteger]
    n_docs: int
    n_tokens: int
    n_chunks: int
    #: Tokens per chunk (the last chunk may hold fewer).
    chunk_tokens: int
    #: File size in bytes.
    nbytes: int
    #: Token offsets of the documents, ``n_docs + 1`` entries, read-only.
    doc_offsets: npt.NDArray[np.uint64]
    #: Per chunk: byte ``offset``, compressed ``length``, ``crc32``; read-only.
    chunk_table: np.ndarray

    def __init__(
        self, url: str | os.PathLike[str], *, fs: fsspec.AbstractFileSystem | None = None
    ) -> None:
        self.path = os.fspath(url)
        self.fs, self._fs_path = resolve(url, fs)
        self._explicit_fs = fs is not None
        # Exactly fsspec's LocalFileSystem (a subclass may count or change reads).
        self._local_file = type(self.fs) is LocalFileSystem
        # One decoded chunk: consecutive documents mostly share their boundary chunk.
        self._cache: tuple[int, np.ndarray] | None = None
        self._local = threading.local()  # a zstd context per thread (they are not shareable)
        self._open()

    def _error(self, offset: int, reason: str) -> ShardError:
        return ShardError(self.path, offset, reason)

    def _read(self, start: int, end: int) -> bytes:
        if self._local_file:
            data = _local_files.pread(self._fs_path, start, end)
        else:
            data = bytes(self.fs.cat_file(self._fs_path, start=start, end=end))
        if len(data) != end - start:
            raise self._error(
                start + len(data),
                f"truncated: wanted bytes {start}..{end}, the file ends at {start + len(data)}",
            )
        return data

    def _open(self) -> None:
        if self._local_file:
            # The file may have been replaced since another reader opened this path.
            _local_files.forget(self._fs_path)
        size = self.fs.size(self._fs_path)
        if size is None:  # the footer is found from the end: the size is needed
            raise self._error(0, f"{type(self.fs).__name__} does not report the file's size")
        if size < fmt.MIN_SIZE:
            raise self._error(
                size,
                f"truncated: the file is {size} bytes, a shard has at least {fmt.MIN_SIZE} "
                f"(header and footer)",
            )
        header = fmt.unpack_header(self._read(0, fmt.HEADER_SIZE))
        if header.magic != fmt.MAGIC:
            raise self._error(
                0, f"bad magic {header.magic!r}, expected {fmt.MAGIC!r}: not an ms-data shard"
            )
        if header.version != fmt.VERSION:
            raise self._error(
                fmt.HEADER_VERSION_AT,
                f"unsupported format version {header.version}; this reader reads version "
                f"{fmt.VERSION}",
            )
        if header.dtype_code not in fmt.DTYPE_CODES:
            raise self._error(
                fmt.HEADER_DTYPE_AT,
                f"unknown dtype code {header.dtype_code}; known codes: 1 (uint16), 2 (uint32)",
            )
        at = size - fmt.FOOTER_SIZE
        raw = self._read(at, size)
        foot = fmt.unpack_footer(raw)
        if foot.magic != fmt.MAGIC:
            raise self._error(
                size - len(fmt.MAGIC),
                f"no footer magic at the end of the file ({size} bytes): truncated, or the "
                f"writer died before finishing it",
            )
        if not foot.stored_crc_matches(raw):
            raise self._error(
                at,
                f"footer checksum mismatch: stored 0x{foot.footer_crc32:08x}, computed "
                f"0x{fmt.crc32(raw[: fmt.FOOTER_CRC_SPAN]):08x}",
            )
        if (foot.version, foot.dtype_code) != (header.version, header.dtype_code):
            raise self._error(
                fmt.HEADER_VERSION_AT,
                f"header (version {header.version}, dtype code {header.dtype_code}) disagrees "
                f"with the footer (version {foot.version}, dtype code {foot.dtype_code})",
            )
        chunks_needed = -(-foot.n_tokens // foot.chunk_tokens) if foot.chunk_tokens else -1
        if foot.n_chunks != chunks_needed:
            raise self._error(
                at + 16,
                f"footer inconsistent: {foot.n_chunks} chunks for {foot.n_tokens} tokens of "
                f"{foot.chunk_tokens} per chunk",
            )
        if foot.index_length != fmt.index_length(foot.n_docs, foot.n_chunks):
            raise self._error(
                at + 32,
                f"footer inconsistent: index length {foot.index_length} for {foot.n_docs} "
                f"documents and {foot.n_chunks} chunks (expected "
                f"{fmt.index_length(foot.n_docs, foot.n_chunks)})",
            )
        end = foot.index_offset + foot.index_length + fmt.FOOTER_SIZE
        if end > size:
            raise self._error(size, f"truncated: the footer says {end} bytes, the file is {size}")
        if end < size or foot.index_offset < fmt.HEADER_SIZE:
            raise self._error(
                at + 24,
                f"footer inconsistent: index at {foot.index_offset} + {foot.index_length} bytes "
                f"+ footer does not end the {size}-byte file",
            )
        index = self._read(foot.index_offset, foot.index_offset + foot.index_length)
        if fmt.crc32(index) != foot.index_crc32:
            raise self._error(
                foot.index_offset,
                f"index checksum mismatch: footer says 0x{foot.index_crc32:08x}, index has "
                f"0x{fmt.crc32(index):08x}",
            )
        n_off = foot.n_docs + 1
        offsets = np.frombuffer(index, fmt.OFFSET_ENTRY, count=n_off)
        table = np.frombuffer(index, fmt.CHUNK_ENTRY, offset=8 * n_off, count=foot.n_chunks)
        self._check_index(offsets, table, foot)

        self.dtype = fmt.DTYPE_CODES[header.dtype_code]
        self.version = header.version
        self.n_docs = foot.n_docs
        self.n_tokens = foot.n_tokens
        self.n_chunks = foot.n_chunks
        self.chunk_tokens = foot.chunk_tokens
        self.nbytes = size
        self.doc_offsets = offsets.astype(np.uint64, copy=False)
        self.chunk_table = table
        self._footer_crc = foot.footer_crc32
        self._lengths: np.ndarray | None = None

    def _check_index(self, offsets: np.ndarray, table: np.ndarray, foot: fmt.Footer) -> None:
        """An index with a valid checksum can still come from a buggy writer."""
        at = foot.index_offset
        if offsets[0] != 0 or offsets[-1] != foot.n_tokens:
            raise self._error(
                at,
                f"index inconsistent: document offsets run from {offsets[0]} to {offsets[-1]}, "
                f"expected 0 to n_tokens = {foot.n_tokens}",
            )
        drops = np.flatnonzero(offsets[1:] < offsets[:-1])
        if drops.size:
            i = int(drops[0])
            raise self._error(
                at + 8 * (i + 1),
                f"index inconsistent: document {i} ends at {offsets[i + 1]}, before it starts "
                f"at {offsets[i]}",
            )
        lengths = table["length"].astype(np.int64)
        starts = fmt.HEADER_SIZE + np.concatenate([[0], np.cumsum(lengths)])
        bad = np.flatnonzero(table["offset"].astype(np.int64) != starts[:-1])
        if bad.size or starts[-1] != foot.index_offset:
            c = int(bad[0]) if bad.size else foot.n_chunks
            raise self._error(
                at + 8 * (foot.n_docs + 1) + 16 * c,
                f"index inconsistent: chunk table does not tile bytes {fmt.HEADER_SIZE}.."
                f"{foot.index_offset} (first bad entry: chunk {c})",
            )

    def doc_lengths(self) -> npt.NDArray[np.int64]:
        """Tokens per document, int64, read-only."""
        if self._lengths is None:
            lengths = np.diff(self.doc_offsets.astype(np.int64)).astype(np.int64, copy=False)
            lengths.flags.writeable = False
            self._lengths = lengths
        return self._lengths

    def read_document(self, i: int) -> np.ndarray:
        """Document ``i``'s tokens (a new array of ``dtype``); IndexError if out of range."""
        i = operator.index(i)
        if not 0 <= i < self.n_docs:
            raise IndexError(
                f"document {i} out of range: {self.path} holds {self.n_docs} documents"
            )
        return self.read_tokens(int(self.doc_offsets[i]), int(self.doc_offsets[i + 1]))

    def read_tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the shard's token stream, across documents."""
        start, stop = operator.index(start), operator.index(stop)
        if not 0 <= start <= stop <= self.n_tokens:
            raise IndexError(
                f"token range [{start}, {stop}) out of range: {self.path} holds "
                f"{self.n_tokens} tokens"
            )
        if start == stop:
            return np.empty(0, self.dtype)
        c0 = start // self.chunk_tokens
        c1 = (stop - 1) // self.chunk_tokens + 1
        parts = self._chunks(c0, c1)
        lo = start - c0 * self.chunk_tokens
        whole = parts[0] if len(parts) == 1 else np.concatenate(parts)
        out: np.ndarray = whole[lo : lo + stop - start]
        # A single chunk's slice is a view of the cached chunk: hand out a copy.
        return out.copy() if len(parts) == 1 else out

    def _chunks(self, c0: int, c1: int) -> list[np.ndarray]:
        """Decoded chunks ``c0 .. c1 - 1``, fetched in one ranged read."""
        parts: list[np.ndarray] = []
        first = c0
        cached = self._cache
        if cached is not None and cached[0] == c0:
            parts.append(cached[1])
            first += 1
        if first < c1:
            table = self.chunk_table
            base = int(table[first]["offset"])
            end = int(table[c1 - 1]["offset"]) + int(table[c1 - 1]["length"])
            raw = memoryview(self._read(base, end))
            for c in range(first, c1):
                off = int(table[c]["offset"]) - base
                parts.append(self._decode(c, raw[off : off + int(table[c]["length"])]))
            self._cache = (c1 - 1, parts[-1])
        return parts

    def _decode(self, c: int, data: memoryview) -> np.ndarray:
        entry = self.chunk_table[c]
        offset, stored = int(entry["offset"]), int(entry["crc32"])
        crc = fmt.crc32(data)
        if crc != stored:
            raise ChunkCorruptError(
                self.path,
                offset,
                c,
                f"chunk {c} is corrupt: crc32 of its {len(data)} compressed bytes is "
                f"0x{crc:08x}, the index says 0x{stored:08x}",
            )
        n = min(self.chunk_tokens, self.n_tokens - c * self.chunk_tokens)
        want = n * self.dtype.itemsize
        try:
            size = zstandard.frame_content_size(data)
            if size != want:
                raise zstandard.ZstdError(f"frame content size {size}, expected {want}")
            out = self._dctx().decompress(data)
        except zstandard.ZstdError as e:
            raise ChunkCorruptError(
                self.path, offset, c, f"chunk {c} is corrupt: zstd cannot decode it: {e}"
            ) from e
        if len(out) != want:
            raise ChunkCorruptError(
                self.path, offset, c, f"chunk {c} decoded to {len(out)} bytes, expected {want}"
            )
        return np.frombuffer(out, self.dtype)

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx: zstandard.ZstdDecompressor | None = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def verify(self) -> list[ChunkCorruptError]:
        """Check every chunk (crc32, decompression, length); the damaged ones, in order."""
        errors: list[ChunkCorruptError] = []
        table = self.chunk_table
        c = 0
        while c < self.n_chunks:
            base = int(table[c]["offset"])
            stop = c + 1
            while (
                stop < self.n_chunks
                and int(table[stop]["offset"]) + int(table[stop]["length"]) - base
                <= _VERIFY_READ_BYTES
            ):
                stop += 1
            end = int(table[stop - 1]["offset"]) + int(table[stop - 1]["length"])
            raw = memoryview(self._read(base, end))
            for k in range(c, stop):
                off = int(table[k]["offset"]) - base
                try:
                    self._decode(k, raw[off : off + int(table[k]["length"])])
                except ChunkCorruptError as e:
                    errors.append(e)
            c = stop
        return errors

    def __reduce__(self) -> tuple[Any, ...]:
        fs = self.fs if self._explicit_fs else None
        return (_reopen_reader, (self.path, fs, self._footer_crc))

    def __repr__(self) -> str:
        return (
            f"ShardReader({self.path!r}, n_docs={self.n_docs}, n_tokens={self.n_tokens}, "
            f"dtype={self.dtype.name})"
        )


def _reopen_reader(url: str, fs: fsspec.AbstractFileSystem | None, footer_crc: int) -> ShardReader:
    reader = ShardReader(url, fs=fs)
    if reader._footer_crc != footer_crc:
        # The dataset's sample stream is a function of the shards' contents: a copy
        # that silently read a rewritten shard would break exact resume.
        raise ShardError(
            reader.path,
            reader.nbytes - fmt.FOOTER_SIZE,
            f"the shard changed since its reader was pickled (footer crc32 0x{footer_crc:08x} "
            f"then, 0x{reader._footer_crc:08x} now)",
        )
    return reader
