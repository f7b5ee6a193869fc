"""Byte layouts and constants of shard format version 1 (docs/format.md).

Only packing and unpacking lives here; the checks that need a file name and an offset
for their error message live in ``ms_data.shard``. Everything is little-endian, so a
shard written on one machine reads the same on any other.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CHUNK_ENTRY",
    "DTYPE_CODES",
    "FOOTER",
    "FOOTER_CRC_SPAN",
    "FOOTER_SIZE",
    "HEADER",
    "HEADER_DTYPE_AT",
    "HEADER_SIZE",
    "HEADER_VERSION_AT",
    "MAGIC",
    "MIN_SIZE",
    "OFFSET_ENTRY",
    "VERSION",
    "Footer",
    "Header",
    "crc32",
    "dtype_code",
    "index_length",
    "pack_footer",
    "pack_header",
    "unpack_footer",
    "unpack_header",
]

MAGIC = b"MSSHARD\x00"
VERSION = 1

#: dtype code (header byte 10, footer byte 50) -> token dtype. 0 is never valid, so a
#: zeroed header is caught.
DTYPE_CODES: dict[int, np.dtype[np.unsignedinteger]] = {
    1: np.dtype("<u2"),
    2: np.dtype("<u4"),
}

#: magic, version, dtype code, 5 reserved bytes.
HEADER = struct.Struct("<8sHB5x")
HEADER_SIZE = HEADER.size  # 16
#: Byte offsets of the header fields, for error messages.
HEADER_VERSION_AT = 8
HEADER_DTYPE_AT = 10

#: n_docs, n_tokens, n_chunks, index_offset, index_length, chunk_tokens, index crc32,
#: version, dtype code, reserved, footer crc32, magic.
FOOTER = struct.Struct("<QQQQQIIHBxI8s")
FOOTER_SIZE = FOOTER.size  # 64
#: The footer crc32 covers the footer bytes before it.
FOOTER_CRC_SPAN = 52
MIN_SIZE = HEADER_SIZE + FOOTER_SIZE

#: One entry of the document-offset array of the index.
OFFSET_ENTRY = np.dtype("<u8")
#: One entry of the chunk table of the index.
CHUNK_ENTRY = np.dtype([("offset", "<u8"), ("length", "<u4"), ("crc32", "<u4")])


def crc32(data: bytes | bytearray | memoryview) -> int:
    """zlib's CRC-32 as an unsigned 32-bit int."""
    return zlib.crc32(data) & 0xFFFFFFFF


def dtype_code(dtype: np.dtype[np.generic]) -> int:
    """The format's code for a token dtype; ValueError for anything else."""
    for code, dt in DTYPE_CODES.items():
        if dt == dtype:
            return code
    raise ValueError(f"token dtype must be uint16 or uint32, got {dtype}")


def index_length(n_docs: int, n_chunks: int) -> int:
    """Bytes of the index for that many documents and chunks."""
    return OFFSET_ENTRY.itemsize * (n_docs + 1) + CHUNK_ENTRY.itemsize * n_chunks


@dataclass(frozen=True)
class Header:
    magic: bytes
    version: int
    dtype_code: int


def pack_header(code: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, code)


def unpack_header(buf: bytes) -> Header:
    magic, version, code = HEADER.unpack(buf)
    return Header(magic, version, code)


@dataclass(frozen=True)
class Footer:
    n_docs: int
    n_tokens: int
    n_chunks: int
    index_offset: int
    index_length: int
    chunk_tokens: int
    index_crc32: int
    version: int
    dtype_code: int
    footer_crc32: int
    magic: bytes

    def stored_crc_matches(self, raw: bytes) -> bool:
        """Whether ``footer_crc32`` is the crc32 of the raw footer's first 52 bytes."""
        return crc32(raw[:FOOTER_CRC_SPAN]) == self.footer_crc32


def pack_footer(
    *,
    n_docs: int,
    n_tokens: int,
    n_chunks: int,
    index_offset: int,
    index_length: int,
    chunk_tokens: int,
    index_crc32: int,
    dtype_code: int,
) -> bytes:
    """The 64 footer bytes, with the footer crc32 filled in."""
    body = FOOTER.pack(
        n_docs,
        n_tokens,
        n_chunks,
        index_offset,
        index_length,
        chunk_tokens,
        index_crc32,
        VERSION,
        dtype_code,
        0,
        MAGIC,
    )
    return body[:FOOTER_CRC_SPAN] + struct.pack("<I", crc32(body[:FOOTER_CRC_SPAN])) + MAGIC


def unpack_footer(buf: bytes) -> Footer:
    return Footer(*FOOTER.unpack(buf))
