"""What every layer of the shard code shares: errors, defaults, ShardInfo, URL resolution."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

from ms_data import _format as fmt

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_LEVEL",
    "SHARD_SUFFIX",
    "ChunkCorruptError",
    "ShardError",
    "ShardInfo",
    "resolve",
    "token_dtype",
]

#: 8k tokens: 16 KiB of uint16 before compression. A shuffled sample decompresses
#: every chunk it overlaps, so the chunk size is the read amplification of random
#: access: at 64k tokens a 129-token sample decoded 128 KiB, and decompression was
#: 55% of ``PackedDataset.sample`` (about 2 ms of CPU per micro-batch, on the cores
#: the training step uses). 8k decodes 8x less for about 20% larger files on byte
#: tokens (zstd finds fewer matches in a smaller window; BPE tokens compress little
#: at any size); tools/bench/data/format_bench.py measures both sides.
DEFAULT_CHUNK_TOKENS = 8192
DEFAULT_LEVEL = 3
#: File name suffix of a shard; ``Corpus(directory)`` picks up exactly these files.
SHARD_SUFFIX = ".mss"


class ShardError(ValueError):
    """A shard is damaged or not a shard; names the file (``.path``) and byte offset."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        super().__init__(f"{path}: {reason} (at byte offset {offset})")
        self.path = path
        self.offset = offset
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors travel between processes (a loader's reader to its ranks).
        return (type(self), (self.path, self.offset, self.reason))


class ChunkCorruptError(ShardError):
    """A chunk failed its crc32, zstd's checksum, or decompression (``.chunk``)."""

    def __init__(self, path: str, offset: int, chunk: int, reason: str) -> None:
        super().__init__(path, offset, reason)
        self.chunk = chunk

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.offset, self.chunk, self.reason))


def token_dtype(dtype: object) -> np.dtype[np.unsignedinteger]:
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        dt = None
    if dt is None or dt not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ValueError(f"dtype must be 'uint16' or 'uint32', got {dtype!r}")
    return fmt.DTYPE_CODES[1] if dt.itemsize == 2 else fmt.DTYPE_CODES[2]


def resolve(url: str | os.PathLike[str], fs: fsspec.AbstractFileSystem | None) -> tuple[Any, str]:
    """(filesystem, path within it) for a URL, or for a path on an explicit filesystem."""
    text = os.fspath(url)
    if fs is None:
        found_fs, path = fsspec.core.url_to_fs(text)
        return found_fs, str(path)
    return fs, str(fs._strip_protocol(text))


@dataclass(frozen=True)
class ShardInfo:
    """What ``ShardWriter.close()`` wrote."""

    #: The shard's URL or path, as given to the writer.
    path: str
    #: Token dtype, uint16 or uint32 (little-endian in the file).
    dtype: np.dtype[np.unsignedinteger]
    n_docs: int
    n_tokens: int
    n_chunks: int
    #: Size of the file in bytes, header, chunks, index and footer included.
    nbytes: int

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the tokens uncompressed."""
        return self.n_tokens * self.dtype.itemsize

    @property
    def compression_ratio(self) -> float:
        """Uncompressed token bytes per file byte."""
        return self.raw_nbytes / self.nbytes
