"""``PackedDataset``: documents packed into fixed-length samples, one global sample stream.

Sample ``g`` (the global sample index) is a pure function of the corpus, ``seq_len``,
the boundary policy, ``eos_id`` / ``pad_id``, ``shuffle``, ``seed`` and ``g``; the
ranks of a data-parallel job only choose which ``g`` they take. That is what makes a
resume exact on any number of ranks (docs/design.md, "The global sample stream").
"""

from __future__ import annotations

import hashlib
import operator
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ms_data._epochs import (
    EpochLayout,
    concat_layout,
    document_order,
    held_out_documents,
    whole_layout,
)
from ms_data.shard import Corpus

__all__ = ["Boundary", "OnCorrupt", "PackedDataset", "Split"]

Boundary = Literal["concat", "whole"]
OnCorrupt = Literal["raise", "skip"]
Split = Literal["train", "held_out"]
_BOUNDARIES = ("concat", "whole")
_ON_CORRUPT = ("raise", "skip")
_SPLITS = ("train", "held_out")
# Version of state_dict()'s layout; bump when a field changes meaning.
_STATE_VERSION = 1
# Fields of the state that define the stream: a state that differs in one of them
# describes another stream, and resuming from it would not continue where it stopped.
_STREAM_FIELDS = ("seed", "seq_len", "boundary", "eos_id", "pad_id", "shuffle", "corpus")
# Stream fields added after version 1 was written, with the value a state saved
# before them describes: such a state still loads into a dataset that agrees.
_LATER_FIELDS: dict[str, Any] = {"held_out": 0.0, "split": "train"}
_SKIP_FIELDS = ("skipped", "skipped_digest")
# Epoch layouts kept in memory: the current one, the next, and one spare for workers
# that straddle an epoch boundary.
_CACHED_EPOCHS = 3


class PackedDataset(IterableDataset[torch.Tensor]):
    """Documents of a :class:`~ms_data.shard.Corpus` packed into samples of ``seq_len + 1`` tokens.

    A sample is an int64 array of ``seq_len + 1`` tokens: the inputs are ``[:-1]``,
    the labels ``[1:]``. Training consumes the global stream ``g = 0, 1, 2, ...``
    (docs/design.md); :meth:`sample` gives sample ``g`` directly, iteration gives
    this rank's share of the stream.

    **Epochs.** Epoch ``e`` orders the documents, packs them into samples, and
    orders the samples. With ``shuffle=True`` the shards are put in a random order,
    each shard's documents in a random order (one shard's documents stay together),
    and the epoch's packed samples are permuted as a whole; every permutation is
    seeded by ``(seed, e)``. With ``shuffle=False`` every epoch is the corpus in
    order. The stream goes on forever: the samples after epoch ``e`` are epoch
    ``e + 1``'s.

    **Boundary policies.**

    - ``"concat"`` (GPT-style): the epoch's documents are concatenated, each followed
      by ``eos_id`` unless it is None, and sample ``j`` of the epoch is tokens
      ``[j*seq_len, j*seq_len + seq_len + 1)`` of that stream: consecutive samples
      share one token, the last label of one being the first input of the next
      (stride ``seq_len``, as in Megatron-LM). A stride of ``seq_len + 1`` would never
      train the transition between two samples, one token in ``seq_len + 1``. With
      stride ``seq_len`` every token of the stream but the first is a label exactly
      once. Documents span samples. The tail of the epoch's stream that does not
      fill a whole sample (fewer than ``seq_len`` tokens) is dropped, in every
      epoch; the stream's length does not depend on the order, so every epoch has
      :attr:`samples_per_epoch` samples.
    - ``"whole"``: documents are never split. In the epoch's order, each document
      (followed by ``eos_id`` unless it is None) goes into the current sample if it
      fits, else it starts the next one (next-fit packing); the rest of a sample is
      ``pad_id``. :meth:`sample_with_segments` tells documents and padding apart.
      A document longer than ``seq_len + 1`` tokens (eos included) is refused at
      construction with a ``ValueError`` naming its shard file and index. The number
      of samples differs from epoch to epoch; finding the epoch of ``g`` packs every
      earlier epoch once (cached as a list of epoch starts).

    **Held-out split.** ``held_out`` (a fraction in ``[0, 1)``) sets aside
    ``max(1, round(held_out * n_docs))`` documents, chosen by a fixed permutation of
    the document ids (the same set whatever the seed, the ranks or the split asked
    for). ``split="train"`` leaves them out of every epoch, as if they were skipped;
    ``split="held_out"`` is the stream of those documents alone, packed and shuffled
    the same way. The two streams never share a document, so a model trained on one
    is evaluated on text it has never seen. With ``held_out=0`` (the default) the
    training stream is the one of earlier versions, sample for sample.

    An empty document is refused at construction (``ValueError`` naming its shard
    file and index): it has nothing to train on and usually means a broken build.

    **Damaged chunks.** ``on_corrupt="raise"`` lets the shard's ``ChunkCorruptError``
    out of :meth:`sample` when a sample reads a damaged chunk. ``"skip"`` checks every
    chunk of the corpus once, at construction (one full read and decompression), and
    leaves out of every epoch each document that touches a damaged chunk; they are
    counted in :attr:`skipped`. Deciding up front keeps the stream a pure function
    of the files: a skip decided on first read would shift every later sample, and
    differently on each rank. The skipped set is part of :meth:`state_dict`, so a
    resume onto files that are damaged differently is refused. A chunk damaged after
    construction still raises. The skipped set is pickled with the dataset, so a
    reader process does not check the corpus again.

    **Ranks and workers.** Rank ``dp_rank`` of ``dp_size`` iterates
    ``g = next_index + k * dp_size + dp_rank`` for ``k = 0, 1, ...``. Inside a
    ``DataLoader`` with ``num_workers = W``, worker ``w`` takes the ``k`` with
    ``k % W == w``, so that no sample is produced twice; the DataLoader takes one
    item from each worker in turn, so ``DataLoader(ds, batch_size=None,
    num_workers=W)`` yields exactly the samples of plain iteration, in order. (With
    ``batch_size=B`` each batch would hold samples ``W`` apart: batch afterwards.)

    **Resume.** :attr:`next_index` is the global index of the first sample of the
    next step: iterating here advances it by ``dp_size`` per sample received (one
    global round), so after ``t`` steps of ``micro_batch`` samples on every rank it
    is ``start + t * micro_batch * dp_size`` on all ranks alike. Save
    :meth:`state_dict` at a step boundary; load it into a dataset with any
    ``dp_size`` and the global stream continues bit for bit. When the samples are
    drawn elsewhere (DataLoader workers, a NodeLoader reader process) this object
    does not see them: call :meth:`advance` once per step instead. Use one iterator
    at a time; each ``iter()`` starts at :attr:`next_index`.

    **Memory.** A cached epoch holds its document order and offsets (16 bytes per
    document) and, shuffled, its sample permutation (8 bytes per sample; a trillion
    tokens at ``seq_len`` 2048 is about 4 GB), up to three epochs at a time. Caches
    are rebuilt lazily and not pickled, so the dataset pickles cheaply into reader
    processes.

    Args:
        corpus: the shards, one global document index.
        seq_len: tokens per sample, inputs; a sample holds ``seq_len + 1``.
        seed: shuffling seed, an int >= 0.
        boundary: ``"concat"`` or ``"whole"``, above.
        eos_id: token appended to every document; None appends nothing.
        pad_id: token that fills ``"whole"`` samples.
        shuffle: shuffle shards, documents and samples every epoch.
        on_corrupt: ``"raise"`` or ``"skip"``, above.
        dp_rank, dp_size: this rank's place among the data-parallel ranks; only
            iteration uses them.
        held_out: the fraction of documents held out of training, above.
        split: ``"train"`` (the documents not held out) or ``"held_out"``.
    """

    def __init__(
        self,
        corpus: Corpus,
        seq_len: int,
        *,
        seed: int = 0,
        boundary: Boundary = "concat",
        eos_id: int | None = None,
        pad_id: int = 0,
        shuffle: bool = True,
        on_corrupt: OnCorrupt = "raise",
        dp_rank: int = 0,
        dp_size: int = 1,
        held_out: float = 0.0,
        split: Split = "train",
    ) -> None:
        super().__init__()
        _check_int("seq_len", seq_len, minimum=1)
        _check_int("seed", seed, minimum=0)
        _check_int("dp_size", dp_size, minimum=1)
        _check_int("dp_rank", dp_rank, minimum=0)
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if boundary not in _BOUNDARIES:
            raise ValueError(f"boundary must be one of {_BOUNDARIES}, got {boundary!r}")
        if on_corrupt not in _ON_CORRUPT:
            raise ValueError(f"on_corrupt must be one of {_ON_CORRUPT}, got {on_corrupt!r}")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        if not corpus.shards or corpus.n_docs == 0:
            raise ValueError(f"corpus must hold at least one document, got {corpus.n_docs}")
        self._held = _held_out(corpus.n_docs, held_out, split)
        top = min(int(np.iinfo(reader.dtype).max) for reader in corpus.shards)
        if eos_id is not None:
            _check_int("eos_id", eos_id, minimum=0, maximum=top)
        _check_int("pad_id", pad_id, minimum=0, maximum=top)

        self.corpus = corpus
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.boundary: Boundary = boundary
        self.eos_id = None if eos_id is None else int(eos_id)
        self.pad_id = int(pad_id)
        self.shuffle = shuffle
        self.held_out = float(held_out)
        self.split: Split = split
        self.on_corrupt: OnCorrupt = on_corrupt
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self._next_index = 0
        self._clear_caches()

        lengths = self._doc_lengths()
        self._skip: np.ndarray = _damaged_documents(corpus) if on_corrupt == "skip" else _NO_DOCS
        self._check_documents(lengths)
        self._fingerprint = _fingerprint(corpus, lengths)
        skip_bytes = self._skip.astype("<i8").tobytes()
        self._skip_digest = hashlib.blake2b(skip_bytes, digest_size=16).hexdigest()
        spans = self._spans()
        keep = self._keep_mask()
        kept_spans = int(spans.sum()) if keep is None else int(spans[keep].sum())
        of_split = "" if split == "train" and not self._held.size else f" of split {split!r}"
        # "concat" epochs all have the same number of samples; "whole" ones do not.
        self._epoch_len: int | None = None
        self._epoch_starts = [0]
        if boundary == "concat":
            self._epoch_len = max(kept_spans - 1, 0) // seq_len
            self._dropped = kept_spans - self._epoch_len * seq_len - 1
            if self._epoch_len == 0:
                raise ValueError(
                    f"corpus is too small for seq_len={seq_len}: the documents{of_split} "
                    f"make a stream of {kept_spans} tokens (eos included, skipped "
                    f"documents left out), fewer than one sample of seq_len + 1 = "
                    f"{seq_len + 1}"
                )
        else:
            self._dropped = 0
            if kept_spans == 0:
                raise ValueError(
                    f"corpus has no document{of_split} left once damaged ones are skipped"
                )
            if not shuffle:
                self._epoch_len = self._layout(0).n_samples

    # -- the stream -----------------------------------------------------------------

    def sample(self, g: int) -> np.ndarray:
        """Sample ``g`` of the global stream: int64 tokens, shape ``(seq_len + 1,)``."""
        tokens = np.empty(self.seq_len + 1, dtype=np.int64)
        self._build(g, tokens, None)
        return tokens

    def sample_with_segments(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``g`` and, per token, which document it belongs to.

        Segment ids (int32) count the documents of the sample from 1 in order; an
        eos belongs to the document it ends; padding is 0. Use them for
        document-causal attention masks and to mask padded labels.
        """
        tokens = np.empty(self.seq_len + 1, dtype=np.int64)
        segments = np.empty(self.seq_len + 1, dtype=np.int32)
        self._build(g, tokens, segments)
        return tokens, segments

    def epoch(self, g: int) -> int:
        """The epoch that sample ``g`` belongs to."""
        return self._position(_check_index("g", g))[0]

    @property
    def samples_per_epoch(self) -> int | None:
        """Samples per epoch; None under ``"whole"`` with shuffling, where it varies."""
        return self._epoch_len

    @property
    def skipped(self) -> int:
        """Documents left out of every epoch because they touch a damaged chunk."""
        return int(self._skip.size)

    @property
    def held_out_documents(self) -> np.ndarray:
        """Global ids of the held-out documents, sorted (whichever split this is)."""
        return held_out_documents(self.corpus.n_docs, self.held_out)

    @property
    def skipped_documents(self) -> np.ndarray:
        """Global ids of the skipped documents, sorted."""
        docs: np.ndarray = self._skip.copy()
        return docs

    def stats(self) -> dict[str, int | None]:
        """Counts that describe the stream (this split), for logs and summaries."""
        lengths = self._doc_lengths()
        skipped_tokens = int(lengths[self._skip].sum())
        keep = self._keep_mask()
        return {
            "documents": int(self.corpus.n_docs if keep is None else keep.sum()),
            "tokens": int(lengths.sum() if keep is None else lengths[keep].sum()),
            "held_out_documents": int(self.held_out_documents.size),
            "skipped_documents": self.skipped,
            "skipped_tokens": skipped_tokens,
            "samples_per_epoch": self._epoch_len,
            "dropped_tokens_per_epoch": self._dropped,
        }

    # -- iteration and resume -------------------------------------------------------

    @property
    def next_index(self) -> int:
        """Global index of the first sample of the next step (all ranks agree)."""
        return self._next_index

    def advance(self, steps: int, micro_batch: int) -> None:
        """Record ``steps`` steps of ``micro_batch`` samples per rank, drawn elsewhere.

        For samples that do not come from this object's own iterator (DataLoader
        workers, a NodeLoader's reader process): moves :attr:`next_index` on by
        ``steps * micro_batch * dp_size``.
        """
        _check_int("steps", steps, minimum=0)
        _check_int("micro_batch", micro_batch, minimum=1)
        self._next_index += steps * micro_batch * self.dp_size

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        start = self._next_index
        k = worker
        while True:
            g = start + k * self.dp_size + self.dp_rank
            tokens = torch.from_numpy(self.sample(g))
            k += workers
            # Before the yield: once the caller holds sample k, the state says so.
            if info is None:
                self._next_index = start + k * self.dp_size
            yield tokens

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "next_index", "seed", "seq_len", "boundary", ...}``: plain values.

        ``corpus`` is a fingerprint of the corpus layout (dtype, documents per
        shard, every document's length), not of its paths: moved shards still match.
        """
        return {
            "version": _STATE_VERSION,
            "next_index": self._next_index,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "boundary": self.boundary,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "shuffle": self.shuffle,
            "held_out": self.held_out,
            "split": self.split,
            "corpus": self._fingerprint,
            "skipped": self.skipped,
            "skipped_digest": self._skip_digest,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the stream saved in ``state``; ``dp_size`` and ``dp_rank`` may differ.

        Refuses (``ValueError``, naming the field) a state whose stream differs from
        this dataset's: another seed, seq_len, boundary, eos_id, pad_id (``"whole"``),
        shuffle, corpus, or set of skipped documents.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping, got {type(state).__name__}")
        version = state.get("version")
        if version != _STATE_VERSION:
            raise ValueError(
                f"state version must be {_STATE_VERSION} (what this PackedDataset reads), "
                f"got {version!r}"
            )
        mine = self.state_dict()
        state = {**_LATER_FIELDS, **state}
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ValueError(f"state lacks the field(s) {missing}")
        for field in _STREAM_FIELDS + tuple(_LATER_FIELDS) + _SKIP_FIELDS:
            if field == "pad_id" and self.boundary != "whole":
                continue  # concat samples hold no padding
            if state[field] != mine[field]:
                why = (
                    "the damaged chunks found in the corpus changed"
                    if field in _SKIP_FIELDS
                    else "it describes another sample stream"
                )
                raise ValueError(
                    f"cannot resume: state field {field!r} is {state[field]!r}, this "
                    f"dataset has {mine[field]!r}; {why}, so the stream would not continue "
                    "where it stopped"
                )
        self._next_index = _check_index("state['next_index']", state["next_index"])

    # -- pickling: caches stay behind and are rebuilt lazily ---------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_lengths", "_keep", "_layouts", "_lock"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._clear_caches()

    # -- internals ------------------------------------------------------------------

    def _clear_caches(self) -> None:
        # Guards the caches below and _epoch_starts: sample() may be called from
        # several threads at once (a NodeLoader reader's pool). Reentrant: _position
        # builds layouts while it holds it.
        self._lock = threading.RLock()
        self._lengths: np.ndarray | None = None
        self._keep: np.ndarray | None = None
        self._layouts: OrderedDict[int, EpochLayout] = OrderedDict()

    def _doc_lengths(self) -> np.ndarray:
        lengths = self._lengths
        if lengths is None:
            # A race builds the same array twice; the assignment itself is atomic.
            lengths = self._lengths = np.asarray(self.corpus.doc_lengths(), dtype=np.int64)
        return lengths

    def _spans(self) -> np.ndarray:
        """Each document's length in the stream: its tokens, plus the eos."""
        lengths = self._doc_lengths()
        return lengths + 1 if self.eos_id is not None else lengths

    def _keep_mask(self) -> np.ndarray | None:
        """Per document, whether this stream has it; None: every document."""
        if not self._skip.size and not self._held.size:
            return None
        keep = self._keep
        if keep is None:
            # Filled before it is published: another thread never sees it half done.
            held = np.zeros(self.corpus.n_docs, dtype=bool)
            held[self._held] = True
            keep = held if self.split == "held_out" else ~held
            keep[self._skip] = False
            self._keep = keep
        return keep

    def _check_documents(self, lengths: np.ndarray) -> None:
        keep = self._keep_mask()
        kept = lengths if keep is None else np.where(keep, lengths, 1)
        empty = np.flatnonzero(kept == 0)
        if empty.size:
            raise ValueError(
                f"{self._describe(int(empty[0]))} is empty, and PackedDataset refuses empty "
                f"documents ({empty.size} in the corpus): they usually mean a broken build"
            )
        if self.boundary == "whole":
            eos = 0 if self.eos_id is None else 1
            kept = lengths if keep is None else np.where(keep, lengths, 0)
            long = np.flatnonzero(kept + eos > self.seq_len + 1)
            if long.size:
                doc = int(long[0])
                raise ValueError(
                    f"{self._describe(doc)} has {int(lengths[doc])} tokens"
                    f"{' + 1 eos' if eos else ''}, more than one sample holds under "
                    f"boundary='whole' (seq_len + 1 = {self.seq_len + 1}); "
                    f"{long.size} such document(s) in the corpus. Use boundary='concat' "
                    "or a larger seq_len"
                )

    def _describe(self, doc: int) -> str:
        shard, local = self.corpus.locate(doc)
        reader = self.corpus.shards[shard]
        offset = int(reader.doc_offsets[local])
        return (
            f"document {local} of shard {reader.path} (global document {doc}, "
            f"token offset {offset})"
        )

    def _layout(self, epoch: int) -> EpochLayout:
        key = epoch if self.shuffle else 0  # unshuffled epochs are all alike
        with self._lock:
            layout = self._layouts.get(key)
            if layout is not None:
                self._layouts.move_to_end(key)
                return layout
        # Built outside the lock (it can take a while); two threads that miss at once
        # both build it, and the first to finish is the one kept. Pure function of key.
        shard_docs = np.array([reader.n_docs for reader in self.corpus.shards], dtype=np.int64)
        order = document_order(
            shard_docs, self._keep_mask(), seed=self.seed, epoch=key, shuffle=self.shuffle
        )
        pack = concat_layout if self.boundary == "concat" else whole_layout
        size = self.seq_len if self.boundary == "concat" else self.seq_len + 1
        layout = pack(self._spans(), order, size, seed=self.seed, epoch=key, shuffle=self.shuffle)
        with self._lock:
            kept = self._layouts.get(key)
            if kept is not None:
                self._layouts.move_to_end(key)
                return kept
            self._layouts[key] = layout
            if len(self._layouts) > _CACHED_EPOCHS:
                self._layouts.popitem(last=False)
        return layout

    def _position(self, g: int) -> tuple[int, int]:
        """(epoch, sample index within the epoch) of global sample ``g``."""
        if self._epoch_len is not None:
            epoch, i = divmod(g, self._epoch_len)
            return epoch, i
        starts = self._epoch_starts
        if starts[-1] <= g:
            with self._lock:  # one thread extends the list at a time
                while starts[-1] <= g:
                    starts.append(starts[-1] + self._layout(len(starts) - 1).n_samples)
        # Appends only ever add entries past g's epoch: reading without the lock is safe.
        epoch = bisect_right(starts, g) - 1
        return epoch, g - starts[epoch]

    def _build(self, g: int, tokens: np.ndarray, segments: np.ndarray | None) -> None:
        epoch, i = self._position(_check_index("g", g))
        layout = self._layout(epoch)
        packed = layout.packed_index(i)
        if self.boundary == "concat":
            pieces = self._concat_pieces(layout, packed)
        else:
            pieces = self._whole_pieces(layout, packed)
        self._fill(pieces, tokens, segments)

    def _concat_pieces(self, layout: EpochLayout, packed: int) -> list[_Piece]:
        """The document pieces of stream tokens ``[packed*seq_len, +seq_len+1)``."""
        lengths = self._doc_lengths()
        width = self.seq_len + 1
        start = packed * self.seq_len
        k = int(np.searchsorted(layout.starts, start, side="right")) - 1
        pieces: list[_Piece] = []
        filled = 0
        while filled < width:
            doc = int(layout.order[k])
            n = int(lengths[doc])
            a = start + filled - int(layout.starts[k])  # == n when the sample opens on an eos
            b = min(n, a + width - filled)
            filled += b - a
            eos = self.eos_id is not None and b == n and filled < width
            filled += eos
            pieces.append((doc, a, b, eos))
            k += 1
        return pieces

    def _whole_pieces(self, layout: EpochLayout, packed: int) -> list[_Piece]:
        lengths = self._doc_lengths()
        docs = layout.order[layout.starts[packed] : layout.starts[packed + 1]].tolist()
        eos = self.eos_id is not None
        return [(doc, 0, int(lengths[doc]), eos) for doc in docs]

    def _fill(self, pieces: list[_Piece], tokens: np.ndarray, segments: np.ndarray | None) -> None:
        """Read ``pieces`` into ``tokens``, one read per run of adjacent documents."""
        lengths = self._doc_lengths()
        pos = 0
        i = 0
        while i < len(pieces):
            doc, a, _, _ = pieces[i]
            shard, local = self.corpus.locate(doc)
            reader = self.corpus.shards[shard]
            # Extend the run while the next piece starts the next document of the same
            # shard where this one ends (unshuffled order, or several documents that
            # the shuffle left side by side).
            j = i
            while (
                j + 1 < len(pieces)
                and pieces[j + 1][0] == pieces[j][0] + 1
                and pieces[j + 1][1] == 0
                and pieces[j][2] == lengths[pieces[j][0]]
                and local + j + 1 - i < reader.n_docs
            ):
                j += 1
            lo = int(reader.doc_offsets[local]) + a
            hi = int(reader.doc_offsets[local + j - i]) + pieces[j][2]
            run = reader.read_tokens(lo, hi) if hi > lo else tokens[:0]
            t = 0
            for n_seg, (_, pa, pb, eos) in enumerate(pieces[i : j + 1], start=i + 1):
                n = pb - pa
                tokens[pos : pos + n] = run[t : t + n]
                t += n
                if eos:
                    tokens[pos + n] = self.eos_id
                if segments is not None:
                    segments[pos : pos + n + eos] = n_seg
                pos += n + eos
            i = j + 1
        tokens[pos:] = self.pad_id
        if segments is not None:
            segments[pos:] = 0


# (global document, first token, end token, followed by an eos)
_Piece = tuple[int, int, int, bool]
_NO_DOCS = np.zeros(0, dtype=np.int64)


def _damaged_documents(corpus: Corpus) -> np.ndarray:
    """Global ids, sorted, of the documents that touch a chunk failing its check."""
    bad: list[np.ndarray] = []
    base = 0
    for reader in corpus.shards:
        chunks = np.array(sorted({e.chunk for e in reader.verify()}), dtype=np.int64)
        if chunks.size:
            # Chunk c holds shard tokens [c * chunk_tokens, (c + 1) * chunk_tokens)
            # (docs/format.md); an empty document touches no chunk.
            offsets = reader.doc_offsets.astype(np.int64)
            first = offsets[:-1] // reader.chunk_tokens
            last = (offsets[1:] - 1) // reader.chunk_tokens
            at = np.searchsorted(chunks, first)
            hit = (at < chunks.size) & (chunks[np.minimum(at, chunks.size - 1)] <= last)
            hit &= offsets[1:] > offsets[:-1]
            bad.append(base + np.flatnonzero(hit))
        base += reader.n_docs
    return np.concatenate(bad).astype(np.int64) if bad else _NO_DOCS


def _held_out(n_docs: int, fraction: object, split: object) -> np.ndarray:
    """The held-out documents for ``held_out=fraction``, after checking both arguments."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating)):
        raise TypeError(f"held_out must be a float, got {type(fraction).__name__} {fraction!r}")
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held_out must be a fraction in [0, 1), got {fraction}")
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if split == "held_out" and fraction == 0:
        raise ValueError("split='held_out' needs held_out > 0, got held_out=0")
    held = held_out_documents(n_docs, float(fraction))
    if held.size >= n_docs:
        raise ValueError(
            f"held_out={fraction} holds out {held.size} of the corpus's {n_docs} "
            "document(s) and leaves none to train on; lower it or add documents"
        )
    return held


def _fingerprint(corpus: Corpus, lengths: np.ndarray) -> str:
    """blake2b of the corpus layout: dtypes, documents per shard, document lengths."""
    h = hashlib.blake2b(digest_size=16)
    for reader in corpus.shards:
        h.update(f"{np.dtype(reader.dtype).str}:{reader.n_docs};".encode())
    h.update(np.ascontiguousarray(lengths, dtype="<i8").tobytes())
    return h.hexdigest()


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        why = "" if maximum is None else " (the corpus token dtype's range)"
        raise ValueError(f"{name} must be {bound}{why}, got {value}")


def _check_index(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        index = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if index < 0:
        raise ValueError(f"{name} must be >= 0, got {index}")
    return int(index)
