"""``Corpus``: several shards behind one global document index."""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt

from ms_data._shard_common import SHARD_SUFFIX, resolve
from ms_data._shard_reader import ShardReader

__all__ = ["Corpus", "expand_shard_urls"]


def expand_shard_urls(
    spec: str | os.PathLike[str], fs: fsspec.AbstractFileSystem | None
) -> list[str]:
    """Shard URLs for one entry of ``Corpus(urls)``: a shard, a directory, or a glob."""
    url = os.fspath(spec)
    sfs, path = resolve(url, fs)
    keep_protocol = fs is None and "://" in url

    def name(p: str) -> str:
        return str(sfs.unstrip_protocol(p)) if keep_protocol else p

    if any(ch in path for ch in "*?["):
        found = sorted(p for p in sfs.glob(path) if sfs.isfile(p))
        if not found:
            raise ValueError(f"no shard matches {url!r}")
    elif sfs.isdir(path):
        found = sorted(p for p in sfs.glob(path.rstrip("/") + "/*" + SHARD_SUFFIX) if sfs.isfile(p))
        if not found:
            raise ValueError(f"directory {url!r} holds no *{SHARD_SUFFIX} shards")
    else:
        return [url]
    return [name(p) for p in found]


class Corpus:
    """Several shards behind one global document index.

    ``urls`` is a shard URL, a directory (its ``*.mss`` files), a glob, or a list of
    any of these. Directory and glob matches are sorted by name; a list keeps its
    order. Global document ``d`` is shard ``s``'s document ``d - (docs in shards
    before s)``. Picklable: each shard reopens by URL.
    """

    shards: list[ShardReader]
    n_docs: int
    n_tokens: int

    def __init__(
        self,
        urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        fs: fsspec.AbstractFileSystem | None = None,
    ) -> None:
        specs = [urls] if isinstance(urls, (str, os.PathLike)) else list(urls)
        if not specs:
            raise ValueError("Corpus needs at least one shard, got an empty list of urls")
        shard_urls = [u for spec in specs for u in expand_shard_urls(spec, fs)]
        self.shards = [ShardReader(u, fs=fs) for u in shard_urls]
        self._index()

    @classmethod
    def _from_shards(cls, shards: list[ShardReader]) -> Corpus:
        corpus = cls.__new__(cls)
        corpus.shards = list(shards)
        corpus._index()
        return corpus

    def _index(self) -> None:
        counts = np.array([s.n_docs for s in self.shards], dtype=np.int64)
        self._doc_starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
        self.n_docs = int(self._doc_starts[-1])
        self.n_tokens = sum(s.n_tokens for s in self.shards)
        self._lengths: np.ndarray | None = None

    @property
    def urls(self) -> list[str]:
        """The shards' URLs, in corpus order."""
        return [s.path for s in self.shards]

    def doc_lengths(self) -> npt.NDArray[np.int64]:
        """Tokens per document in global document order, int64, read-only."""
        if self._lengths is None:
            lengths = np.concatenate(
                [np.zeros(0, np.int64)] + [s.doc_lengths() for s in self.shards]
            )
            lengths.flags.writeable = False
            self._lengths = lengths
        return self._lengths

    def locate(self, doc: int) -> tuple[int, int]:
        """(shard index, document within that shard) of global document ``doc``."""
        doc = operator.index(doc)
        if not 0 <= doc < self.n_docs:
            raise IndexError(
                f"document {doc} out of range: the corpus holds {self.n_docs} documents "
                f"in {len(self.shards)} shards"
            )
        s = int(np.searchsorted(self._doc_starts, doc, side="right")) - 1
        return s, doc - int(self._doc_starts[s])

    def read_document(self, doc: int) -> np.ndarray:
        """Global document ``doc``'s tokens, in its shard's dtype."""
        s, i = self.locate(doc)
        return self.shards[s].read_document(i)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Corpus._from_shards, (self.shards,))

    def __repr__(self) -> str:
        return f"Corpus({len(self.shards)} shards, n_docs={self.n_docs}, n_tokens={self.n_tokens})"
