"""The builder: input order, JSONL pieces, shard cutting, determinism across workers, errors."""

from __future__ import annotations

import json
import re
import sysconfig
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from ms_data.build import MANIFEST_NAME, BuildConfig, BuildError, build_shards, shard_name
from ms_data.shard import Corpus, ShardReader

EOS = 256
STDLIB_JSON = Path(sysconfig.get_paths()["stdlib"]) / "json"


def doc(text: str, eos: bool = True) -> list[int]:
    return list(text.encode("utf-8")) + ([EOS] if eos else [])


def read_all(out: Path | str) -> list[list[int]]:
    corpus = Corpus(out)
    return [corpus.read_document(d).tolist() for d in range(corpus.n_docs)]


def test_directories_are_walked_in_sorted_order_with_glob_and_hidden_entries_skipped(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".hidden").mkdir()
    (src / "b.txt").write_text("bee")
    (src / "a.txt").write_text("ay é")
    (src / "empty.txt").write_text("")
    (src / "sub" / "c.txt").write_text("sea\n")
    (src / ".hidden" / "x.txt").write_text("hidden")
    (src / ".dot.txt").write_text("dot")
    (src / "skip.md").write_text("not matched")
    extra = tmp_path / "extra.md"  # a file named explicitly is taken whatever the glob
    extra.write_text("extra")
    out = tmp_path / "out"

    summary = build_shards([src, extra], out, BuildConfig(glob="*.txt", docs_per_shard=2))

    assert read_all(out) == [doc("ay é"), doc("bee"), doc("sea\n"), doc("extra")]
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, shard_name(0), shard_name(1)]
    assert [s.n_docs for s in summary.shards] == [2, 2]
    assert (summary.n_inputs, summary.n_empty, summary.n_docs) == (5, 1, 4)
    assert summary.n_tokens == sum(len(d) for d in read_all(out))
    assert summary.input_nbytes == len("ay ébeesea\nextra".encode())
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["tokenizer"] == "bytes" and manifest["dtype"] == "uint16"
    assert (manifest["n_docs"], manifest["n_tokens"], manifest["eos_id"]) == (
        4,
        summary.n_tokens,
        EOS,
    )
    assert [s["name"] for s in manifest["shards"]] == [shard_name(0), shard_name(1)]
    assert [s["nbytes"] for s in manifest["shards"]] == [
        (out / shard_name(i)).stat().st_size for i in range(2)
    ]


JSONL_LINES = [
    '{"text": "one", "id": 1}\n',
    "\n",
    '{"text": ""}\n',
    '{"id": 4, "text": "ünï\\ncode"}\n',
    '  {"text": "spaced"}  \n',
    '{"text": "last, no newline"}',
]
JSONL_DOCS = ["one", "ünï\ncode", "spaced", "last, no newline"]


@pytest.mark.parametrize("piece", [1, 7, 30, 1 << 20])
def test_jsonl_pieces_cut_at_line_boundaries_give_the_same_documents(
    tmp_path: Path, piece: int
) -> None:
    src = tmp_path / "data.jsonl"
    src.write_text("".join(JSONL_LINES))
    out = tmp_path / "out"
    summary = build_shards([src], out, BuildConfig(jsonl_piece_bytes=piece))
    assert read_all(out) == [doc(t) for t in JSONL_DOCS]
    assert summary.n_empty == 2  # the blank line and the empty text
    assert summary.input_nbytes == src.stat().st_size


def test_jsonl_field_and_no_eos(tmp_path: Path) -> None:
    src = tmp_path / "data.ndjson"
    src.write_text('{"body": "x"}\n{"body": "yz", "text": "ignored"}\n')
    out = tmp_path / "out"
    build_shards([src], out, BuildConfig(jsonl_field="body", eos=False))
    assert read_all(out) == [doc("x", eos=False), doc("yz", eos=False)]
    assert json.loads((out / MANIFEST_NAME).read_text())["eos_id"] is None


def test_tokens_per_shard_starts_a_new_shard_once_reached(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": "a" * n}) + "\n" for n in (3, 3, 10, 1, 1, 1)))
    out = tmp_path / "out"
    summary = build_shards([src], out, BuildConfig(tokens_per_shard=8, dtype="uint32"))
    # tokens per doc (eos included): 4 4 | 11 | 2 2 2
    assert [s.n_tokens for s in summary.shards] == [8, 11, 6]
    assert ShardReader(out / shard_name(0)).dtype == np.dtype(np.uint32)


def test_output_on_a_memory_filesystem() -> None:
    out = f"memory://build-{uuid.uuid4().hex}"
    local = Path(__file__)  # any text file will do
    summary = build_shards([local], out)
    assert summary.n_docs == 1
    assert read_all(out) == [doc(local.read_text())]
    fs = fsspec.filesystem("memory")
    assert json.loads(fs.cat_file(f"{out}/{MANIFEST_NAME}"))["n_docs"] == 1
    fs.rm(out.removeprefix("memory://"), recursive=True)


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def test_one_and_two_workers_write_byte_identical_shards(tmp_path: Path) -> None:
    jsonl = tmp_path / "lines.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"text": f"line {i} " * (i % 13)}) + "\n" for i in range(300))
    )
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        config = BuildConfig(
            glob="*.py",
            workers=workers,
            tokens_per_shard=20_000,
            chunk_tokens=4096,
            jsonl_piece_bytes=512,  # ~20 pieces: the pool finishes them out of order
        )
        summary = build_shards([STDLIB_JSON, jsonl], out, config)
        assert summary.n_shards >= 3 and summary.n_empty == 24  # i % 13 == 0
        outs.append(_tree_bytes(out))
    assert outs[0] == outs[1]
    files = sorted(STDLIB_JSON.glob("*.py"))
    docs = read_all(tmp_path / "out1")
    assert docs[: len(files)] == [[*f.read_bytes(), EOS] for f in files]


# ---------------------------------------------------------------- errors


def test_missing_inputs_and_empty_directories_are_named(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=re.escape(f"input '{tmp_path / 'nope'}' does not exist")):
        build_shards([tmp_path / "nope"], out)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("a")
    with pytest.raises(BuildError, match=r"holds no files matching '\*.py'"):
        build_shards([tmp_path / "src"], out, BuildConfig(glob="*.py"))
    with pytest.raises(BuildError, match="no inputs given"):
        build_shards([], out)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json}\n", "not a JSON record"),
        ('{"txt": "typo"}\n', "the record has no field 'text'"),
        ('["text"]\n', "the record has no field 'text'"),
        ('{"text": 5}\n', "field 'text' is int, expected a string"),
        (b'{"text": "\xff"}\n', "not a JSON record"),
    ],
)
def test_bad_jsonl_lines_name_the_file_and_byte_offset(
    tmp_path: Path, line: str | bytes, message: str
) -> None:
    src = tmp_path / "d.jsonl"
    good = b'{"text": "fine"}\n'
    src.write_bytes(good + (line.encode() if isinstance(line, str) else line))
    with pytest.raises(BuildError, match=re.escape(f"{src}, line at byte {len(good)}: {message}")):
        build_shards([src], tmp_path / "out")


def test_non_utf8_text_file_is_named(tmp_path: Path) -> None:
    src = tmp_path / "bin.txt"
    src.write_bytes(b"ok\x80\x81")
    with pytest.raises(BuildError, match=re.escape(f"{src}: not UTF-8 text") + ".* at byte 2"):
        build_shards([src], tmp_path / "out")


def test_only_empty_inputs_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(BuildError, match=r"no documents in the inputs \(1 files, 1 empty"):
        build_shards([tmp_path / "e.txt"], tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_existing_shards_are_refused_unless_overwrite(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"}\n')
    out = tmp_path / "out"
    build_shards([src], out, BuildConfig(docs_per_shard=1))
    assert len(list(out.glob("*.mss"))) == 3
    with pytest.raises(BuildError, match=r"already holds 4 shard or manifest files.*--overwrite"):
        build_shards([src], out)
    build_shards([src], out, BuildConfig(overwrite=True))
    # the old shard-00001/00002 are gone: a corpus of the directory is the new build only
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, shard_name(0)]
    assert read_all(out) == [doc("a"), doc("b"), doc("c")]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_build_leaves_no_shard_behind(tmp_path: Path, workers: int) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n' * 5)
    (tmp_path / "b.jsonl").write_text('{"text": "b"}\n{"text": "b"\n')
    out = tmp_path / "out"
    config = BuildConfig(docs_per_shard=1, workers=workers)
    with pytest.raises(BuildError, match=r"b\.jsonl, line at byte 14: not a JSON record"):
        build_shards([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], out, config)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"docs_per_shard": 2, "tokens_per_shard": 9}, "at most one of .* got both \\(2 and 9\\)"),
        ({"workers": 0}, "workers must be an int >= 1, got 0"),
        ({"docs_per_shard": True}, "docs_per_shard must be an int >= 1, got True"),
        ({"dtype": "int8"}, "dtype must be 'auto', 'uint16' or 'uint32', got 'int8'"),
        ({"chunk_tokens": 0}, "chunk_tokens must be an int >= 1, got 0"),
        ({"jsonl_field": ""}, "jsonl_field must name a field"),
    ],
)
def test_config_is_validated_on_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BuildConfig(**kwargs)
