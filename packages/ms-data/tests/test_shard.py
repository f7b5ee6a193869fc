"""Shards: exact round trips, ranged reads only, every damaged-file error, pickling.

Damage is done with real byte edits on real files; reads are counted by
``ms_testing``'s ``counting://`` filesystem; pickled readers are opened in real
subprocesses.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import textwrap
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_data import _format as fmt
from ms_data import _shard_reader
from ms_data.shard import (
    DEFAULT_CHUNK_TOKENS,
    ChunkCorruptError,
    Corpus,
    ShardError,
    ShardInfo,
    ShardReader,
    ShardWriter,
)
from ms_testing import COUNTER_ENV, CountingFileSystem, read_counts, reset_counts

HI = {"uint16": 2**16 - 1, "uint32": 2**32 - 1}


def write_shard(url: str | Path, docs: list, dtype: str = "uint16", **kw: object) -> ShardInfo:
    with ShardWriter(url, dtype, **kw) as w:  # type: ignore[arg-type]
        for d in docs:
            w.add_document(d)
    return w.close()


def documents(dtype: str) -> st.SearchStrategy[np.ndarray]:
    """Empty, short (any ids, extremes included) and long documents (seeded noise)."""
    hi = HI[dtype]
    short = st.lists(st.integers(0, hi), min_size=1, max_size=30)
    long = st.tuples(st.integers(100, 2500), st.integers(0, 2**32 - 1)).map(
        lambda t: np.random.default_rng(t[1]).integers(0, hi, size=t[0], endpoint=True)
    )
    return st.one_of(st.just([]), short, long).map(lambda d: np.asarray(d, dtype=dtype))


@st.composite
def shard_cases(draw: st.DrawFn) -> tuple[str, int, list[np.ndarray]]:
    dtype = draw(st.sampled_from(["uint16", "uint32"]))
    chunk_tokens = draw(st.sampled_from([1, 7, 64, 1000]))
    docs = draw(st.lists(documents(dtype), max_size=12))
    return dtype, chunk_tokens, docs


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shards")


@settings(max_examples=60)
@given(case=shard_cases(), backend=st.sampled_from(["memory", "file"]), data=st.data())
def test_round_trip_reproduces_every_document_and_range(
    shard_dir: Path, case: tuple[str, int, list[np.ndarray]], backend: str, data: st.DataObject
) -> None:
    dtype, chunk_tokens, docs = case
    name = f"{uuid.uuid4().hex}.mss"
    url = f"memory://roundtrip/{name}" if backend == "memory" else f"file://{shard_dir / name}"
    info = write_shard(url, docs, dtype, chunk_tokens=chunk_tokens)
    try:
        r = ShardReader(url)
        stream = np.concatenate([np.zeros(0, dtype), *docs])
        assert (r.n_docs, r.n_tokens, r.dtype) == (len(docs), stream.size, np.dtype(dtype))
        assert r.n_chunks == -(-stream.size // chunk_tokens) == info.n_chunks
        assert r.nbytes == info.nbytes == fsspec.core.url_to_fs(url)[0].size(url)
        assert r.doc_lengths().tolist() == [d.size for d in docs]
        order = data.draw(st.permutations(range(len(docs))))
        for i in order:
            got = r.read_document(i)
            assert got.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got, docs[i])
        a = data.draw(st.integers(0, stream.size))
        b = data.draw(st.integers(a, stream.size))
        np.testing.assert_array_equal(r.read_tokens(a, b), stream[a:b])
        assert r.verify() == []
    finally:
        fsspec.core.url_to_fs(url)[0].rm_file(url)


def test_large_document_spans_many_default_chunks(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    big = rng.integers(0, 2**16, size=1_000_003).astype(np.uint16)
    docs = [np.array([1, 2, 3], np.uint16), big, np.zeros(0, np.uint16), big[:5]]
    info = write_shard(tmp_path / "big.mss", docs)
    r = ShardReader(tmp_path / "big.mss")
    assert info.n_chunks == r.n_chunks == -(-(3 + big.size + 5) // DEFAULT_CHUNK_TOKENS) > 100
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(r.read_document(i), d)


def test_empty_shard_and_shard_of_empty_documents_round_trip(tmp_path: Path) -> None:
    for docs in ([], [[], [], []]):
        path = tmp_path / f"e{len(docs)}.mss"
        info = write_shard(path, docs)
        r = ShardReader(path)
        assert (info.n_docs, info.n_tokens, info.n_chunks) == (len(docs), 0, 0)
        assert (r.n_docs, r.n_tokens, r.n_chunks) == (len(docs), 0, 0)
        assert [r.read_document(i).size for i in range(len(docs))] == [0] * len(docs)
        assert r.verify() == []
        assert path.stat().st_size == fmt.MIN_SIZE + fmt.index_length(len(docs), 0)


def test_writer_returned_arrays_do_not_alias_its_input_or_the_readers_cache(
    tmp_path: Path,
) -> None:
    buf = np.arange(10, dtype=np.uint16)
    with ShardWriter(tmp_path / "a.mss", chunk_tokens=100) as w:
        w.add_document(buf)
        buf[:] = 7  # the caller reuses its buffer before the chunk is written
        w.add_document(buf)
    r = ShardReader(tmp_path / "a.mss")
    first = r.read_document(0)
    np.testing.assert_array_equal(first, np.arange(10))
    first[:] = 0
    np.testing.assert_array_equal(r.read_document(0), np.arange(10))
    np.testing.assert_array_equal(r.read_document(1), np.full(10, 7))


# ---------------------------------------------------------------- ranged reads


def _chunks_of(r: ShardReader, i: int) -> range:
    start, stop = int(r.doc_offsets[i]), int(r.doc_offsets[i + 1])
    if start == stop:
        return range(0)
    return range(start // r.chunk_tokens, (stop - 1) // r.chunk_tokens + 1)


def test_opening_reads_header_footer_and_index_and_a_document_only_its_chunks(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(1)
    lengths = [0, 5, 100, 999, 1, 0, 250, 3000, 40]
    docs = [rng.integers(0, 60000, n) for n in lengths]
    path = tmp_path / "s.mss"
    write_shard(path, docs, chunk_tokens=128)
    counter = tmp_path / "reads"
    fs = CountingFileSystem(counter=counter)

    opened = ShardReader(str(path), fs=fs)
    index = fmt.index_length(opened.n_docs, opened.n_chunks)
    assert read_counts(counter).total == fmt.HEADER_SIZE + fmt.FOOTER_SIZE + index
    assert opened.n_chunks > 20  # many chunks, so "only some" means something

    for i in reversed(range(len(docs))):
        r = ShardReader(str(path), fs=fs)  # a fresh reader: nothing cached
        reset_counts(counter)
        np.testing.assert_array_equal(r.read_document(i), docs[i])
        counts = read_counts(counter)
        expected = sum(int(r.chunk_table[c]["length"]) for c in _chunks_of(r, i))
        assert counts.total == expected, (i, list(_chunks_of(r, i)))
        assert counts.calls == (1 if lengths[i] else 0)  # one ranged read per document


def test_consecutive_documents_do_not_reread_their_shared_chunk(tmp_path: Path) -> None:
    docs = [np.full(50, k, np.uint16) for k in range(6)]  # chunk 0: docs 0, 1 and part of 2
    write_shard(tmp_path / "s.mss", docs, chunk_tokens=128)
    counter = tmp_path / "reads"
    r = ShardReader(str(tmp_path / "s.mss"), fs=CountingFileSystem(counter=counter))
    reset_counts(counter)
    for i in range(len(docs)):
        np.testing.assert_array_equal(r.read_document(i), docs[i])
    assert read_counts(counter).total == sum(int(x) for x in r.chunk_table["length"])


def test_threads_read_one_reader_at_once(tmp_path: Path) -> None:
    """Threads share the decoded-chunk cache; each has its own zstd context."""
    rng = np.random.default_rng(4)
    docs = [rng.integers(0, 60000, int(n), dtype=np.uint16) for n in rng.integers(1, 700, 200)]
    write_shard(tmp_path / "s.mss", docs, chunk_tokens=256)
    r = ShardReader(str(tmp_path / "s.mss"))
    order = rng.permutation(np.tile(np.arange(len(docs)), 5))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(r.read_document, order.tolist()))
    for i, tokens in zip(order.tolist(), got, strict=True):
        np.testing.assert_array_equal(tokens, docs[i])


def _open_fds_under(root: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")
def test_local_shards_keep_a_bounded_number_of_files_open(tmp_path: Path) -> None:
    """Local reads go through descriptors kept open, at most _MAX_OPEN_FILES of them."""
    limit = _shard_reader._MAX_OPEN_FILES
    readers = []
    for i in range(limit + 6):
        write_shard(tmp_path / f"s{i:03d}.mss", [[i, i + 1], [i + 2]])
        readers.append(ShardReader(tmp_path / f"s{i:03d}.mss"))
    for _ in range(2):  # the second round reopens the ones the first closed
        for i, r in enumerate(readers):
            assert r.read_document(0).tolist() == [i, i + 1]
            assert r.read_document(1).tolist() == [i + 2]
    assert 0 < _open_fds_under(tmp_path) <= limit


def test_a_new_reader_sees_a_shard_replaced_at_the_same_path(tmp_path: Path) -> None:
    """A descriptor kept open from an earlier reader must not serve the old file."""
    path = tmp_path / "s.mss"
    write_shard(path, [[1, 2, 3]])
    assert ShardReader(path).read_document(0).tolist() == [1, 2, 3]
    write_shard(tmp_path / "new.mss", [[4, 5], [6]])
    os.replace(tmp_path / "new.mss", path)
    again = ShardReader(path)
    assert again.n_docs == 2 and again.read_document(1).tolist() == [6]


def test_counting_urls_take_the_counter_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_shard(tmp_path / "s.mss", [[1, 2, 3]])
    monkeypatch.setenv(COUNTER_ENV, str(tmp_path / "reads"))
    r = ShardReader(f"counting://{tmp_path / 's.mss'}")
    assert r.read_document(0).tolist() == [1, 2, 3]
    assert read_counts(tmp_path / "reads").total == r.nbytes  # a one-chunk shard: all of it


# ---------------------------------------------------------------- damaged files


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A shard of 4 documents over 5 chunks of 16 tokens."""
    rng = np.random.default_rng(2)
    path = tmp_path / "good.mss"
    write_shard(path, [rng.integers(0, 1000, n) for n in (20, 0, 33, 17)], chunk_tokens=16)
    return path


def _layout(path: Path) -> tuple[fmt.Footer, np.ndarray]:
    raw = path.read_bytes()
    foot = fmt.unpack_footer(raw[-fmt.FOOTER_SIZE :])
    index = raw[foot.index_offset : foot.index_offset + foot.index_length]
    table = np.frombuffer(index, fmt.CHUNK_ENTRY, offset=8 * (foot.n_docs + 1)).copy()
    return foot, table


def _edit(path: Path, offset: int, new: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(new)] = new
    path.write_bytes(bytes(data))


def _flip(path: Path, offset: int) -> None:
    _edit(path, offset, bytes([path.read_bytes()[offset] ^ 0x10]))


def _open_error(path: Path, offset: int, *words: str) -> ShardError:
    with pytest.raises(ShardError) as info:
        ShardReader(path)
    err = info.value
    assert err.path == str(path) and err.offset == offset, (err.path, err.offset, str(err))
    message = str(err)
    assert str(path) in message and f"byte offset {offset}" in message, message
    for word in words:
        assert word in message, message
    return err


@pytest.mark.parametrize("keep", [0, 15, 79, -1, -8, -64, -65, -200])
def test_truncated_shard_names_file_and_offset(good: Path, keep: int) -> None:
    data = good.read_bytes()
    good.write_bytes(data[:keep])  # keep < 0: cut -keep bytes off the end
    size = good.stat().st_size
    if size < fmt.MIN_SIZE:
        _open_error(good, size, "truncated", f"{size} bytes")
    else:
        _open_error(good, size - 8, "truncated", "no footer magic")


def test_file_shorter_than_its_footer_says(good: Path) -> None:
    data = good.read_bytes()
    good.write_bytes(data[:20] + data[30:])  # ten bytes of a chunk gone, footer intact
    _open_error(good, len(data) - 10, "truncated", f"footer says {len(data)} bytes")


def test_bytes_inserted_before_the_footer_are_caught(good: Path) -> None:
    data = good.read_bytes()
    good.write_bytes(data[:-64] + b"junk" + data[-64:])
    _open_error(good, len(data) + 4 - 64 + 24, "footer inconsistent")


def test_bad_magic(good: Path) -> None:
    _edit(good, 0, b"PAR1")
    _open_error(good, 0, "bad magic", "not an ms-data shard")


def test_unsupported_version(good: Path) -> None:
    _edit(good, 8, struct.pack("<H", 2))
    _open_error(good, 8, "unsupported format version 2", "reads version 1")


def test_unknown_dtype_code(good: Path) -> None:
    _edit(good, 10, bytes([9]))
    _open_error(good, 10, "unknown dtype code 9")


def test_header_dtype_that_disagrees_with_the_footer(good: Path) -> None:
    _edit(good, 10, bytes([2]))  # a valid code, but the footer says uint16
    _open_error(good, 8, "disagrees with the footer")


@pytest.mark.parametrize("field_at", [0, 24, 40, 50])
def test_footer_bit_flip_fails_its_checksum(good: Path, field_at: int) -> None:
    size = good.stat().st_size
    _flip(good, size - 64 + field_at)
    _open_error(good, size - 64, "footer checksum mismatch")


def test_index_bit_flip_fails_its_checksum(good: Path) -> None:
    foot, _ = _layout(good)
    _flip(good, foot.index_offset + 8 * 2 + 1)
    _open_error(good, foot.index_offset, "index checksum mismatch")


def _rewrite_index(path: Path, offsets: np.ndarray, table: np.ndarray) -> None:
    """Replace the index with valid checksums: what a buggy writer would produce."""
    foot, _ = _layout(path)
    index = offsets.astype("<u8").tobytes() + table.astype(fmt.CHUNK_ENTRY).tobytes()
    footer = fmt.pack_footer(
        n_docs=foot.n_docs,
        n_tokens=foot.n_tokens,
        n_chunks=foot.n_chunks,
        index_offset=foot.index_offset,
        index_length=len(index),
        chunk_tokens=foot.chunk_tokens,
        index_crc32=fmt.crc32(index),
        dtype_code=foot.dtype_code,
    )
    raw = path.read_bytes()
    path.write_bytes(raw[: foot.index_offset] + index + footer)


def test_index_with_valid_checksum_but_decreasing_offsets(good: Path) -> None:
    foot, table = _layout(good)
    offsets = np.array([0, 20, 10, 53, 70], np.uint64)
    _rewrite_index(good, offsets, table)
    _open_error(good, foot.index_offset + 16, "index inconsistent", "document 1")


def test_flipped_chunk_bit_fails_that_chunk_only(good: Path) -> None:
    _, table = _layout(good)
    c = 2  # tokens 32..47: documents 2 (20..53) only
    at = int(table[c]["offset"]) + int(table[c]["length"]) // 2
    _flip(good, at)
    r = ShardReader(good)  # the index is intact: opening succeeds
    with pytest.raises(ChunkCorruptError) as info:
        r.read_document(2)
    err = info.value
    assert (err.chunk, err.offset, err.path) == (c, int(table[c]["offset"]), str(good))
    assert "crc32" in str(err) and f"byte offset {err.offset}" in str(err) and str(good) in str(err)
    for i in (0, 1, 3):  # untouched chunks still read
        assert r.read_document(i).size == [20, 0, 33, 17][i]
    assert [e.chunk for e in r.verify()] == [c]
    # the errors survive pickling (a loader's reader process sends them to its ranks)
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.chunk, again.offset, str(again)) == (
        ChunkCorruptError,
        c,
        err.offset,
        str(err),
    )


def _replace_chunk(path: Path, c: int, data: bytes) -> None:
    """Swap chunk c's bytes (same length) and fix every checksum around them."""
    foot, table = _layout(path)
    start = int(table[c]["offset"])
    assert len(data) == int(table[c]["length"])
    _edit(path, start, data)
    table[c]["crc32"] = fmt.crc32(data)
    raw = path.read_bytes()
    offsets = np.frombuffer(raw, "<u8", count=foot.n_docs + 1, offset=foot.index_offset)
    _rewrite_index(path, offsets, table)


def test_chunk_with_valid_crc_that_zstd_cannot_decode(good: Path) -> None:
    _, table = _layout(good)
    _replace_chunk(good, 1, b"\x00" * int(table[1]["length"]))
    r = ShardReader(good)
    with pytest.raises(ChunkCorruptError, match="zstd cannot decode") as info:
        r.read_document(0)  # tokens 0..20: chunks 0 and 1
    assert info.value.chunk == 1 and info.value.offset == int(table[1]["offset"])
    assert [e.chunk for e in r.verify()] == [1]


def test_chunk_that_decodes_to_the_wrong_length(good: Path) -> None:
    _, table = _layout(good)
    length = int(table[3]["length"])
    wrong = zstandard.ZstdCompressor(write_content_size=True).compress(b"\x01" * 30)
    assert len(wrong) < length  # a valid frame of 30 bytes, where 32 are due
    _replace_chunk(good, 3, wrong + b"\x00" * (length - len(wrong)))
    with pytest.raises(ChunkCorruptError, match="chunk 3") as info:
        ShardReader(good).read_tokens(48, 64)
    assert info.value.chunk == 3


def test_writer_refuses_ids_that_do_not_fit_naming_document_and_value(tmp_path: Path) -> None:
    with ShardWriter(tmp_path / "a.mss") as w:
        w.add_document([1, 2])
        w.add_document([])
        with pytest.raises(ValueError, match=r"document 2: token id 70000 at position 1 .*uint16"):
            w.add_document([5, 70000, 6])
        with pytest.raises(ValueError, match=r"document 2: token id -1 at position 0"):
            w.add_document(np.array([-1, 3]))
        with pytest.raises(
            TypeError, match="document 2: token ids must be integers, got dtype float64"
        ):
            w.add_document([1.5])
        with pytest.raises(ValueError, match=r"document 2: tokens must be 1-D, got shape \(1, 2\)"):
            w.add_document([[1, 2]])
        w.add_document(np.array([2**16 - 1], np.int64))  # the maximum fits
    r = ShardReader(tmp_path / "a.mss")
    assert r.n_docs == 3 and r.read_document(2).tolist() == [2**16 - 1]
    with (
        ShardWriter(tmp_path / "b.mss", "uint32") as w,
        pytest.raises(ValueError, match=r"token id 4294967296 .*uint32"),
    ):
        w.add_document([2**32])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "int32"}, "dtype must be 'uint16' or 'uint32', got 'int32'"),
        ({"dtype": "float"}, "dtype must be 'uint16' or 'uint32', got 'float'"),
        ({"chunk_tokens": 0}, "chunk_tokens must be an int >= 1, got 0"),
        ({"chunk_tokens": 2**30}, "chunk_tokens \\* itemsize must be at most"),
        ({"level": 99}, "level must be a zstd level, an int in .*got 99"),
    ],
)
def test_writer_arguments_are_validated(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardWriter(tmp_path / "a.mss", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_writer_after_close_refuses(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path / "a.mss")
    info = w.close()
    assert w.close() is info
    with pytest.raises(ValueError, match="is closed"):
        w.add_document([1])


def test_document_and_token_ranges_out_of_range_raise_index_error(good: Path) -> None:
    r = ShardReader(good)
    for i in (4, -1, 10**12):
        with pytest.raises(IndexError, match=f"document {i} out of range: .*good.mss holds 4"):
            r.read_document(i)
    with pytest.raises(IndexError, match=r"token range \[60, 71\) out of range"):
        r.read_tokens(60, 71)
    with pytest.raises(IndexError):
        r.read_tokens(5, 4)
    with pytest.raises(TypeError):
        r.read_document(1.0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- atomic writes


def _write_then_fail(url: str | Path) -> None:
    with ShardWriter(url, chunk_tokens=4) as w:
        w.add_document(range(100))
        raise RuntimeError("boom")


def test_an_exception_inside_the_writer_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _write_then_fail(tmp_path / "a.mss")
    assert list(tmp_path.iterdir()) == []
    url = f"memory://aborted/{uuid.uuid4().hex}.mss"
    with pytest.raises(RuntimeError, match="boom"):
        _write_then_fail(url)
    assert not fsspec.filesystem("memory").exists(url)


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from ms_data.shard import ShardWriter
    w = ShardWriter(sys.argv[1], chunk_tokens=256)
    rng = np.random.default_rng(0)
    for _ in range(50):
        w.add_document(rng.integers(0, 2**16, 1000))
    print("written", flush=True)
    time.sleep(60)
    """
)


def test_a_killed_writer_leaves_no_file_that_looks_like_a_shard(tmp_path: Path) -> None:
    target = tmp_path / "shard-00000.mss"
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the writer never reported"
        assert proc.stdout.readline().strip() == "written"
        leftovers = list(tmp_path.iterdir())
        assert len(leftovers) == 1 and leftovers[0].stat().st_size > 10_000  # mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert not target.exists()
    with pytest.raises(ValueError, match=r"holds no \*\.mss shards"):
        Corpus(tmp_path)
    with pytest.raises(ShardError, match="no footer magic"):
        ShardReader(leftovers[0])


# ---------------------------------------------------------------- Corpus


def test_corpus_from_directory_glob_and_list(tmp_path: Path) -> None:
    sizes = {"shard-00002.mss": [3], "shard-00000.mss": [1, 2], "shard-00001.mss": []}
    for name, lengths in sizes.items():
        write_shard(tmp_path / name, [np.full(n, n, np.uint16) for n in lengths])
    (tmp_path / "notes.txt").write_text("not a shard")
    by_dir = Corpus(tmp_path)
    by_glob = Corpus(f"file://{tmp_path}/shard-*.mss")
    by_list = Corpus([tmp_path / "shard-00000.mss", str(tmp_path / "shard-00001.mss"),
                      tmp_path / "shard-00002.mss"])  # fmt: skip
    for c in (by_dir, by_glob, by_list):
        assert [Path(u.removeprefix("file://")).name for u in c.urls] == sorted(sizes)
        assert (c.n_docs, c.n_tokens) == (3, 6)
        assert c.doc_lengths().tolist() == [1, 2, 3]
        assert c.doc_lengths().dtype == np.int64
        assert [c.locate(d) for d in range(3)] == [(0, 0), (0, 1), (2, 0)]
        assert [c.read_document(d).tolist() for d in range(3)] == [[1], [2, 2], [3, 3, 3]]
        with pytest.raises(IndexError, match="document 3 out of range: the corpus holds 3"):
            c.locate(3)
    reversed_list = Corpus([tmp_path / "shard-00002.mss", tmp_path / "shard-00000.mss"])
    assert reversed_list.doc_lengths().tolist() == [3, 1, 2]  # a list keeps its order


def test_corpus_on_memory_filesystem() -> None:
    base = f"memory://corpus-{uuid.uuid4().hex}"
    write_shard(f"{base}/b.mss", [[5, 6]])
    write_shard(f"{base}/a.mss", [[4]])
    c = Corpus(base)
    name = base.removeprefix("memory://")
    assert c.urls == [f"memory:///{name}/a.mss", f"memory:///{name}/b.mss"]
    assert [c.read_document(d).tolist() for d in range(2)] == [[4], [5, 6]]
    fsspec.filesystem("memory").rm(name, recursive=True)


def test_corpus_errors_name_what_was_asked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        Corpus([])
    with pytest.raises(ValueError, match="no shard matches"):
        Corpus(f"{tmp_path}/*.mss")
    with pytest.raises(FileNotFoundError):
        Corpus(tmp_path / "absent.mss")


# ---------------------------------------------------------------- pickling


CHILD = textwrap.dedent(
    """
    import pickle, sys
    objs = pickle.load(sys.stdin.buffer)
    out = [[o.read_document(i).tolist() for i in range(o.n_docs)] for o in objs]
    sys.stdout.buffer.write(pickle.dumps([type(o).__name__ for o in objs] + out))
    """
)


def _in_child(objs: list[object]) -> list:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=pickle.dumps(objs),
        capture_output=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.decode()[-3000:])
    return pickle.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_readers_and_corpora_pickle_by_url_and_reopen_in_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 2**16, n).tolist() for n in (0, 10, 300, 7)]
    write_shard(tmp_path / "a.mss", docs[:2], chunk_tokens=32)
    write_shard(tmp_path / "b.mss", docs[2:], chunk_tokens=32)
    by_env, by_arg = tmp_path / "reads-env", tmp_path / "reads-arg"
    monkeypatch.setenv(COUNTER_ENV, str(by_env))  # the child inherits it
    reader = ShardReader(f"counting://{tmp_path / 'b.mss'}")
    corpus = Corpus(f"counting://{tmp_path}")
    explicit = ShardReader(str(tmp_path / "a.mss"), fs=CountingFileSystem(counter=by_arg))
    objs = [reader, corpus, explicit]
    blob = pickle.dumps(objs)
    assert len(blob) < 1500, len(blob)  # URLs, not the index or any tokens
    reset_counts(by_env)
    reset_counts(by_arg)

    got = _in_child(objs)

    assert got == ["ShardReader", "Corpus", "ShardReader", docs[2:], docs, docs[:2]]
    # Every file read exactly once per copy, all of it in the child.
    env, arg = read_counts(by_env), read_counts(by_arg)
    assert os.getpid() not in env.by_pid and os.getpid() not in arg.by_pid
    a, b = (tmp_path / "a.mss").stat().st_size, (tmp_path / "b.mss").stat().st_size
    assert env.by_path == {str(tmp_path / "a.mss"): a, str(tmp_path / "b.mss"): 2 * b}
    assert arg.total == a  # the explicit filesystem travelled with its counter argument

    # A shard rewritten after pickling is refused in the child, not silently read.
    write_shard(tmp_path / "b.mss", [[1, 2, 3]])
    with pytest.raises(RuntimeError, match="changed since its reader was pickled"):
        _in_child([reader])
