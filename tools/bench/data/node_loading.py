"""Tree-based node loading (NodeLoader) vs one loader per rank, 4 local ranks, on CPU.

    .venv/bin/python tools/bench/data/node_loading.py [--reps 3] [--reader-threads 1] [--out PATH]

Corpus: the .py files of Python's standard library, one document each, UTF-8 bytes
(ms_data.tokenizer.ByteTokenizer) written as uint16 shards by ShardWriter (its default
chunk size, 8K tokens since ms-data 0.2.0). Samples: PackedDataset, seq_len 2048, eos
appended, shuffled (and, for bytes, unshuffled too). Every case runs 4 real rank
processes (ms_testing.run_ranks).

- **Bytes read per node** (ms_testing.fs.CountingFileSystem, every process appends to
  one counter): NodeLoader, one reader for the node, vs one PackedDataset iteration
  per rank, over the same steps. Target 1/4.
- **Throughput**: tokens per second delivered to the 4 ranks, which take batches as
  fast as they can, NodeLoader vs a plain ``torch.utils.data.DataLoader`` per rank
  over the same PackedDataset (batch_size = micro_batch), in-process (``num_workers=0``)
  and with one worker process (``num_workers=1``). Target 2x.
  Ceiling: one process calling ``dataset.sample`` (the reader's whole job) times the
  TP degree, since each sample it builds reaches ``tp_size`` ranks.
- **Data wait** in a simulated training loop: each step takes a batch, "computes" for
  a fixed time, either sleeping (a GPU step: the host CPU is free) or spinning (a
  CPU-bound step: 4 spinning ranks on this machine's 2 cores compete with the
  reader), then all-reduces a small tensor (the gradient sync that keeps the ranks of
  a job in step). Reported: time inside ``next()`` over wall time, median over ranks,
  copy-out included; for NodeLoader also its own metric (time before the batch was
  ready). Target < 1%. Floor: a trivial call right after a 10 ms sleep, the cost of
  waking an idle CPU on this machine, which any next() after a sleeping step pays.
- **Reader wake-ups on a full ring** (one local rank, in this process): the ring fills,
  then the rank takes a batch every 60 ms; reported are the reader process's voluntary
  context switches per second (Linux ``/proc/<pid>/status``) against the 1000/s that
  polling every millisecond would cost, and the rank's data wait over those batches
  (every batch should already be there: about 0).

Cases alternate within each repetition (NodeLoader first on even repetitions).
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
import torch
import torch.distributed as dist

import ms_data
from ms_data.dataset import PackedDataset
from ms_data.node_loader import NodeLoader
from ms_data.shard import Corpus, ShardWriter
from ms_data.tokenizer import ByteTokenizer
from ms_testing import run_ranks
from ms_testing.bench import machine_info
from ms_testing.fs import CountingFileSystem, read_counts

SEQ_LEN = 2048
MICRO = 4
RANKS = 4
DEPTH = 4
EOS = ByteTokenizer.eos_id
#: NodeLoader, and a plain DataLoader per rank with 0 (in-process) or 1 worker process.
METHODS = ["tree", "dataloader0", "dataloader1"]
LABELS = {"tree": "NodeLoader", "dataloader0": "DataLoader w=0", "dataloader1": "DataLoader w=1"}


def build_corpus(out: Path, n_shards: int = 4) -> dict[str, Any]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    tok = ByteTokenizer()
    per = -(-len(files) // n_shards)
    docs = tokens = 0
    for s in range(n_shards):
        with ShardWriter(str(out / f"shard-{s:03d}.mss"), "uint16") as w:
            for f in files[s * per : (s + 1) * per]:
                ids = tok.encode(f.read_text(errors="replace"))
                if ids:
                    w.add_document(np.asarray(ids, np.uint16))
                    docs += 1
                    tokens += len(ids)
    nbytes = sum(p.stat().st_size for p in out.glob("*.mss"))
    return {"files": len(files), "documents": docs, "tokens": tokens, "shard_bytes": nbytes}


def make_dataset(corpus: str, counter: str | None = None, **kw: Any) -> PackedDataset:
    fs = None if counter is None else CountingFileSystem(counter=counter)
    return PackedDataset(Corpus(corpus, fs=fs), SEQ_LEN, eos_id=EOS, **kw)


# -- rank functions (run in 4 processes) --------------------------------------------------


def rank_bytes(method: str, corpus: str, counter: str, tp: int, steps: int, shuffle: bool) -> int:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    dp = RANKS // tp
    if method == "tree":
        ds = make_dataset(corpus, counter, shuffle=shuffle)
        job = f"bench{uuid.uuid4().hex[:8]}" if rank == 0 else ""
        job = _broadcast(job)
        with NodeLoader(ds, micro_batch=MICRO, tp_size=tp, job_id=job, depth=DEPTH) as loader:
            for _ in range(steps):
                next(loader)
            dist.barrier()
            return loader.reader_pid or 0
    own = make_dataset(corpus, counter, shuffle=shuffle, dp_rank=rank // tp, dp_size=dp)
    it = iter(own)
    for _ in range(steps * MICRO):
        next(it)
    return 0


def rank_loop(
    method: str, corpus: str, tp: int, phases: list[tuple[str, int, float]], reader_threads: int
) -> Any:
    """Per phase (compute kind, steps, seconds of compute per step): the time inside
    every next(), the phase's start and end (CLOCK_MONOTONIC), and for NodeLoader its
    own data-wait seconds (time before the batch was ready, copy-out excluded)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    dp = RANKS // tp
    loader: Any
    if method == "tree":
        job = _broadcast(f"bench{uuid.uuid4().hex[:8]}" if rank == 0 else "")
        loader = NodeLoader(
            make_dataset(corpus),
            micro_batch=MICRO,
            tp_size=tp,
            job_id=job,
            depth=DEPTH,
            reader_threads=reader_threads,
        )
    else:
        ds = make_dataset(corpus, dp_rank=rank // tp, dp_size=dp)
        workers = int(method[-1])  # "dataloader0", "dataloader1"
        extra: dict[str, Any] = {"prefetch_factor": DEPTH} if workers else {}
        loader = torch.utils.data.DataLoader(ds, batch_size=MICRO, num_workers=workers, **extra)
    it = iter(loader)
    first = next(it)  # start-up (reader or worker process) is not measured
    if first.shape != (MICRO, SEQ_LEN + 1):
        raise RuntimeError(f"batch shape {tuple(first.shape)}")
    grad = torch.zeros(1024)
    out = []
    for kind, steps, compute in phases:
        dist.barrier()
        waits = []
        own_wait = loader.data_wait_s if method == "tree" else 0.0
        start = time.monotonic()
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = next(it)
            waits.append(time.perf_counter() - t0)
            if kind == "sleep":  # a GPU step: the host is idle
                time.sleep(compute)
            elif kind == "busy":  # a CPU step
                until = time.perf_counter() + compute
                while time.perf_counter() < until:
                    pass
            if kind != "none":
                # The step's gradient sync: ranks of a training job move in lockstep.
                grad[0] = float(batch[0, 0])
                dist.all_reduce(grad)
        out.append(
            {
                "start": start,
                "end": time.monotonic(),
                "waits": waits,
                "own_wait": (loader.data_wait_s - own_wait) if method == "tree" else None,
            }
        )
    dist.barrier()
    if method == "tree":
        loader.close()
    return out


def wakeup_floor(reps: int = 200, idle: float = 0.010) -> float:
    """Median seconds of a trivial numpy call right after sleeping ``idle`` seconds.

    On this (virtual) machine a CPU that idled runs its first microseconds slowly; any
    next() after a sleeping step pays this whatever the loader does.
    """
    x = np.zeros(16)
    times = []
    for _ in range(reps):
        time.sleep(idle)
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _voluntary_switches(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split()[1])
    raise RuntimeError(f"no voluntary_ctxt_switches in /proc/{pid}/status")


def paced_wakeups(corpus: str, batches: int = 25, pace: float = 0.060) -> dict[str, float]:
    """One local rank takes a batch every ``pace`` seconds from a full ring: the reader's
    wake-ups per second and the rank's data wait over those batches."""
    job = f"bench{uuid.uuid4().hex[:8]}"
    ds = make_dataset(corpus)
    with NodeLoader(
        ds, micro_batch=MICRO, local_rank=0, local_world_size=1, job_id=job, depth=DEPTH
    ) as loader:
        next(loader)
        time.sleep(0.3)  # the ring fills
        pid = loader.reader_pid or 0
        wait0 = loader.data_wait_s
        before, t0 = _voluntary_switches(pid), time.monotonic()
        for _ in range(batches):
            time.sleep(pace)
            next(loader)
        rate = (_voluntary_switches(pid) - before) / (time.monotonic() - t0)
        return {"wakeups_per_s": rate, "data_wait_s": loader.data_wait_s - wait0}


def _broadcast(text: str) -> str:
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


# -- measurements -----------------------------------------------------------------------


def producer_ceiling(corpus: str, samples: int = 400) -> float:
    """Samples per second of one process calling dataset.sample (shuffled stream)."""
    ds = make_dataset(corpus)
    ds.sample(0)
    t0 = time.perf_counter()
    for g in range(1, samples + 1):
        ds.sample(g)
    return samples / (time.perf_counter() - t0)


def index_bytes(corpus: str, tmp: Path) -> int:
    """Bytes one process reads to open the corpus (footers and indexes)."""
    counter = tmp / "reads-index"
    make_dataset(corpus, str(counter))
    return read_counts(counter).total


def measure_bytes(corpus: str, tmp: Path, tp: int, steps: int, shuffle: bool) -> dict[str, int]:
    result = {}
    for method in ("tree", "per_rank"):
        counter = tmp / f"reads-{method}-{tp}-{shuffle}-{uuid.uuid4().hex[:6]}"
        run_ranks(
            rank_bytes, RANKS, args=(method, corpus, str(counter), tp, steps, shuffle), timeout=600
        )
        result[method] = read_counts(counter).total
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400, help="steps per throughput phase")
    ap.add_argument(
        "--reader-threads", type=int, default=1, help="NodeLoader reader_threads (throughput)"
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results/data/node_loading.json"))
    ap.add_argument(
        "--paced-only",
        action="store_true",
        help="only the reader wake-ups on a full ring (seconds instead of minutes; no JSON)",
    )
    args = ap.parse_args()

    load_before = os.getloadavg()
    if args.paced_only:
        with tempfile.TemporaryDirectory(prefix="ms-bench-data-") as tmpdir:
            corpus_dir = Path(tmpdir) / "corpus"
            corpus_dir.mkdir()
            build_corpus(corpus_dir)
            paced = [paced_wakeups(str(corpus_dir)) for _ in range(args.reps)]
        print_paced(paced, args.reps, load_before, os.getloadavg())
        return
    with tempfile.TemporaryDirectory(prefix="ms-bench-data-") as tmpdir:
        tmp = Path(tmpdir)
        corpus_dir = tmp / "corpus"
        corpus_dir.mkdir()
        t0 = time.perf_counter()
        corpus_info = build_corpus(corpus_dir)
        corpus = str(corpus_dir)
        print(
            f"corpus: {corpus_info['documents']} stdlib files, {corpus_info['tokens'] / 1e6:.1f}M "
            f"byte tokens, {corpus_info['shard_bytes'] / 1e6:.1f} MB of shards "
            f"(built in {time.perf_counter() - t0:.1f}s); seq_len {SEQ_LEN}, micro_batch "
            f"{MICRO}, {RANKS} local ranks, depth {DEPTH}, reader_threads "
            f"{args.reader_threads}; load average {load_before[0]:.2f}, "
            f"{os.cpu_count()} cores"
        )
        ceiling = producer_ceiling(corpus)

        # 1. Bytes read per node. Every rank opens the corpus (reads its index), and so
        # does the NodeLoader's reader: 5 index reads vs 4.
        index = index_bytes(corpus, tmp)
        bytes_rows = []
        for tp, shuffle in ((2, True), (2, False), (4, True), (1, True)):
            b = measure_bytes(corpus, tmp, tp, steps=100, shuffle=shuffle)
            payload = {
                "tree_payload": b["tree"] - 5 * index,
                "per_rank_payload": b["per_rank"] - 4 * index,
            }
            bytes_rows.append(
                {
                    "tp": tp,
                    "dp_local": RANKS // tp,
                    "shuffle": shuffle,
                    "index": index,
                    **b,
                    **payload,
                }
            )

        # 2 and 3. Throughput and data wait, NodeLoader and DataLoader alternating.
        phases = [
            ("none", args.steps, 0.0),
            ("sleep", 150, 0.010),
            ("busy", 150, 0.005),
        ]
        loops: dict[str, dict[str, list[Any]]] = {}
        for tp in (2, 4):
            runs: dict[str, list[Any]] = {m: [] for m in METHODS}
            for rep in range(args.reps):
                order = METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]
                for method in order:
                    runs[method].append(
                        run_ranks(
                            rank_loop,
                            RANKS,
                            args=(method, corpus, tp, phases, args.reader_threads),
                            timeout=600,
                        )
                    )
            loops[f"tp{tp}"] = runs
        paced = [paced_wakeups(corpus) for _ in range(args.reps)]
        load_after = os.getloadavg()
        floor = wakeup_floor()

    record = report(corpus_info, ceiling, floor, bytes_rows, loops, phases, args)
    print_paced(paced, args.reps, load_before, load_after)
    record["paced_full_ring"] = {"pace_s": 0.060, "batches": 25, "runs": paced}
    record["load_average_1_5_15_min"] = {"before": load_before, "after": load_after}
    record["machine"] = machine_info(ms_data=ms_data.__version__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


def print_paced(
    paced: list[dict[str, float]],
    reps: int,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
) -> None:
    rates = [p["wakeups_per_s"] for p in paced]
    waits = [p["data_wait_s"] for p in paced]
    print(
        f"\nreader on a full ring, one rank taking a batch every 60 ms, {reps} reps: "
        f"{_cell(rates, '.0f', 1.0)} wake-ups/s (polling every 1 ms: 1000/s); data wait "
        f"over 25 batches {_cell(waits, '.2f', 1e3)} ms; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )


def summarize(run: list[Any], phase: int) -> dict[str, float]:
    """One run of 4 ranks, one phase: tokens/s delivered and median wait fractions."""
    starts = [rank[phase]["start"] for rank in run]
    ends = [rank[phase]["end"] for rank in run]
    steps = len(run[0][phase]["waits"])
    tokens = RANKS * steps * MICRO * (SEQ_LEN + 1)
    walls = [r[phase]["end"] - r[phase]["start"] for r in run]
    fractions = [sum(r[phase]["waits"]) / w for r, w in zip(run, walls, strict=True)]
    own = [r[phase]["own_wait"] for r in run]
    return {
        "tokens_per_s": tokens / (max(ends) - min(starts)),
        "wait_fraction": statistics.median(fractions),
        "own_wait_fraction": (
            statistics.median(o / w for o, w in zip(own, walls, strict=True))
            if own[0] is not None
            else float("nan")
        ),
        "next_median_s": statistics.median(x for r in run for x in r[phase]["waits"]),
        "max_wait_s": max(max(r[phase]["waits"]) for r in run),
    }


def _cell(values: list[float], fmt: str, scale: float) -> str:
    med = statistics.median(values)
    return (
        f"{format(med * scale, fmt)} "
        f"({format(min(values) * scale, fmt)}-{format(max(values) * scale, fmt)})"
    )


def report(
    corpus_info: dict[str, Any],
    ceiling: float,
    floor: float,
    bytes_rows: list[dict[str, Any]],
    loops: dict[str, dict[str, list[Any]]],
    phases: list[tuple[str, int, float]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    print(
        f"\nbytes read from storage per node, 100 steps; all: every read; samples: without "
        f"opening the corpus ({bytes_rows[0]['index'] / 1e3:.0f} kB per process)"
    )
    header = (
        f"{'layout':10} {'shuffle':>7} {'NodeLoader MB':>14} {'per-rank MB':>12} "
        f"{'ratio all':>10} {'ratio samples':>14}"
    )
    print(header)
    print("-" * len(header))
    for row in bytes_rows:
        row["ratio"] = row["tree"] / row["per_rank"]
        row["ratio_payload"] = row["tree_payload"] / row["per_rank_payload"]
        print(
            f"{'TP' + str(row['tp']) + 'xDP' + str(row['dp_local']):10} {row['shuffle']!s:>7} "
            f"{row['tree'] / 1e6:14.2f} {row['per_rank'] / 1e6:12.2f} {row['ratio']:10.3f} "
            f"{row['ratio_payload']:14.3f}"
        )

    print(
        f"\nthroughput (M tokens/s delivered to the 4 ranks, no compute) and data wait (time "
        f"in next() / wall, median rank), {args.reps} repetitions: median (min-max)"
    )
    print(
        f"producer ceiling: one process builds {ceiling:.0f} samples/s, "
        f"{ceiling * (SEQ_LEN + 1) / 1e6:.1f}M tokens/s; wake-up floor after a 10 ms sleep: "
        f"{floor * 1e6:.0f} us per call"
    )
    header = f"{'layout':6} {'case':18}" + "".join(f" {LABELS[m]:>22}" for m in METHODS)
    header += f" {'tree/best DL':>12}"
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {}
    for layout, runs in loops.items():
        tp = int(layout[2:])
        for p, (kind, _, compute) in enumerate(phases):
            per = {m: [summarize(run, p) for run in rs] for m, rs in runs.items()}
            if kind == "none":
                key, fmt, scale, case = "tokens_per_s", ".2f", 1e-6, "Mtok/s"
            else:
                key, fmt, scale = "wait_fraction", ".2f", 100.0
                case = f"wait % {compute * 1e3:.0f}ms {kind}"
            vals = {m: [s[key] for s in per[m]] for m in METHODS}
            med = {m: statistics.median(v) for m, v in vals.items()}
            best = max if kind == "none" else min
            best_dl = best(med["dataloader0"], med["dataloader1"])
            ratio = med["tree"] / best_dl if kind == "none" else best_dl / med["tree"]
            line = f"{layout:6} {case:18}" + "".join(
                f" {_cell(vals[m], fmt, scale):>22}" for m in METHODS
            )
            print(f"{line} {ratio:12.2f}")
            if kind != "none":
                own = [s["own_wait_fraction"] for s in per["tree"]]
                nxt = [s["next_median_s"] for s in per["tree"]]
                print(
                    f"{'':6} {'':18} NodeLoader's own wait (copy excluded) "
                    f"{_cell(own, '.3f', 100.0)} %, median next() "
                    f"{statistics.median(nxt) * 1e6:.0f} us"
                )
            else:
                cap = ceiling * (SEQ_LEN + 1) * tp
                print(f"{'':6} {'':18} NodeLoader at {med['tree'] / cap:.0%} of its ceiling")
            summary[f"{layout}/{kind}"] = {"per_run": per, "median": med, "ratio": ratio}
    return {
        "benchmark": "node_loading",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "parameters": {
            "seq_len": SEQ_LEN,
            "micro_batch": MICRO,
            "local_ranks": RANKS,
            "depth": DEPTH,
            "reader_threads": args.reader_threads,
            "reps": args.reps,
            "phases": phases,
            "methods": LABELS,
        },
        "corpus": corpus_info,
        "producer_ceiling_samples_per_s": ceiling,
        "wakeup_floor_s": floor,
        "bytes": bytes_rows,
        "loops": summary,
    }


if __name__ == "__main__":
    main()
