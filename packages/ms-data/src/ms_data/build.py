"""Turn text files, directories and JSONL into shards (``ms-data build``).

Inputs are cut into tasks (a text file, or a piece of a JSONL file that starts and
ends at line boundaries) which a process pool tokenizes; the main process takes the
results in task order and writes the shards. The output is therefore the same bytes
whatever the number of workers: document order is the input order (files in the
order given, directories walked in sorted order, JSONL lines in file order).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import fsspec
import numpy as np
from fsspec.implementations.local import LocalFileSystem

from ms_data import _format as fmt
from ms_data._progress import Progress
from ms_data._tokenize import BuildError, input_files, make_tasks, results
from ms_data._version import __version__
from ms_data.shard import DEFAULT_CHUNK_TOKENS, DEFAULT_LEVEL, ShardInfo, ShardWriter
from ms_data.tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "DEFAULT_TOKENS_PER_SHARD",
    "MANIFEST_NAME",
    "BuildConfig",
    "BuildError",
    "BuildSummary",
    "build_shards",
    "shard_name",
]

#: 128 Mi tokens (256 MiB of uint16 before compression): few enough files for a
#: large corpus, small enough to buffer for a single put on an object store.
DEFAULT_TOKENS_PER_SHARD = 1 << 27
MANIFEST_NAME = "manifest.json"
# BuildError lives in _tokenize, where the workers raise it; its public home is here.
BuildError.__module__ = __name__
# Five digits keep names sorting in shard order; more shards than this means
# tokens_per_shard is far too small.
_MAX_SHARDS = 100_000


def shard_name(i: int) -> str:
    """File name of output shard ``i``: ``shard-00000.mss`` and so on."""
    return f"shard-{i:05d}.mss"


def _positive(name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class BuildConfig:
    """How ``build_shards`` tokenizes and cuts; validated on construction."""

    #: "bytes", or the path of a Hugging Face tokenizer.json.
    tokenizer: str = "bytes"
    #: "auto" (uint16 when the vocabulary fits, else uint32), "uint16" or "uint32".
    dtype: str = "auto"
    #: Start a new shard after this many documents; at most one of the two limits.
    docs_per_shard: int | None = None
    #: Start a new shard once it holds this many tokens (documents are never split, so
    #: a shard can exceed it by one document). Default when neither limit is set:
    #: ``DEFAULT_TOKENS_PER_SHARD``.
    tokens_per_shard: int | None = None
    #: Tokenizing processes; 1 tokenizes in this process. The output does not depend on it.
    workers: int = 1
    #: File-name pattern (fnmatch, e.g. "*.py") for files found in input directories.
    glob: str | None = None
    #: The text field of each JSONL record.
    jsonl_field: str = "text"
    #: Append the tokenizer's end-of-document id to every document.
    eos: bool = True
    #: Tokens per zstd chunk in the shards.
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    #: zstd level.
    level: int = DEFAULT_LEVEL
    #: Replace shards and manifest already in the output directory instead of refusing.
    overwrite: bool = False
    #: A JSONL file is split into tasks of about this many bytes, at line boundaries,
    #: so that one large file still keeps every worker busy.
    jsonl_piece_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if self.docs_per_shard is not None and self.tokens_per_shard is not None:
            raise ValueError(
                f"set at most one of docs_per_shard and tokens_per_shard, got both "
                f"({self.docs_per_shard} and {self.tokens_per_shard})"
            )
        _positive("docs_per_shard", self.docs_per_shard, optional=True)
        _positive("tokens_per_shard", self.tokens_per_shard, optional=True)
        _positive("workers", self.workers)
        _positive("chunk_tokens", self.chunk_tokens)
        _positive("jsonl_piece_bytes", self.jsonl_piece_bytes)
        if self.dtype not in ("auto", "uint16", "uint32"):
            raise ValueError(f"dtype must be 'auto', 'uint16' or 'uint32', got {self.dtype!r}")
        if not self.jsonl_field:
            raise ValueError("jsonl_field must name a field, got an empty string")


@dataclass(frozen=True)
class BuildSummary:
    """What a build wrote, for the CLI's summary and for callers."""

    out: str
    tokenizer: str
    dtype: str
    #: Input files read (text and JSONL).
    n_inputs: int
    #: Bytes of input read.
    input_nbytes: int
    #: Documents skipped because they had no tokens (empty files, empty JSONL texts,
    #: blank JSONL lines).
    n_empty: int
    n_docs: int
    n_tokens: int
    seconds: float
    shards: tuple[ShardInfo, ...] = field(default_factory=tuple)

    @property
    def n_shards(self) -> int:
        return len(self.shards)

    @property
    def nbytes(self) -> int:
        """Bytes of all shard files."""
        return sum(s.nbytes for s in self.shards)

    @property
    def raw_nbytes(self) -> int:
        """Bytes of all tokens uncompressed."""
        return sum(s.raw_nbytes for s in self.shards)

    @property
    def compression_ratio(self) -> float:
        """Uncompressed token bytes per shard byte."""
        return self.raw_nbytes / self.nbytes if self.nbytes else 0.0


def _prepare_out(fs: Any, path: str, overwrite: bool) -> None:
    fs.makedirs(path, exist_ok=True)
    old = [
        p
        for p in fs.ls(path, detail=False)
        if p.endswith(".mss") or p.rsplit("/", 1)[-1] == MANIFEST_NAME
    ]
    if old and not overwrite:
        raise BuildError(
            f"output directory {path!r} already holds {len(old)} shard or manifest files; "
            f"pass --overwrite (overwrite=True) to replace them"
        )
    for p in old:
        fs.rm_file(p)


def _put(fs: Any, path: str, data: bytes) -> None:
    """Store a small file whole: rename into place locally, one put elsewhere."""
    if isinstance(fs, LocalFileSystem):
        tmp = f"{path}.tmp-{os.getpid()}"
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    else:
        fs.pipe_file(path, data)


def build_shards(
    inputs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    config: BuildConfig | None = None,
    *,
    progress: bool | None = None,
    progress_stream: TextIO | None = None,
) -> BuildSummary:
    """Tokenize ``inputs`` into shards ``shard-00000.mss ...`` and ``manifest.json`` in ``out``.

    ``out`` is a local directory or an fsspec URL. ``progress``: draw a bar on
    ``progress_stream`` (default stderr); None draws it only when that is a terminal.
    On an error no shard of this build is left behind.
    """
    config = BuildConfig() if config is None else config
    t0 = time.perf_counter()
    tok = get_tokenizer(config.tokenizer)
    dtype = config.dtype
    if dtype == "auto":
        dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    if tok.vocab_size > int(np.iinfo(dtype).max) + 1:
        raise BuildError(
            f"dtype {dtype} cannot hold the ids of tokenizer {tok.name} "
            f"(vocab_size {tok.vocab_size}); use dtype uint32 or auto"
        )
    if config.eos and tok.eos_id is None:
        raise BuildError(f"tokenizer {tok.name} has no end-of-document token; build with --no-eos")
    files = input_files(inputs, config.glob)
    tasks = make_tasks(
        files,
        tokenizer=config.tokenizer,
        dtype=dtype,
        field=config.jsonl_field,
        eos=config.eos,
        piece_bytes=config.jsonl_piece_bytes,
    )
    out_url = os.fspath(out)
    fs, out_path = fsspec.core.url_to_fs(out_url)
    _prepare_out(fs, out_path, config.overwrite)

    doc_limit = config.docs_per_shard
    token_limit = config.tokens_per_shard
    if doc_limit is None and token_limit is None:
        token_limit = DEFAULT_TOKENS_PER_SHARD
    bar = Progress(sum(f.stat().st_size for f in files), stream=progress_stream, enabled=progress)
    shards: list[ShardInfo] = []
    writer: ShardWriter | None = None
    n_empty = input_nbytes = 0
    try:
        for result in results(tasks, config.workers):
            n_empty += result.n_empty
            input_nbytes += result.nbytes
            ends = np.cumsum(result.lengths)
            for end, length in zip(ends.tolist(), result.lengths.tolist(), strict=True):
                if writer is None:
                    if len(shards) >= _MAX_SHARDS:
                        raise BuildError(
                            f"more than {_MAX_SHARDS} shards; raise docs_per_shard or "
                            f"tokens_per_shard"
                        )
                    writer = ShardWriter(
                        f"{out_path.rstrip('/')}/{shard_name(len(shards))}",
                        dtype,
                        chunk_tokens=config.chunk_tokens,
                        level=config.level,
                        fs=fs,
                    )
                writer.add_document(result.tokens[end - length : end])
                if (doc_limit is not None and writer.n_docs >= doc_limit) or (
                    token_limit is not None and writer.n_tokens >= token_limit
                ):
                    shards.append(writer.close())
                    writer = None
            bar.update(result.nbytes, docs=len(result.lengths), tokens=int(result.tokens.size))
        if writer is not None:
            shards.append(writer.close())
            writer = None
        bar.close()
        if not shards:
            raise BuildError(
                f"no documents in the inputs ({len(files)} files, {n_empty} empty inputs skipped)"
            )
        summary = BuildSummary(
            out=out_url,
            tokenizer=tok.name,
            dtype=dtype,
            n_inputs=len(files),
            input_nbytes=input_nbytes,
            n_empty=n_empty,
            n_docs=sum(s.n_docs for s in shards),
            n_tokens=sum(s.n_tokens for s in shards),
            seconds=time.perf_counter() - t0,
            shards=tuple(shards),
        )
        _put(fs, f"{out_path.rstrip('/')}/{MANIFEST_NAME}", _manifest(summary, tok, config))
    except BaseException:
        if writer is not None:
            writer.abort()
        for info in shards:  # a half-built directory must not pass for a corpus
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(info.path)
        raise
    return summary


def _manifest(summary: BuildSummary, tok: Tokenizer, config: BuildConfig) -> bytes:
    """The manifest: deterministic (no dates, no paths of inputs) so that rebuilds compare."""
    record = {
        "format": "ms-data shards",
        "format_version": fmt.VERSION,
        "ms_data_version": __version__,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id if config.eos else None,
        "dtype": summary.dtype,
        "chunk_tokens": config.chunk_tokens,
        "level": config.level,
        "n_docs": summary.n_docs,
        "n_tokens": summary.n_tokens,
        "n_empty_skipped": summary.n_empty,
        "shards": [
            {
                "name": shard_name(i),
                "n_docs": s.n_docs,
                "n_tokens": s.n_tokens,
                "nbytes": s.nbytes,
            }
            for i, s in enumerate(summary.shards)
        ],
    }
    return (json.dumps(record, indent=1) + "\n").encode()
