"""``ShardWriter``: one shard, written front to back in one pass (docs/format.md).

No seek-back, so the same writer streams to a local file (under a temporary name,
renamed when complete) or buffers for a single put on an object store. Either way a
crashed writer never leaves a file that passes for a shard.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from array import array
from typing import Any

import fsspec
import numpy as np
import zstandard
from fsspec.implementations.local import LocalFileSystem

from ms_data import _format as fmt
from ms_data._shard_common import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_LEVEL,
    ShardInfo,
    resolve,
    token_dtype,
)

__all__ = ["ShardWriter"]

# A compressed chunk's length is a u32 in the chunk table; zstd's worst case is a
# little above the input size, so inputs stay far below 4 GiB.
_MAX_CHUNK_BYTES = 1 << 30
# zstd's fastest negative level (ZSTD_minCLevel).
_MIN_LEVEL = -(1 << 17)


class _TempFileSink:
    """Streams to a temporary name beside the target and renames on commit.

    A writer killed mid-shard leaves only ``<name>.tmp-<pid>-<id>``, which no reader
    or ``Corpus`` glob mistakes for a shard; the rename makes the shard appear whole.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path
        self.tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fs.makedirs(fs._parent(path), exist_ok=True)
        self.f = fs.open(self.tmp, "wb")
        self.offset = 0

    def write(self, data: bytes) -> None:
        self.f.write(data)
        self.offset += len(data)

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())  # the rename must not outrun the data on a crash
        self.f.close()
        self.fs.mv(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.tmp)


class _BufferSink:
    """Collects the shard in memory and stores it with one put at commit.

    Object stores have no rename, and one put is atomic there: a shard is either
    absent or whole.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self.fs, self.path = fs, path
        self.parts: list[bytes] = []
        self.offset = 0

    def write(self, data: bytes) -> None:
        self.parts.append(data)
        self.offset += len(data)

    def commit(self) -> None:
        self.fs.pipe_file(self.path, b"".join(self.parts))
        self.parts = []

    def abort(self) -> None:
        self.parts = []


def _as_tokens(tokens: Any, dtype: np.dtype[np.unsignedinteger], doc: int) -> np.ndarray:
    """A fresh array of ``dtype`` holding the document, or ValueError/TypeError."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"document {doc}: tokens must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"document {doc}: token ids must be integers, got dtype {arr.dtype}")
    hi = int(np.iinfo(dtype).max)
    if not (arr.dtype.kind == "u" and arr.dtype.itemsize <= dtype.itemsize):
        bad = (arr < 0) | (arr > hi)
        if bad.any():
            at = int(np.argmax(bad))
            raise ValueError(
                f"document {doc}: token id {int(arr[at])} at position {at} does not fit "
                f"{dtype.name} (0..{hi}); write with dtype='uint32' or check the tokenizer"
            )
    # Always a copy: the writer keeps the tail of a document until its chunk fills,
    # and the caller may reuse its buffer.
    return arr.astype(dtype, copy=True)


class ShardWriter:
    """Writes one shard, front to back; a context manager whose ``close()`` returns ``ShardInfo``.

    Tokens are cut into chunks of exactly ``chunk_tokens`` as they arrive, so memory
    stays at one chunk (plus the index) on local disks. On filesystems without rename
    (object stores, ``memory://``) the compressed shard is buffered and stored in one
    put at close. Leaving the ``with`` block by an exception discards the shard.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        dtype: object = "uint16",
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        level: int = DEFAULT_LEVEL,
        fs: fsspec.AbstractFileSystem | None = None,
    ) -> None:
        self.path = os.fspath(url)
        self.dtype = token_dtype(dtype)
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        if chunk_tokens * self.dtype.itemsize > _MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_tokens * itemsize must be at most {_MAX_CHUNK_BYTES} bytes, got "
                f"{chunk_tokens} * {self.dtype.itemsize}"
            )
        if (
            isinstance(level, bool)
            or not isinstance(level, int)
            or not _MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL
        ):
            raise ValueError(
                f"level must be a zstd level, an int in [{_MIN_LEVEL}, "
                f"{zstandard.MAX_COMPRESSION_LEVEL}], got {level!r}"
            )
        self._cctx = zstandard.ZstdCompressor(
            level=level, write_checksum=True, write_content_size=True
        )
        self.chunk_tokens = chunk_tokens
        self.level = level
        self._fs, fs_path = resolve(url, fs)
        self._sink: _TempFileSink | _BufferSink = (
            _TempFileSink(self._fs, fs_path)
            if isinstance(self._fs, LocalFileSystem)
            else _BufferSink(self._fs, fs_path)
        )
        self._code = fmt.dtype_code(self.dtype)
        self._sink.write(fmt.pack_header(self._code))
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._doc_offsets = array("Q", [0])
        self._chunks: list[tuple[int, int, int]] = []
        self._n_tokens = 0
        self._state = "open"
        self._info: ShardInfo | None = None

    @property
    def n_docs(self) -> int:
        """Documents added so far."""
        return len(self._doc_offsets) - 1

    @property
    def n_tokens(self) -> int:
        """Tokens added so far."""
        return self._n_tokens

    def add_document(self, tokens: Any) -> None:
        """Append one document: a 1-D sequence or array of token ids (may be empty)."""
        if self._state != "open":
            raise ValueError(f"the writer of {self.path} is {self._state}")
        arr = _as_tokens(tokens, self.dtype, self.n_docs)
        if arr.size:
            self._pending.append(arr)
            self._pending_tokens += arr.size
            self._n_tokens += arr.size
        self._doc_offsets.append(self._n_tokens)
        if self._pending_tokens >= self.chunk_tokens:
            self._flush(final=False)

    def _flush(self, *, final: bool) -> None:
        if not self._pending:
            return
        buf = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        c = self.chunk_tokens
        n_full = len(buf) // c
        for k in range(n_full):
            self._write_chunk(buf[k * c : (k + 1) * c])
        rest = buf[n_full * c :]
        if final and rest.size:
            self._write_chunk(rest)
            rest = rest[:0]
        self._pending = [rest] if rest.size else []
        self._pending_tokens = int(rest.size)

    def _write_chunk(self, tokens: np.ndarray) -> None:
        data = self._cctx.compress(np.ascontiguousarray(tokens).data.cast("B"))
        self._chunks.append((self._sink.offset, len(data), fmt.crc32(data)))
        self._sink.write(data)

    def close(self) -> ShardInfo:
        """Write the index and footer and publish the shard; idempotent."""
        if self._info is not None:
            return self._info
        if self._state != "open":
            raise ValueError(f"the writer of {self.path} is {self._state}")
        try:
            self._flush(final=True)
            offsets = np.frombuffer(self._doc_offsets, dtype=np.uint64).astype(fmt.OFFSET_ENTRY)
            table = np.array(self._chunks, dtype=fmt.CHUNK_ENTRY)
            index = offsets.tobytes() + table.tobytes()
            index_offset = self._sink.offset
            self._sink.write(index)
            self._sink.write(
                fmt.pack_footer(
                    n_docs=self.n_docs,
                    n_tokens=self._n_tokens,
                    n_chunks=len(self._chunks),
                    index_offset=index_offset,
                    index_length=len(index),
                    chunk_tokens=self.chunk_tokens,
                    index_crc32=fmt.crc32(index),
                    dtype_code=self._code,
                )
            )
            nbytes = self._sink.offset
            self._sink.commit()
        except BaseException:
            self.abort()
            raise
        self._state = "closed"
        self._info = ShardInfo(
            self.path, self.dtype, self.n_docs, self._n_tokens, len(self._chunks), nbytes
        )
        return self._info

    def abort(self) -> None:
        """Discard the shard: nothing appears under its name."""
        if self._state == "open":
            self._state = "aborted"
            self._sink.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()
