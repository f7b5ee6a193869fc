"""PackedDataset over real shards written by ShardWriter.

Expectations come from the documents the tests wrote, never from the dataset's own
layout code: the unshuffled streams are rebuilt by plain concatenation and next-fit
packing, and the shuffled epochs are checked through invariants that hold for any
order (every token once, every document whole and once).
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
import struct
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from ms_data.dataset import PackedDataset
from ms_data.shard import ChunkCorruptError, Corpus, ShardWriter
from ms_testing import run_ranks

SEQ = 16
EOS = 60000
PAD = 60001
SHARDS, DOCS_PER_SHARD, MAX_DOC = 3, 24, 30


def write_corpus(root: Path, shards: list[list[np.ndarray]], chunk_tokens: int = 64) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for s, docs in enumerate(shards):
        path = root / f"shard-{s:02d}.mss"
        with ShardWriter(path, "uint16", chunk_tokens=chunk_tokens) as w:
            for doc in docs:
                w.add_document(doc)
        paths.append(str(path))
    return paths


def unique_docs(seed: int, n_shards: int = SHARDS) -> list[list[np.ndarray]]:
    """Documents of 1..MAX_DOC tokens; no token id occurs twice in the corpus."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, MAX_DOC + 1, size=(n_shards, DOCS_PER_SHARD))
    ids = rng.permutation(np.arange(1, int(lengths.sum()) + 1))
    cuts = np.cumsum(lengths.ravel())[:-1]
    docs = np.split(ids, cuts)
    return [docs[s * DOCS_PER_SHARD : (s + 1) * DOCS_PER_SHARD] for s in range(n_shards)]


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], list[np.ndarray]]:
    shards = unique_docs(0)
    paths = write_corpus(tmp_path_factory.mktemp("corpus"), shards)
    return paths, [d for docs in shards for d in docs]


def dataset(paths: list[str], **kwargs: Any) -> PackedDataset:
    kwargs = {"seq_len": SEQ, "eos_id": EOS, "pad_id": PAD, "seed": 7} | kwargs
    return PackedDataset(Corpus(paths), **kwargs)


def with_eos(docs: list[np.ndarray], eos: int | None = EOS) -> np.ndarray:
    tail = [] if eos is None else [eos]
    return np.concatenate([np.append(d, tail) for d in docs]).astype(np.int64)


# -- the stream --------------------------------------------------------------------------


@pytest.mark.parametrize("eos", [EOS, None])
def test_unshuffled_concat_is_the_corpus_in_order(
    corpus_files: tuple[list[str], list[np.ndarray]], eos: int | None
) -> None:
    paths, docs = corpus_files
    ds = dataset(paths, shuffle=False, eos_id=eos)
    stream = with_eos(docs, eos)
    n = (len(stream) - 1) // SEQ
    assert ds.samples_per_epoch == n
    assert ds.stats()["dropped_tokens_per_epoch"] == len(stream) - n * SEQ - 1
    for g in [*range(2 * n + 2), 10 * n + 3]:
        j = g % n
        got = ds.sample(g)
        assert got.dtype == np.int64 and got.shape == (SEQ + 1,)
        np.testing.assert_array_equal(got, stream[j * SEQ : j * SEQ + SEQ + 1], err_msg=f"g={g}")


def test_unshuffled_whole_is_next_fit_packing(
    corpus_files: tuple[list[str], list[np.ndarray]],
) -> None:
    paths, docs = corpus_files
    seq_len = 2 * MAX_DOC
    expected: list[list[np.ndarray]] = [[]]
    for doc in docs:
        piece = np.append(doc, EOS)
        if sum(map(len, expected[-1])) + len(piece) > seq_len + 1:
            expected.append([])
        expected[-1].append(piece)
    ds = dataset(paths, seq_len=seq_len, boundary="whole", shuffle=False)
    assert ds.samples_per_epoch == len(expected)
    for g in range(2 * len(expected)):
        pieces = expected[g % len(expected)]
        tokens, segments = ds.sample_with_segments(g)
        used = sum(map(len, pieces))
        np.testing.assert_array_equal(tokens[:used], np.concatenate(pieces))
        assert (tokens[used:] == PAD).all()
        seg = np.concatenate([np.full(len(p), i + 1) for i, p in enumerate(pieces)])
        np.testing.assert_array_equal(segments[:used], seg)
        assert (segments[used:] == 0).all()
        np.testing.assert_array_equal(ds.sample(g), tokens)


@pytest.mark.parametrize("boundary", ["concat", "whole"])
def test_sample_is_a_pure_function_of_seed_and_index(
    corpus_files: tuple[list[str], list[np.ndarray]], boundary: str
) -> None:
    paths, _ = corpus_files
    kw: dict[str, Any] = {"boundary": boundary, "seq_len": 2 * MAX_DOC}
    a, b = dataset(paths, **kw), dataset(paths, **kw)
    gs = list(range(60))
    scattered = [59, 3, 200, 3, 0, 41, 120, 1]
    forward = {g: a.sample(g) for g in [*gs, 120, 200]}
    for g in scattered + gs:  # random access after the fact, and a cold dataset
        np.testing.assert_array_equal(b.sample(g), forward[g])
    copy = pickle.loads(pickle.dumps(a))
    for g in scattered:
        np.testing.assert_array_equal(copy.sample(g), forward[g])
    other = dataset(paths, seed=8, **kw)
    assert any(not np.array_equal(other.sample(g), forward[g]) for g in gs)
    # Every epoch has its own order.
    first, second = [g for g in gs if a.epoch(g) == 0], [g for g in gs if a.epoch(g) == 1]
    assert first and second
    assert not np.array_equal(forward[first[0]], forward[second[0]])


def test_concat_epoch_holds_every_token_once(
    corpus_files: tuple[list[str], list[np.ndarray]],
) -> None:
    paths, docs = corpus_files
    ds = dataset(paths)
    n = ds.samples_per_epoch
    assert n is not None
    follows = {int(d[i]): int(d[i + 1]) for d in docs for i in range(len(d) - 1)}
    follows |= {int(d[-1]): EOS for d in docs}
    firsts = {int(d[0]) for d in docs}
    n_stream = sum(len(d) + 1 for d in docs)
    assert 1 <= n_stream - n * SEQ <= SEQ  # as many samples as the stream holds
    corpus_tokens = Counter(int(t) for d in docs for t in d) + Counter({EOS: len(docs)})
    for epoch in (0, 1):
        samples = [ds.sample(g) for g in range(epoch * n, (epoch + 1) * n)]
        for s in samples:  # a window of some order of the documents
            for x, y in itertools.pairwise(s.tolist()):
                assert y in firsts if x == EOS else follows[x] == y, (x, y)
        for part in (slice(None, -1), slice(1, None)):  # inputs, then labels
            seen = Counter(int(t) for s in samples for t in s[part])
            assert all(c == 1 for t, c in seen.items() if t != EOS)
            assert not seen - corpus_tokens


def test_whole_epoch_holds_every_document_once(
    corpus_files: tuple[list[str], list[np.ndarray]],
) -> None:
    paths, docs = corpus_files
    seq_len = 2 * MAX_DOC
    ds = dataset(paths, seq_len=seq_len, boundary="whole", seed=3)
    by_first = {int(d[0]): i for i, d in enumerate(docs)}
    for epoch in (0, 1, 2):
        start = next(g for g in itertools.count() if ds.epoch(g) == epoch)
        found: list[int] = []
        g = start
        while ds.epoch(g) == epoch:
            tokens, segments = ds.sample_with_segments(g)
            count = int(segments.max())
            used = int((segments > 0).sum())
            assert (segments[:used] > 0).all() and (tokens[used:] == PAD).all()
            for k in range(1, count + 1):
                piece = tokens[segments == k]
                i = by_first[int(piece[0])]
                np.testing.assert_array_equal(piece, np.append(docs[i], EOS))
                found.append(i)
            g += 1
        assert sorted(found) == list(range(len(docs))), f"epoch {epoch}"


# -- resume -------------------------------------------------------------------------------

_REFERENCE: dict[str, list[np.ndarray]] = {}


def reference(paths: list[str], boundary: str, count: int) -> list[np.ndarray]:
    """The first ``count`` samples of an uninterrupted single-rank run."""
    have = _REFERENCE.get(boundary, [])
    if len(have) < count:
        it = iter(dataset(paths, boundary=boundary, seq_len=2 * MAX_DOC))
        have = _REFERENCE[boundary] = [next(it).numpy() for _ in range(count)]
    return have[:count]


def run_steps(ranks: list[PackedDataset], steps: int, micro_batch: int) -> list[np.ndarray]:
    """Plain iterators in lockstep; the global stream in g order (docs/design.md)."""
    iters = [iter(ds) for ds in ranks]
    stream = []
    for _ in range(steps):
        batches = [[next(it).numpy() for _ in range(micro_batch)] for it in iters]
        # Step t takes g in [t*GB, (t+1)*GB); rank r the g with g % dp_size == r.
        stream += [batches[r][j] for j in range(micro_batch) for r in range(len(ranks))]
    return stream


@settings(max_examples=30, deadline=None)
@given(
    dp_before=st.integers(1, 4),
    dp_after=st.integers(1, 4),
    batch_factor=st.integers(1, 2),
    steps_before=st.integers(0, 4),
    steps_after=st.integers(1, 3),
    boundary=st.sampled_from(["concat", "whole"]),
)
def test_resume_on_another_number_of_ranks_continues_the_stream(
    corpus_files: tuple[list[str], list[np.ndarray]],
    dp_before: int,
    dp_after: int,
    batch_factor: int,
    steps_before: int,
    steps_after: int,
    boundary: str,
) -> None:
    paths, _ = corpus_files
    global_batch = math.lcm(dp_before, dp_after) * batch_factor
    kw: dict[str, Any] = {"boundary": boundary, "seq_len": 2 * MAX_DOC}
    before = [dataset(paths, dp_rank=r, dp_size=dp_before, **kw) for r in range(dp_before)]
    stream = run_steps(before, steps_before, global_batch // dp_before)
    states = [ds.state_dict() for ds in before]
    assert all(s == states[0] for s in states)
    assert states[0]["next_index"] == steps_before * global_batch
    saved = json.loads(json.dumps(states[0]))  # plain values survive any checkpoint format
    after = [dataset(paths, dp_rank=r, dp_size=dp_after, **kw) for r in range(dp_after)]
    for ds in after:
        ds.load_state_dict(saved)
    stream += run_steps(after, steps_after, global_batch // dp_after)
    want = reference(paths, boundary, (steps_before + steps_after) * global_batch)
    assert len(stream) == len(want)
    for g, (got, exp) in enumerate(zip(stream, want, strict=True)):
        np.testing.assert_array_equal(got, exp, err_msg=f"g={g}")


def rank_run(
    paths: list[str], state: dict[str, Any] | None, steps: int, micro_batch: int
) -> tuple[np.ndarray, dict[str, Any]]:
    """One gloo rank: its samples for ``steps`` steps, and the state all ranks agree on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = dataset(paths, boundary="concat", seq_len=2 * MAX_DOC, dp_rank=rank, dp_size=world)
    if state is not None:
        ds.load_state_dict(state)
    it = iter(ds)
    samples = np.stack([next(it).numpy() for _ in range(steps * micro_batch)])
    states: list[Any] = [None] * world
    dist.all_gather_object(states, ds.state_dict(), group=dist.group.WORLD)
    if any(s != states[0] for s in states):
        raise RuntimeError(f"ranks disagree on the state: {states}")
    return samples, ds.state_dict()


@pytest.mark.slow
def test_resume_across_processes_from_two_ranks_onto_three(
    corpus_files: tuple[list[str], list[np.ndarray]],
) -> None:
    paths, _ = corpus_files
    global_batch, steps = 6, 2
    stream: list[np.ndarray] = []
    state = None
    for world in (2, 3):
        micro = global_batch // world
        results = run_ranks(rank_run, world, args=(paths, state, steps, micro), timeout=120)
        for t in range(steps):
            for j in range(micro):
                stream += [results[r][0][t * micro + j] for r in range(world)]
        state = results[0][1]
    want = reference(paths, "concat", 2 * steps * global_batch)
    for g, (got, exp) in enumerate(zip(stream, want, strict=True)):
        np.testing.assert_array_equal(got, exp, err_msg=f"g={g}")


def test_iteration_advances_next_index_and_advance_records_outside_steps(
    corpus_files: tuple[list[str], list[np.ndarray]],
) -> None:
    paths, _ = corpus_files
    ds = dataset(paths, dp_rank=1, dp_size=3)
    it = iter(ds)
    got = [next(it) for _ in range(5)]
    assert ds.next_index == 15
    for k, x in enumerate(got):
        np.testing.assert_array_equal(x.numpy(), ds.sample(3 * k + 1))
    ds.advance(2, 4)
    assert ds.next_index == 15 + 2 * 4 * 3
    np.testing.assert_array_equal(next(iter(ds)).numpy(), ds.sample(40))


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_dataloader_workers_yield_the_plain_iteration(
    corpus_files: tuple[list[str], list[np.ndarray]], dp_rank: int
) -> None:
    paths, _ = corpus_files
    ds = dataset(paths, dp_rank=dp_rank, dp_size=2)
    plain = [x.clone() for x in itertools.islice(iter(ds), 20)]
    ds.load_state_dict(ds.state_dict() | {"next_index": 0})
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    got = list(itertools.islice(iter(loader), 20))
    for k, (a, b) in enumerate(zip(got, plain, strict=True)):
        assert torch.equal(a, b), f"sample {k}"


def test_pickle_leaves_caches_behind(corpus_files: tuple[list[str], list[np.ndarray]]) -> None:
    paths, _ = corpus_files
    ds = dataset(paths, boundary="whole", seq_len=2 * MAX_DOC)
    cold = len(pickle.dumps(ds))
    warm_samples = [ds.sample(g) for g in range(0, 400, 7)]
    assert len(pickle.dumps(ds)) < cold + 200  # a few epoch starts, no epoch layouts
    copy = pickle.loads(pickle.dumps(ds))
    for g, x in zip(range(0, 400, 7), warm_samples, strict=True):
        np.testing.assert_array_equal(copy.sample(g), x)


def sample_in_threads(ds: PackedDataset, count: int, n_threads: int) -> list[np.ndarray]:
    """Samples ``0 .. count - 1`` of ``ds``, built by ``n_threads`` threads at once."""
    got: list[Any] = [None] * count
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def work(t: int) -> None:
        try:
            barrier.wait(timeout=60)  # start together, on cold caches
            # Interleaved, and backwards on odd threads: threads straddle epochs.
            order = list(range(t, count, n_threads))
            for g in order if t % 2 == 0 else order[::-1]:
                got[g] = ds.sample(g)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "a sampling thread is stuck"
    assert not errors, errors
    return got


@pytest.mark.parametrize(
    ("boundary", "shuffle"), [("concat", True), ("whole", True), ("whole", False)]
)
def test_sample_from_many_threads_matches_one_thread(
    corpus_files: tuple[list[str], list[np.ndarray]], boundary: str, shuffle: bool
) -> None:
    """A NodeLoader reader calls sample() from a thread pool: its caches must not race."""
    paths, _ = corpus_files
    kw: dict[str, Any] = {"boundary": boundary, "shuffle": shuffle, "seq_len": 2 * MAX_DOC}
    ref = dataset(paths, **kw)
    count = 8 * (ref.samples_per_epoch or 40)  # several epochs, more than the 3 cached
    want = [ref.sample(g) for g in range(count)]
    assert ref.epoch(count - 1) >= 5
    for _ in range(3):
        shared = dataset(paths, **kw)
        got = sample_in_threads(shared, count, n_threads=6)
        for g in range(count):
            np.testing.assert_array_equal(got[g], want[g])
        assert len(shared._layouts) <= 3


# -- bad input ----------------------------------------------------------------------------


def test_empty_document_is_refused_naming_file_and_index(tmp_path: Path) -> None:
    docs = [np.arange(1, 20), np.arange(5), np.array([], dtype=np.int64), np.arange(9)]
    paths = write_corpus(tmp_path, [[np.arange(1, 30)], docs])
    with pytest.raises(ValueError, match=rf"document 2 of shard {paths[1]} .*empty"):
        dataset(paths)


def test_document_longer_than_a_sample_is_refused_under_whole(tmp_path: Path) -> None:
    docs = [np.arange(1, 5), np.arange(1, SEQ + 2), np.arange(3)]  # doc 1: seq_len + 1 tokens
    paths = write_corpus(tmp_path, [docs])
    dataset(paths, boundary="whole", eos_id=None)  # fits exactly without an eos
    with pytest.raises(ValueError, match=rf"document 1 of shard {paths[0]} .*17 tokens \+ 1 eos"):
        dataset(paths, boundary="whole")
    dataset(paths, boundary="concat")  # documents span samples there


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be >= 1, got 0"),
        ({"seq_len": 4.0}, TypeError, "seq_len must be an int, got float"),
        ({"seq_len": True}, TypeError, "seq_len must be an int, got bool"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got -1"),
        ({"dp_rank": 2, "dp_size": 2}, ValueError, r"dp_rank must be in \[0, dp_size=2\), got 2"),
        ({"dp_size": 0}, ValueError, "dp_size must be >= 1, got 0"),
        ({"boundary": "pack"}, ValueError, "boundary must be one of .*got 'pack'"),
        ({"on_corrupt": "ignore"}, ValueError, "on_corrupt must be one of .*got 'ignore'"),
        ({"eos_id": 65536}, ValueError, r"eos_id must be in \[0, 65535\].*got 65536"),
        ({"pad_id": -1}, ValueError, r"pad_id must be in \[0, 65535\].*got -1"),
        ({"shuffle": 1}, TypeError, "shuffle must be a bool, got int"),
        ({"seq_len": 10_000}, ValueError, "corpus is too small for seq_len=10000"),
    ],
)
def test_bad_arguments_name_what_was_expected(
    corpus_files: tuple[list[str], list[np.ndarray]],
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        dataset(corpus_files[0], **kwargs)


def test_bad_sample_index(corpus_files: tuple[list[str], list[np.ndarray]]) -> None:
    ds = dataset(corpus_files[0])
    with pytest.raises(ValueError, match="g must be >= 0, got -1"):
        ds.sample(-1)
    with pytest.raises(TypeError, match="g must be an int, got float"):
        ds.sample(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batch must be >= 1, got 0"):
        ds.advance(1, 0)


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("seed", {"seed": 8}),
        ("seq_len", {"seq_len": 2 * MAX_DOC + 1}),
        ("boundary", {"boundary": "whole"}),
        ("eos_id", {"eos_id": None}),
        ("shuffle", {"shuffle": False}),
    ],
)
def test_state_of_another_stream_is_refused(
    corpus_files: tuple[list[str], list[np.ndarray]], field: str, change: dict[str, Any]
) -> None:
    paths, _ = corpus_files
    base = {"seq_len": 2 * MAX_DOC}
    state = dataset(paths, **base).state_dict()
    other = dataset(paths, **(base | change))
    with pytest.raises(ValueError, match=rf"state field '{field}' is"):
        other.load_state_dict(state)
    dataset(paths, dp_size=4, dp_rank=3, **base).load_state_dict(state)  # another dp_size: fine


def test_state_of_another_corpus_or_version_is_refused(
    tmp_path: Path, corpus_files: tuple[list[str], list[np.ndarray]]
) -> None:
    paths, _ = corpus_files
    ds = dataset(paths)
    other = dataset(write_corpus(tmp_path, unique_docs(1)))
    with pytest.raises(ValueError, match="state field 'corpus' is"):
        other.load_state_dict(ds.state_dict())
    with pytest.raises(ValueError, match=r"state version must be 1 .*got 2"):
        ds.load_state_dict(ds.state_dict() | {"version": 2})
    state = ds.state_dict()
    del state["seed"]
    with pytest.raises(ValueError, match=r"state lacks the field\(s\) \['seed'\]"):
        ds.load_state_dict(state)
    with pytest.raises(ValueError, match=r"state\['next_index'\] must be >= 0, got -3"):
        ds.load_state_dict(ds.state_dict() | {"next_index": -3})


def chunk_table(path: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(document offsets, chunk table, chunk_tokens), parsed as docs/format.md says."""
    data = Path(path).read_bytes()
    n_docs, _, n_chunks, index_offset, _, chunk_tokens = struct.unpack_from("<QQQQQI", data, -64)
    offsets = np.frombuffer(data, "<u8", n_docs + 1, index_offset).astype(np.int64)
    table = np.frombuffer(
        data, [("offset", "<u8"), ("length", "<u4"), ("crc", "<u4")], n_chunks,
        index_offset + 8 * (n_docs + 1),
    )  # fmt: skip
    return offsets, table, chunk_tokens


def test_damaged_chunk_raises_or_is_skipped_and_counted(tmp_path: Path) -> None:
    # 16-token chunks. Damaged: chunk 5 (tokens 80..96), which documents 3 and 4 fill
    # exactly (2 ends at 80, 5 starts at 96), and chunk 10 (160..176), inside document 7.
    lengths = [20, 30, 30, 10, 6, 25, 29, 35, 15, 12, 40, 7]
    first = unique_docs(2, n_shards=1)[0]
    ids = np.arange(1, sum(lengths) + 1) + sum(map(len, first))
    shards = [first, np.split(ids, np.cumsum(lengths)[:-1])]
    paths = write_corpus(tmp_path, shards, chunk_tokens=16)
    clean = dataset(paths, on_corrupt="skip", shuffle=False)
    assert clean.skipped == 0
    offsets, table, ct = chunk_table(paths[1])
    raw = bytearray(Path(paths[1]).read_bytes())
    touching: set[int] = set()
    for bad in (5, 10):
        lo, hi = bad * ct, (bad + 1) * ct
        touching |= {i for i in range(len(lengths)) if offsets[i] < hi and offsets[i + 1] > lo}
        raw[int(table[bad]["offset"]) + int(table[bad]["length"]) // 2] ^= 0xFF
    assert sorted(touching) == [3, 4, 7]
    Path(paths[1]).write_bytes(bytes(raw))

    strict = dataset(paths, shuffle=False)
    with pytest.raises(ChunkCorruptError) as info:
        [strict.sample(g) for g in range(strict.samples_per_epoch or 0)]
    assert info.value.chunk == 5 and info.value.path == paths[1]

    ds = dataset(paths, on_corrupt="skip", shuffle=False)
    skipped = [DOCS_PER_SHARD + i for i in sorted(touching)]
    assert ds.skipped == len(touching) == ds.stats()["skipped_documents"]
    np.testing.assert_array_equal(ds.skipped_documents, skipped)
    kept = [d for i, d in enumerate(shards[0] + shards[1]) if i not in skipped]
    stream = with_eos(kept)
    n = (len(stream) - 1) // SEQ
    assert ds.samples_per_epoch == n
    for g in range(n):
        np.testing.assert_array_equal(ds.sample(g), stream[g * SEQ : g * SEQ + SEQ + 1])
    # The damage changed the stream: a state from before it cannot be continued.
    with pytest.raises(ValueError, match=r"state field 'skipped' is 0.*damaged chunks"):
        ds.load_state_dict(clean.state_dict())


# -- the held-out split --------------------------------------------------------------------


def _docs_of(samples: list[np.ndarray], docs: list[np.ndarray]) -> set[int]:
    """Indices of the documents whose tokens the samples hold (token ids are unique)."""
    owner = {int(t): i for i, d in enumerate(docs) for t in d}
    return {owner[int(t)] for s in samples for t in s if int(t) in owner}


@pytest.mark.parametrize("boundary", ["concat", "whole"])
def test_held_out_documents_never_reach_the_training_stream(
    corpus_files: tuple[list[str], list[np.ndarray]], boundary: str
) -> None:
    paths, docs = corpus_files
    kw: dict[str, Any] = {"boundary": boundary, "seq_len": 2 * MAX_DOC, "held_out": 0.1}
    train = dataset(paths, **kw)
    held = dataset(paths, split="held_out", **kw)
    expected = set(held.held_out_documents.tolist())
    assert len(expected) == round(0.1 * len(docs)) == 7
    assert set(train.held_out_documents.tolist()) == expected  # whichever split asks
    # Two epochs of each stream, read back to the documents by their (unique) tokens.
    n_train = sum(1 for g in range(4 * len(docs)) if train.epoch(g) < 2)
    n_held = sum(1 for g in range(4 * len(docs)) if held.epoch(g) < 2)
    trained = _docs_of([train.sample(g) for g in range(n_train)], docs)
    evaluated = _docs_of([held.sample(g) for g in range(n_held)], docs)
    assert evaluated == expected
    assert trained == set(range(len(docs))) - expected
    stats = train.stats()
    assert (stats["documents"], stats["held_out_documents"]) == (len(docs) - 7, 7)
    assert held.stats()["documents"] == 7


def test_held_out_set_is_a_function_of_the_corpus_size_and_fraction_only(
    corpus_files: tuple[list[str], list[np.ndarray]],
) -> None:
    paths, docs = corpus_files
    small = dataset(paths, held_out=0.05, seed=1).held_out_documents
    again = dataset(paths, held_out=0.05, seed=2, shuffle=False, dp_size=3, dp_rank=2)
    np.testing.assert_array_equal(again.held_out_documents, small)
    larger = dataset(paths, held_out=0.2).held_out_documents
    assert set(small.tolist()) < set(larger.tolist())
    assert dataset(paths, held_out=0.001).held_out_documents.size == 1  # at least one
    # Held out 0: the stream of earlier versions, sample for sample.
    plain, zero = dataset(paths), dataset(paths, held_out=0.0)
    for g in range(0, 3 * len(docs), 5):
        np.testing.assert_array_equal(zero.sample(g), plain.sample(g))


def test_held_out_stream_resumes_and_refuses_another_split(
    corpus_files: tuple[list[str], list[np.ndarray]],
) -> None:
    paths, _ = corpus_files
    held = dataset(paths, held_out=0.1, split="held_out")
    held.advance(3, 4)
    state = held.state_dict()
    assert (state["held_out"], state["split"]) == (0.1, "held_out")
    other = dataset(paths, held_out=0.1, split="held_out", dp_size=2)
    other.load_state_dict(state)
    assert other.next_index == 12
    with pytest.raises(ValueError, match=r"state field 'split' is 'held_out'"):
        dataset(paths, held_out=0.1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"state field 'held_out' is 0.1, this dataset has 0.2"):
        dataset(paths, held_out=0.2, split="held_out").load_state_dict(state)
    # A state saved before the split existed describes held_out 0, split "train".
    old = dataset(paths).state_dict()
    del old["held_out"], old["split"]
    dataset(paths).load_state_dict(old)
    with pytest.raises(ValueError, match=r"state field 'held_out' is 0.0"):
        dataset(paths, held_out=0.1).load_state_dict(old)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"held_out": 1.0}, ValueError, r"held_out must be a fraction in \[0, 1\), got 1.0"),
        ({"held_out": -0.1}, ValueError, r"held_out must be a fraction in \[0, 1\), got -0.1"),
        ({"held_out": "0.1"}, TypeError, r"held_out must be a float, got str '0.1'"),
        ({"split": "val"}, ValueError, r"split must be one of \('train', 'held_out'\), got 'val'"),
        ({"split": "held_out"}, ValueError, r"split='held_out' needs held_out > 0"),
        ({"held_out": 0.999}, ValueError, r"held_out=0.999 holds out 72 of the corpus's 72"),
    ],
)
def test_bad_held_out_arguments_name_what_was_expected(
    corpus_files: tuple[list[str], list[np.ndarray]],
    kwargs: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    paths, _ = corpus_files
    with pytest.raises(error, match=message):
        dataset(paths, **kwargs)


def test_held_out_split_too_small_for_a_sample_names_the_split(tmp_path: Path) -> None:
    # 40 documents of 3 tokens: the one held out makes 4 tokens with its eos, < SEQ + 1.
    paths = write_corpus(tmp_path, [[np.arange(3 * i + 1, 3 * i + 4) for i in range(40)]])
    assert dataset(paths, held_out=0.01).samples_per_epoch == (39 * 4 - 1) // SEQ
    with pytest.raises(ValueError, match=r"the documents of split 'held_out' make a stream of 4"):
        dataset(paths, held_out=0.01, split="held_out")
