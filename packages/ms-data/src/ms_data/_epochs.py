"""One epoch of the packed sample stream: document order, packing, sample order.

Every function here is a pure function of its arguments; ``PackedDataset`` caches
the results. Randomness comes from raw PCG64 output seeded by a ``SeedSequence``
keyed on ``(seed, epoch, purpose, ...)``: NumPy keeps bit generators and
``SeedSequence`` stable across releases, but not the algorithms behind
``Generator.permutation``, and a resumed job may run on a newer NumPy.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

__all__ = [
    "EpochLayout",
    "concat_layout",
    "document_order",
    "held_out_documents",
    "permutation",
    "whole_layout",
]

# The purpose of a random stream, part of its seed key, so that streams never repeat.
_SHARD_ORDER = 0
_DOC_ORDER = 1
_SAMPLE_ORDER = 2
_HELD_OUT = 3


@dataclass(frozen=True)
class EpochLayout:
    """Where each sample of one epoch comes from."""

    #: Global document ids in the epoch's order (skipped documents left out).
    order: np.ndarray
    #: ``"concat"``: token offset of each document of ``order`` in the epoch's
    #: stream (``len(order) + 1`` entries, eos included). ``"whole"``: index into
    #: ``order`` of each packed sample's first document (``n_samples + 1`` entries).
    starts: np.ndarray
    #: Sample ``i`` of the epoch is packed sample ``perm[i]``; None: the identity.
    perm: np.ndarray | None
    n_samples: int

    def packed_index(self, i: int) -> int:
        return i if self.perm is None else int(self.perm[i])


def permutation(n: int, seed: int, *key: int) -> np.ndarray:
    """A uniformly random permutation of ``range(n)`` (int64), a pure function of the key.

    The argsort of ``n`` raw 64-bit draws: two equal draws (probability ~n^2/2^65)
    only make the order of those two fall back to their index.
    """
    bits = np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key)).random_raw(n)
    return np.argsort(bits, kind="stable").astype(np.int64, copy=False)


def document_order(
    shard_docs: np.ndarray, keep: np.ndarray | None, *, seed: int, epoch: int, shuffle: bool
) -> np.ndarray:
    """Global document ids in epoch ``epoch``'s order.

    Shuffled: shards in a random order, each shard's documents in a random order,
    so that one shard's documents stay together (readers touch few files at a time)
    while both levels change every epoch. ``keep`` (bool per document) drops documents.
    """
    n_docs = int(shard_docs.sum())
    if not shuffle:
        order = np.arange(n_docs, dtype=np.int64)
    else:
        bases = np.zeros(len(shard_docs) + 1, dtype=np.int64)
        np.cumsum(shard_docs, out=bases[1:])
        parts = [
            bases[s] + permutation(int(shard_docs[s]), seed, epoch, _DOC_ORDER, int(s))
            for s in permutation(len(shard_docs), seed, epoch, _SHARD_ORDER)
        ]
        order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if keep is not None:
        order = order[keep[order]]
    return order


def held_out_documents(n_docs: int, fraction: float) -> np.ndarray:
    """Global ids, sorted, of the ``fraction`` of ``n_docs`` documents held out of training.

    ``max(1, round(fraction * n_docs))`` documents (none for ``fraction == 0``), drawn
    by a permutation keyed only on the purpose: the set depends on nothing but
    ``n_docs`` and ``fraction`` (not the shuffling seed, not the ranks), so runs with
    other seeds evaluate on the same documents, and a larger fraction holds out a
    superset of a smaller one's.
    """
    if fraction == 0:
        return np.zeros(0, dtype=np.int64)
    count = max(1, round(fraction * n_docs))
    chosen = permutation(n_docs, 0, _HELD_OUT)[:count]
    return np.sort(chosen)


def concat_layout(
    spans: np.ndarray, order: np.ndarray, seq_len: int, *, seed: int, epoch: int, shuffle: bool
) -> EpochLayout:
    """Samples of ``seq_len + 1`` tokens at stride ``seq_len`` over the epoch's stream.

    ``spans[d]`` is document ``d``'s length in the stream (its tokens plus the eos).
    Sample ``j`` covers stream tokens ``[j*seq_len, j*seq_len + seq_len + 1)``; the
    tail that does not fill a whole sample is dropped.
    """
    starts = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(spans[order], out=starts[1:])
    n_samples = max(int(starts[-1]) - 1, 0) // seq_len
    perm = permutation(n_samples, seed, epoch, _SAMPLE_ORDER) if shuffle else None
    return EpochLayout(order=order, starts=starts, perm=perm, n_samples=n_samples)


def whole_layout(
    spans: np.ndarray, order: np.ndarray, capacity: int, *, seed: int, epoch: int, shuffle: bool
) -> EpochLayout:
    """Next-fit packing of whole documents, in the epoch's order, into samples.

    A document whose span does not fit in what is left of the current sample starts
    the next one (no look-back, so the order is kept). Every span must be
    ``<= capacity``; the caller checks.
    """
    ends = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(spans[order], out=ends[1:])
    cum = ends.tolist()
    firsts = [0]
    i = 0
    # One bisection per sample rather than a Python step per document.
    while i < len(order):
        i = bisect_right(cum, cum[i] + capacity, lo=i + 1) - 1
        firsts.append(i)
    n_samples = len(firsts) - 1
    perm = permutation(n_samples, seed, epoch, _SAMPLE_ORDER) if shuffle else None
    return EpochLayout(
        order=order, starts=np.asarray(firsts, dtype=np.int64), perm=perm, n_samples=n_samples
    )
