"""Token shards, deterministic packed datasets, and tree-based node loading.

- ``ShardWriter`` / ``ShardReader`` / ``Corpus``: token documents in zstd-compressed,
  checksummed chunks with random access through fsspec (docs/format.md);
  ``build_shards`` and the ``ms-data build | inspect`` CLI make and check them.
- ``PackedDataset``: documents packed into ``seq_len + 1`` token samples, shuffled
  from a seed; sample ``g`` depends only on (corpus, settings, seed, ``g``), so a job
  resumes on any number of data-parallel ranks.
- ``NodeLoader``: one reader process per node fills a shared-memory ring that every
  local rank copies its micro-batch from (MegaScale's tree-based loading), prefetching
  ``depth`` steps ahead.

``PackedDataset`` and ``NodeLoader`` need torch and are imported on first use, so
the shard tools (and the builder's worker processes) start without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ms_data._version import __version__
from ms_data.build import BuildConfig, BuildError, BuildSummary, build_shards
from ms_data.shard import (
    ChunkCorruptError,
    Corpus,
    ShardError,
    ShardInfo,
    ShardReader,
    ShardWriter,
)
from ms_data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer

if TYPE_CHECKING:
    from ms_data.dataset import PackedDataset
    from ms_data.node_loader import NodeLoader, NodeLoaderError

__all__ = [
    "BuildConfig",
    "BuildError",
    "BuildSummary",
    "ByteTokenizer",
    "ChunkCorruptError",
    "Corpus",
    "HFTokenizer",
    "NodeLoader",
    "NodeLoaderError",
    "PackedDataset",
    "ShardError",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
    "Tokenizer",
    "__version__",
    "build_shards",
    "get_tokenizer",
]

_LAZY = {
    "PackedDataset": "ms_data.dataset",
    "NodeLoader": "ms_data.node_loader",
    "NodeLoaderError": "ms_data.node_loader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ms_data' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
