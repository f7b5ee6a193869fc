"""CPU that the NodeLoader's reader spends per shuffled micro-batch, by shard chunk size.

    .venv/bin/python tools/bench/data/reader_cost.py [--reps 5] [--steps 400] [--out PATH]

The reader process runs on the cores the training step uses (on the 2-core dev machine
it takes them from torch's threads), so its CPU time per micro-batch is the node
loader's cost to a CPU step; wall time would mostly measure the machine's load. Setup:
ms-train's tiny preset shapes (seq_len 128, micro-batch 8, one local rank, depth 4),
the demo corpus (the standard library's .py files as byte tokens) written twice, the
same documents, with 64k-token chunks (the default before ms-data 0.2.0) and 8k (the
default since), shuffled stream. Two measurements, each side by side:

- **reader CPU per micro-batch**: a NodeLoader is drained as fast as it delivers;
  the reader's user + system CPU seconds (``/proc/<pid>/stat``) from its first batch
  to its last (start-up excluded) over the batches delivered between them.
- **sample() in-process**: microseconds per ``PackedDataset.sample(g)``, the reader's
  work without the ring.

The cases alternate within each repetition (the order rotates); reported are the
median, the spread (min-max) and the ratio 64k / 8k. Floor: a copy of a sample's
bytes out of memory (numpy), which no reader that produces the sample can beat.
Prints a table and writes JSON.
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
import uuid
from pathlib import Path
from typing import Any

import numpy as np

import ms_data
from ms_data import Corpus, NodeLoader, PackedDataset, ShardWriter
from ms_data.tokenizer import ByteTokenizer
from ms_testing.bench import cpu_seconds, machine_info

SEQ_LEN = 128
MICRO = 8
DEPTH = 4
CHUNKS = (65536, 8192)
EOS = ByteTokenizer.eos_id


def build(out: Path, chunk_tokens: int) -> int:
    """The stdlib .py files as byte tokens in one shard; its size in bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts)
    out.mkdir(parents=True)
    path = out / "shard-00000.mss"
    with ShardWriter(str(path), "uint16", chunk_tokens=chunk_tokens) as w:
        for f in files:
            data = f.read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if data:
                w.add_document(np.frombuffer(data, np.uint8).astype(np.uint16))
    return path.stat().st_size


def dataset(corpus: Path) -> PackedDataset:
    return PackedDataset(Corpus(str(corpus)), SEQ_LEN, seed=0, eos_id=EOS, shuffle=True)


def reader_cpu(corpus: Path, steps: int) -> float:
    """Reader CPU seconds per micro-batch, start-up excluded."""
    job = f"cost{uuid.uuid4().hex[:8]}"
    with NodeLoader(
        dataset(corpus),
        micro_batch=MICRO,
        local_rank=0,
        local_world_size=1,
        job_id=job,
        depth=DEPTH,
    ) as loader:
        next(loader)
        pid = loader.reader_pid or 0
        before = cpu_seconds(pid)
        for _ in range(steps):
            next(loader)
        # The reader may be up to DEPTH steps ahead of the last batch taken.
        return (cpu_seconds(pid) - before) / steps


def sample_us(corpus: Path, samples: int) -> float:
    ds = dataset(corpus)
    ds.sample(0)  # the epoch's layout, built once
    t0 = time.perf_counter()
    for g in range(1, samples + 1):
        ds.sample(g)
    return (time.perf_counter() - t0) / samples * 1e6


def copy_floor_us(reps: int = 2000) -> float:
    src = np.arange(SEQ_LEN + 1, dtype=np.uint16)
    dst = np.empty(SEQ_LEN + 1, dtype=np.int64)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst[...] = src
    return (time.perf_counter() - t0) / reps * 1e6


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=400, help="micro-batches per reader run")
    ap.add_argument("--out", type=Path, default=Path("bench-results/data/reader_cost.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ms-bench-reader-") as tmp:
        corpora = {c: Path(tmp) / f"c{c}" for c in CHUNKS}
        sizes = {c: build(corpora[c], c) for c in CHUNKS}
        for c in CHUNKS:  # page cache, layouts, imports
            sample_us(corpora[c], 50)
        cpu: dict[int, list[float]] = {c: [] for c in CHUNKS}
        per_sample: dict[int, list[float]] = {c: [] for c in CHUNKS}
        for rep in range(args.reps):
            order = CHUNKS if rep % 2 == 0 else CHUNKS[::-1]
            for c in order:
                cpu[c].append(reader_cpu(corpora[c], args.steps))
                per_sample[c].append(sample_us(corpora[c], args.steps * MICRO))
    floor = copy_floor_us()
    load_after = os.getloadavg()

    print(
        f"reader cost, shuffled, seq_len {SEQ_LEN}, micro-batch {MICRO}, {args.steps} "
        f"micro-batches x {args.reps} reps; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after, {os.cpu_count()} cores"
    )
    print("| chunk tokens | shard MB | reader CPU ms / micro-batch | sample() us |")
    print("|---:|---:|---:|---:|")
    for c in CHUNKS:
        a, b = spread(cpu[c]), spread(per_sample[c])
        print(
            f"| {c:,} | {sizes[c] / 1e6:.2f} | {a['median'] * 1e3:.3f} "
            f"({a['min'] * 1e3:.3f}-{a['max'] * 1e3:.3f}) | {b['median']:.1f} "
            f"({b['min']:.1f}-{b['max']:.1f}) |"
        )
    big, small = CHUNKS
    ratio_cpu = statistics.median(cpu[big]) / statistics.median(cpu[small])
    ratio_sample = statistics.median(per_sample[big]) / statistics.median(per_sample[small])
    print(
        f"64k / 8k: reader CPU {ratio_cpu:.2f}x, sample() {ratio_sample:.2f}x; shard size "
        f"8k / 64k {sizes[small] / sizes[big]:.2f}x; floor (copying a sample's tokens) "
        f"{floor:.2f} us"
    )
    record: dict[str, Any] = {
        "benchmark": "reader_cost",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(ms_data=ms_data.__version__),
        "parameters": {
            "seq_len": SEQ_LEN,
            "micro_batch": MICRO,
            "depth": DEPTH,
            "steps": args.steps,
            "reps": args.reps,
            "chunk_tokens": CHUNKS,
        },
        "load_average_1_5_15_min": {"before": load_before, "after": load_after},
        "shard_bytes": sizes,
        "reader_cpu_s_per_micro_batch": cpu,
        "sample_us": per_sample,
        "ratio_reader_cpu_64k_over_8k": ratio_cpu,
        "ratio_sample_64k_over_8k": ratio_sample,
        "copy_floor_us": floor,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
