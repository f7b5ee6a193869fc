"""The ``ms-data`` command: ``build`` shards from text, ``inspect`` and verify shards.

Exit codes: 0 success; 1 ``inspect`` found damaged shards (each one listed); 2 bad
arguments or inputs, reported as one message rather than a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import numpy as np

from ms_data._corpus import expand_shard_urls
from ms_data.build import DEFAULT_TOKENS_PER_SHARD, BuildConfig, BuildSummary, build_shards
from ms_data.shard import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_LEVEL,
    ChunkCorruptError,
    ShardError,
    ShardReader,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ms-data", description="Build and inspect ms-data token shards."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = sub.add_parser(
        "build",
        help="tokenize text files, directories or JSONL into shards",
        description="Tokenize inputs into shard-NNNNN.mss files and a manifest.json. "
        "Inputs: text files (one document each), directories (walked recursively, sorted), "
        "JSONL files (*.jsonl, *.ndjson: one document per line).",
    )
    b.add_argument("inputs", nargs="+", metavar="INPUT", help="text file, directory or JSONL")
    b.add_argument("--out", required=True, metavar="DIR", help="output directory or fsspec URL")
    b.add_argument(
        "--tokenizer", default="bytes", help="'bytes' (default) or a tokenizer.json path"
    )
    b.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"))
    limit = b.add_mutually_exclusive_group()
    limit.add_argument("--docs-per-shard", type=int, metavar="N")
    limit.add_argument(
        "--tokens-per-shard",
        type=int,
        metavar="N",
        help=f"default {DEFAULT_TOKENS_PER_SHARD} when neither limit is given",
    )
    b.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizing processes")
    b.add_argument("--glob", metavar="PATTERN", help="file names to take from directories")
    b.add_argument("--jsonl-field", default="text", metavar="NAME", help="default 'text'")
    b.add_argument(
        "--eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the end-of-document token to every document (default: on)",
    )
    b.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, metavar="N")
    b.add_argument("--level", type=int, default=DEFAULT_LEVEL, help="zstd level")
    b.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    b.set_defaults(func=_build)

    i = sub.add_parser(
        "inspect",
        help="print header and stats of shards and verify every chunk",
        description="Exit code 1 if any shard or chunk is damaged.",
    )
    i.add_argument("paths", nargs="+", metavar="PATH", help="shard, directory or glob")
    i.set_defaults(func=_inspect)
    return parser


def _build(args: argparse.Namespace) -> int:
    config = BuildConfig(
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        docs_per_shard=args.docs_per_shard,
        tokens_per_shard=args.tokens_per_shard,
        workers=args.workers,
        glob=args.glob,
        jsonl_field=args.jsonl_field,
        eos=args.eos,
        chunk_tokens=args.chunk_tokens,
        level=args.level,
        overwrite=args.overwrite,
    )
    summary = build_shards(args.inputs, args.out, config, progress=False if args.quiet else None)
    _print_summary(summary)
    return 0


def _print_summary(s: BuildSummary) -> None:
    print(f"built {s.n_shards} shard(s) in {s.out} in {s.seconds:.1f} s")
    rows = [
        ("inputs", f"{s.n_inputs:,} files, {s.input_nbytes:,} bytes"),
        ("documents", f"{s.n_docs:,}"),
        ("tokens", f"{s.n_tokens:,} ({s.dtype}, tokenizer {s.tokenizer})"),
        ("shards", f"{s.n_shards:,}"),
        ("bytes", f"{s.nbytes:,}"),
        ("compression", f"{s.compression_ratio:.2f}x (token bytes / shard bytes)"),
        ("empty inputs", f"{s.n_empty:,} skipped"),
    ]
    for name, value in rows:
        print(f"  {name:<13} {value}")


def _inspect(args: argparse.Namespace) -> int:
    urls = [u for spec in args.paths for u in expand_shard_urls(spec, None)]
    damaged: list[str] = []
    totals = np.zeros(3, np.int64)  # documents, tokens, bytes
    for url in urls:
        print(url)
        try:
            reader = ShardReader(url)
            errors = _describe(reader)
        except ShardError as e:  # the file as a whole: truncated, not a shard, bad index
            print(f"  DAMAGED     {e.reason} (at byte offset {e.offset})")
            damaged.append(str(e))
            continue
        totals += (reader.n_docs, reader.n_tokens, reader.nbytes)
        damaged += [str(e) for e in errors]
    if len(urls) > 1:
        print(
            f"total: {len(urls)} shards, {totals[0]:,} documents, {totals[1]:,} tokens, "
            f"{totals[2]:,} bytes"
        )
    if damaged:
        print(f"DAMAGED: {len(damaged)} problem(s):")
        for line in damaged:
            print(f"  {line}")
        return 1
    return 0


def _describe(r: ShardReader) -> list[ChunkCorruptError]:
    lengths = r.doc_lengths()
    raw = r.n_tokens * r.dtype.itemsize
    print(
        f"  format      version {r.version}, {r.dtype.name} tokens, {r.chunk_tokens:,} tokens "
        f"per chunk, {r.n_chunks:,} chunks"
    )
    if r.n_docs:
        print(
            f"  documents   {r.n_docs:,} (mean {lengths.mean():,.1f} tokens, max "
            f"{int(lengths.max()):,}, {int((lengths == 0).sum()):,} empty)"
        )
    else:
        print("  documents   0")
    print(f"  tokens      {r.n_tokens:,}")
    print(
        f"  bytes       {r.nbytes:,} (compression {raw / r.nbytes:.2f}x: token bytes / file bytes)"
    )
    errors = r.verify()
    if errors:
        print(f"  chunks      {len(errors)} of {r.n_chunks} DAMAGED:")
        for e in errors:
            print(f"    chunk {e.chunk} at byte offset {e.offset}: {e.reason}")
    else:
        print(f"  chunks      all {r.n_chunks:,} verified")
    return errors


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, OSError, ImportError) as e:
        # ValueError covers BuildError and bad options, OSError missing files.
        print(f"ms-data {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ms-data {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
