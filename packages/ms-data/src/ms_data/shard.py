"""Token shards: write one, read one by ranged reads, put many behind one document index.

The byte layout is specified in ``docs/format.md`` (constants in ``_format``). Every
I/O goes through fsspec, so the same code reads a local file, ``memory://`` or an
object store. Readers never fetch a whole shard: the footer and index once per
reader, then only the chunks a request overlaps, so random access to a document on
remote storage costs a few kilobytes of index and one ranged read.

- ``ShardWriter`` writes one shard; ``close()`` returns a ``ShardInfo``.
- ``ShardReader`` reads one; ``Corpus`` puts several behind one document index.
  Both pickle as URLs, so a loader process reopens them.
- ``ShardError`` (a ``ValueError``) names the file and byte offset of any damage;
  ``ChunkCorruptError`` also names the chunk.
"""

from ms_data._corpus import Corpus
from ms_data._shard_common import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_LEVEL,
    SHARD_SUFFIX,
    ChunkCorruptError,
    ShardError,
    ShardInfo,
)
from ms_data._shard_reader import ShardReader
from ms_data._shard_writer import ShardWriter

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "DEFAULT_LEVEL",
    "SHARD_SUFFIX",
    "ChunkCorruptError",
    "Corpus",
    "ShardError",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
]

# Defined in private modules; tracebacks, reprs and pickles name the public path.
for _public in (ChunkCorruptError, Corpus, ShardError, ShardInfo, ShardReader, ShardWriter):
    _public.__module__ = __name__
del _public
