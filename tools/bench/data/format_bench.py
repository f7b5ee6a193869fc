"""Compression ratio and decode speed of the ms-data shard format on the demo corpus.

    .venv/bin/python tools/bench/data/format_bench.py [--reps 5] [--out PATH]

Corpus: the Python standard library's ``.py`` files (the demo corpus), byte tokenizer
(UTF-8 bytes as uint16 ids, the end-of-document id after each file); files that are
not UTF-8 are left out, as ``ms-data build`` would refuse them. The same token stream
is written once per setting, zstd level 1, 3, 9 by chunk size 8k (the default), 16k,
64k, 256k tokens, to a local temporary file, then read back whole, in one process:

- ratio: uncompressed token bytes / shard file bytes (header, index, footer included),
  and shard bytes per byte of source text;
- decode MB/s: decompressed token bytes per second through ``ShardReader.read_tokens``
  (ranged read from the page cache, crc32, zstd with its own checksum, concatenation);
- zstd MB/s: zstd decompression alone of the same chunks, already in memory;
- floor: a bare memcpy (numpy copy) of the same number of bytes, the speed no decoder
  that must produce those bytes in memory can beat.

Each repetition measures every setting once, in an order that rotates; reported are
the median and the spread (min-max). Write MB/s is one measurement (the shard write).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

import ms_data
from ms_data.shard import ShardReader, ShardWriter
from ms_data.tokenizer import ByteTokenizer
from ms_testing.bench import machine_info

LEVELS = (1, 3, 9)
CHUNKS = (8 * 1024, 16 * 1024, 64 * 1024, 256 * 1024)


def demo_corpus(max_files: int | None) -> tuple[list[np.ndarray], int, int]:
    """Token documents of the standard library's .py files; (docs, files skipped, text bytes)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f
        for f in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)
    )
    if max_files is not None:
        files = files[:max_files]
    eos = np.array([ByteTokenizer.eos_id], np.uint16)
    docs, skipped, text_bytes = [], 0, 0
    for f in files:
        data = f.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped += 1
            continue
        docs.append(np.concatenate([np.frombuffer(data, np.uint8).astype(np.uint16), eos]))
        text_bytes += len(data)
    return docs, skipped, text_bytes


def write(path: Path, docs: list[np.ndarray], level: int, chunk: int) -> float:
    t0 = time.perf_counter()
    with ShardWriter(path, "uint16", chunk_tokens=chunk, level=level) as w:
        for d in docs:
            w.add_document(d)
    return time.perf_counter() - t0


def time_reader(reader: ShardReader) -> float:
    # The reader keeps its last chunk decoded; a whole read starts at chunk 0 and
    # leaves the last one cached, so each call decodes every chunk (n_chunks > 1).
    t0 = time.perf_counter()
    reader.read_tokens(0, reader.n_tokens)
    return time.perf_counter() - t0


def time_zstd(frames: list[bytes]) -> float:
    dctx = zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    for frame in frames:
        dctx.decompress(frame)
    return time.perf_counter() - t0


def time_memcpy(src: np.ndarray, dst: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def spread(times: list[float], nbytes: int) -> dict[str, float]:
    """MB/s (1e6 bytes) at the median, fastest and slowest time."""
    return {
        "median": nbytes / statistics.median(times) / 1e6,
        "max": nbytes / min(times) / 1e6,
        "min": nbytes / max(times) / 1e6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench-results/data/format_bench.json"))
    ap.add_argument(
        "--smoke", action="store_true", help="20 files, 1 repetition, no JSON: checks the script"
    )
    args = ap.parse_args()
    reps = 1 if args.smoke else args.reps

    docs, skipped, text_bytes = demo_corpus(20 if args.smoke else None)
    n_tokens = sum(d.size for d in docs)
    raw = 2 * n_tokens
    load_before = os.getloadavg()
    if args.smoke:
        print("smoke: not a measurement")
    print(
        f"demo corpus: {len(docs)} .py files of the standard library ({skipped} not UTF-8, "
        f"left out), {text_bytes / 1e6:.1f} MB of text, {n_tokens:,} byte tokens "
        f"({raw / 1e6:.1f} MB as uint16)"
    )
    print(f"load average before: {load_before[0]:.2f} (1 min), {os.cpu_count()} cores")

    settings = [(level, chunk) for level in LEVELS for chunk in CHUNKS]
    with tempfile.TemporaryDirectory(prefix="format_bench-") as tmp:
        readers: dict[tuple[int, int], ShardReader] = {}
        frames: dict[tuple[int, int], list[bytes]] = {}
        write_s: dict[tuple[int, int], float] = {}
        for level, chunk in settings:
            path = Path(tmp) / f"l{level}-c{chunk}.mss"
            write_s[level, chunk] = write(path, docs, level, chunk)
            r = readers[level, chunk] = ShardReader(path)
            blob = path.read_bytes()
            frames[level, chunk] = [blob[int(o) : int(o) + int(n)] for o, n, _ in r.chunk_table]
            time_reader(r)  # warm: page cache, allocator
            print(
                f"  wrote level {level:>2} chunk {chunk // 1024:>3}k "
                f"in {write_s[level, chunk]:.2f} s"
            )

        src = np.ones(raw, np.uint8)
        dst = np.empty_like(src)
        time_memcpy(src, dst)  # fault the destination in
        decode: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
        zstd: dict[tuple[int, int], list[float]] = {s: [] for s in settings}
        memcpy: list[float] = []
        for rep in range(reps):
            order = settings[rep % len(settings) :] + settings[: rep % len(settings)]
            for s in order:
                decode[s].append(time_reader(readers[s]))
                zstd[s].append(time_zstd(frames[s]))
            memcpy.append(time_memcpy(src, dst))
        sizes = {s: readers[s].nbytes for s in settings}
    load_after = os.getloadavg()

    floor = spread(memcpy, raw)
    print(
        f"\nmemcpy floor: {floor['median']:,.0f} MB/s ({floor['min']:,.0f}-{floor['max']:,.0f}); "
        f"load average after: {load_after[0]:.2f}"
    )
    header = (
        f"{'level':>5} {'chunk':>6} {'ratio':>6} {'B/text B':>9} {'write MB/s':>11} "
        f"{'decode MB/s':>12} {'min-max':>13} {'zstd MB/s':>10} {'memcpy/decode':>14}"
    )
    print(header)
    print("-" * len(header))
    rows: list[dict[str, Any]] = []
    for s in settings:
        level, chunk = s
        d, z = spread(decode[s], raw), spread(zstd[s], raw)
        row = {
            "level": level,
            "chunk_tokens": chunk,
            "file_bytes": sizes[s],
            "ratio_token_bytes": raw / sizes[s],
            "file_bytes_per_text_byte": sizes[s] / text_bytes,
            "write_mb_s": raw / write_s[s] / 1e6,
            "decode_mb_s": d,
            "zstd_mb_s": z,
            "memcpy_over_decode": d["median"] and floor["median"] / d["median"],
            "decode_times_s": decode[s],
            "zstd_times_s": zstd[s],
        }
        rows.append(row)
        span = f"{d['min']:,.0f}-{d['max']:,.0f}"
        print(
            f"{level:>5} {chunk // 1024:>5}k {row['ratio_token_bytes']:>6.2f} "
            f"{row['file_bytes_per_text_byte']:>9.3f} {row['write_mb_s']:>11.0f} "
            f"{d['median']:>12,.0f} {span:>13} {z['median']:>10,.0f} "
            f"{row['memcpy_over_decode']:>14.1f}"
        )
    print("(MB = 1e6 bytes of uint16 tokens, decompressed; ratio = token bytes / file bytes)")

    if args.smoke:
        return
    record = {
        "benchmark": "format_bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(
            ms_data=ms_data.__version__,
            zstandard=zstandard.__version__,
            zstd=".".join(map(str, zstandard.ZSTD_VERSION)),
            numpy=np.__version__,
        ),
        "corpus": {
            "what": "Python standard library .py files, byte tokenizer, uint16",
            "files": len(docs),
            "files_not_utf8": skipped,
            "text_bytes": text_bytes,
            "tokens": n_tokens,
            "token_bytes": raw,
        },
        "parameters": {"reps": reps, "levels": LEVELS, "chunk_tokens": CHUNKS},
        "load_average_1_5_15_min": {"before": load_before, "after": load_after},
        "memcpy_mb_s": floor,
        "memcpy_times_s": memcpy,
        "settings": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
