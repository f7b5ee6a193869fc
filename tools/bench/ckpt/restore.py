"""Checkpoint restore on CPU ranks: ms-ckpt's broadcast recovery against every rank reading.

    .venv/bin/python tools/bench/ckpt/restore.py [--gib 1] [--reps 3] [--ranks 2,4] [--smoke]

For each world size of ``--ranks`` (in turn), that many real rank processes join a
gloo process group on localhost (``ms_testing.run_ranks``: spawned processes, the
rendezvous store on a free port). Every rank builds the same state of ``--gib`` GiB of
fp32 tensors shaped like a GPT (``stall.py``'s ``make_state``: d_model 1024, weights and
two Adam moments, random non-constant values, one seed on every rank, so the state is
replicated: all ranks are DP replicas, ms-ckpt's default ``dp_group``). The ranks save
it once as step 1 (zstd level 3, the default; ``wait()`` then a barrier) into a temp
dir on local disk, and then restore it into a second state allocated once per rank and
reused (each rank sets ``torch.set_num_threads(cores // ranks)``, at least 1).

Candidates, alternating within each repetition (order rotating) over ``--reps``, after
one warm-up of each:

1. ``Checkpointer.load(state, broadcast=True)`` (the default): each replicated record
   is read from storage, checksummed and decompressed by one rank of the DP group and
   broadcast to the others (gloo, 32 MiB buckets).
2. ``Checkpointer.load(state, broadcast=False)``: every rank reads, checksums and
   decompresses every record itself.
3. Floor: a bare memory copy of the same bytes into the live state on every rank at
   once (what any restore must at least do).
4. Diagnostic: a bare gloo broadcast of the same bytes, tensor by tensor straight into
   the live state, each tensor sent by one rank (largest first to the least loaded
   rank, as ms-ckpt splits them): the transport cost of candidate 1 without storage,
   checksums, decompression or staging copies.

Restore time: a barrier, then the time until this rank's call returns; the job's
restore time is the maximum over ranks (the job resumes when its slowest rank does).
Reported: the median over repetitions, min-max, GiB/s of restored state per rank (state
bytes / time) and the ratio to candidate 1. Before every restore the live state is
poisoned (tensors filled with NaN, the step counter with -1); after it every tensor is
compared with the saved state (``torch.equal``) on every rank, so a broken load fails
the benchmark instead of being timed.

Storage: one checkpoint on local disk, read with a warm page cache (it was just written,
and the page cache cannot be dropped without root). The times therefore measure reading
from the page cache, crc32 checks, zstd decompression, the broadcast and the copies into
the live state, not disk or network storage bandwidth. What scales with a real storage
system is the number of bytes each candidate asks storage for, so that is measured too:
one extra restore per candidate through ``ms_testing.fs``'s ``counting://`` filesystem
(every process appends each read's size to one counter file), over the same files.
Counting costs a locked file append per read call, so the counted restores are separate
from the timed ones: the timed restores read ``file://`` and nothing is counted there.
Bytes read from storage are the bytes read from the step's ``.bin`` shard files (the
manifest, read by rank 0 alone, is reported apart); expected: 1x the stored shard bytes
with broadcast, world-size x without.

Prints a markdown table per world size and a JSON record (machine info, parameters,
every repetition); ``--out PATH`` also writes the record there. Nothing is written into
the repository; the temp dirs are removed at the end. ``--smoke``: ``--gib 1/64`` (whole
d_model-1024 tensors round it up to about 40 MiB), 1 repetition, 2 ranks, a check
that the script works (under a minute).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stall import D_MODEL, make_state, tensors_of

import ms_ckpt
from ms_ckpt import Checkpointer
from ms_testing import run_ranks
from ms_testing.bench import machine_info, vm_bytes
from ms_testing.fs import COUNTER_ENV, read_counts, reset_counts

BCAST = "ms load, broadcast"
EVERY = "ms load, every rank reads"
COPY = "memory copy (floor)"
GLOO = "gloo broadcast only"
CANDIDATES = (BCAST, EVERY, COPY, GLOO)
LOADS = {BCAST: True, EVERY: False}  # candidate -> load(broadcast=...)


def empty_like_state(state: Any) -> Any:
    """The same tree with fresh (uninitialized) tensors."""
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: empty_like_state(v) for k, v in state.items()}
    return state


def poison(state: dict[str, Any]) -> None:
    for t in tensors_of(state):
        t.fill_(float("nan"))
    state["step"] = -1


def check_equal(ref: dict[str, Any], got: dict[str, Any], what: str) -> None:
    """Raise unless ``got`` holds exactly the saved values (every tensor compared)."""
    pairs = zip(tensors_of(ref), tensors_of(got), strict=True)
    bad = [i for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
    if bad or got["step"] != ref["step"]:
        raise AssertionError(
            f"rank {dist.get_rank()}: after {what} the state differs from the saved one "
            f"({len(bad)} tensors differ, step {got['step']!r})"
        )


def split(tensors: list[torch.Tensor], n: int) -> list[int]:
    """Which rank sends each tensor: largest first to the least loaded rank."""
    load = [0] * n
    owner = [0] * len(tensors)
    for i in sorted(range(len(tensors)), key=lambda i: (-tensors[i].nbytes, i)):
        j = min(range(n), key=lambda r: (load[r], r))
        owner[i] = j
        load[j] += tensors[i].nbytes
    return owner


def max_over_ranks(x: float) -> tuple[float, list[float]]:
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, x)
    return max(got), [float(v) for v in got]


def shard_bytes(by_path: dict[str, int]) -> int:
    return sum(n for p, n in by_path.items() if p.endswith(".bin"))


def rank_main(tmp: str, target_bytes: int, reps: int, counter: str) -> dict[str, Any] | None:
    """One rank: save once, then time and count the restores (runs under run_ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    ref = make_state(target_bytes)  # same seed on every rank: replicated state
    live = empty_like_state(ref)  # allocated once, restored into again and again
    ref_t, live_t = tensors_of(ref), tensors_of(live)
    raw = sum(t.nbytes for t in ref_t)
    root = Path(tmp) / "ckpt"

    saver = Checkpointer(f"file://{root}")
    t0 = time.perf_counter()
    saver.save(1, ref).wait()
    dist.barrier()
    save_s = time.perf_counter() - t0
    saver.finalize()  # frees its host buffer and writer before the restores
    plain = Checkpointer(f"file://{root}")
    counting = Checkpointer(f"counting://{root}")

    owner = split(ref_t, world)

    def gloo_broadcast() -> None:
        for i, j in enumerate(owner):
            dist.broadcast(ref_t[i] if j == rank else live_t[i], src=j)
        if rank in owner:  # the sender's own tensors still need to reach its live state
            for i, j in enumerate(owner):
                if j == rank:
                    live_t[i].copy_(ref_t[i])

    def copy() -> None:
        for a, b in zip(ref_t, live_t, strict=True):
            b.copy_(a)

    def loader(ckpt: Checkpointer, broadcast: bool) -> Callable[[], None]:
        def run() -> None:
            if ckpt.load(live, step=1, broadcast=broadcast) != 1:
                raise AssertionError("load returned another step")

        return run

    fns: dict[str, Callable[[], None]] = {
        BCAST: loader(plain, True),
        EVERY: loader(plain, False),
        COPY: copy,
        GLOO: gloo_broadcast,
    }

    def timed(name: str) -> tuple[float, list[float]]:
        poison(live)
        dist.barrier()
        t0 = time.perf_counter()
        fns[name]()
        elapsed = time.perf_counter() - t0
        if name in (COPY, GLOO):
            live["step"] = ref["step"]  # the floors move tensors only
        check_equal(ref, live, name)
        return max_over_ranks(elapsed)

    for name in CANDIDATES:  # warm-up: gloo pairs, allocator, page cache
        timed(name)
    times: dict[str, list[float]] = {n: [] for n in CANDIDATES}
    per_rank: dict[str, list[list[float]]] = {n: [] for n in CANDIDATES}
    for rep in range(reps):
        k = rep % len(CANDIDATES)
        for name in CANDIDATES[k:] + CANDIDATES[:k]:
            job_s, ranks_s = timed(name)
            times[name].append(job_s)
            per_rank[name].append(ranks_s)
            if rank == 0:
                print(f"  [{world} ranks] rep {rep} {name:26} {job_s:7.3f} s", flush=True)

    # Counted restores: separate from the timed ones, through counting://.
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    counted: dict[str, Any] = {}
    for name, broadcast in LOADS.items():
        poison(live)
        if rank == 0:
            reset_counts(counter)
        dist.barrier()
        t0 = time.perf_counter()
        counting.load(live, step=1, broadcast=broadcast)
        elapsed = time.perf_counter() - t0
        check_equal(ref, live, f"{name} (counted)")
        job_s, _ = max_over_ranks(elapsed)
        dist.barrier()  # every rank's reads are in the counter file
        if rank == 0:
            c = read_counts(counter)
            counted[name] = {
                "shard_bytes_read": shard_bytes(c.by_path),
                "total_bytes_read": c.total,
                "read_calls": c.calls,
                "bytes_read_per_rank": [c.by_pid.get(pid, 0) for pid in pids],
                "restore_s_with_counting": job_s,
            }
    step_dir = root / "step-00000001"
    stored = sum(p.stat().st_size for p in step_dir.iterdir() if p.name.endswith(".bin"))
    peak, _ = max_over_ranks(float(vm_bytes("VmHWM")))
    plain.finalize()
    counting.finalize()
    if rank != 0:
        return None
    return {
        "world_size": world,
        "raw_bytes": raw,
        "tensors": len(ref_t),
        "stored_shard_bytes": stored,
        "shard_files": sorted(p.name for p in step_dir.iterdir()),
        "save_s": save_s,
        "torch_threads_per_rank": torch.get_num_threads(),
        "restore_s": times,
        "restore_s_per_rank": per_rank,
        "counted": counted,
        "peak_rss_bytes_max_rank": peak,
    }


def spread(xs: list[float]) -> str:
    return f"{min(xs):.3f}-{max(xs):.3f}"


def report(r: dict[str, Any]) -> dict[str, Any]:
    """Print one world size's markdown table; its summary."""
    world, raw, stored = r["world_size"], r["raw_bytes"], r["stored_shard_bytes"]
    med = {n: statistics.median(ts) for n, ts in r["restore_s"].items()}
    read = {n: r["counted"][n]["shard_bytes_read"] for n in LOADS}
    gib = 2**30
    print(
        f"\n### {world} ranks: {raw / gib:.3f} GiB fp32 state per rank ({r['tensors']} tensors), "
        f"stored {stored / gib:.3f} GiB of zstd-3 shards, {len(r['restore_s'][BCAST])} reps\n"
    )
    print(
        "| candidate | median restore s | min-max s | restored GiB/s per rank "
        "| time / broadcast | read from storage GiB | reads / broadcast |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in CANDIDATES:
        m = med[name]
        if name in LOADS:
            rd = f"{read[name] / gib:.3f} | {read[name] / read[BCAST]:.2f}x"
        else:
            rd = "0 (no storage) | -"
        print(
            f"| {name} | {m:.3f} | {spread(r['restore_s'][name])} | {raw / m / gib:.2f} "
            f"| {m / med[BCAST]:.2f}x | {rd} |"
        )
    for name in LOADS:
        c = r["counted"][name]
        per = ", ".join(f"{b / gib:.3f}" for b in c["bytes_read_per_rank"])
        print(
            f"\n{name}: read {c['shard_bytes_read'] / stored:.2f}x the stored shard bytes; "
            f"per rank (GiB): {per}; manifest and other bytes "
            f"{c['total_bytes_read'] - c['shard_bytes_read']} B"
        )
    return {
        "median_restore_s": med,
        "restored_gib_per_s_per_rank": {n: raw / m / gib for n, m in med.items()},
        "time_over_broadcast": {n: m / med[BCAST] for n, m in med.items()},
        "shard_bytes_read": read,
        "every_rank_over_broadcast_bytes": read[EVERY] / read[BCAST],
        "broadcast_bytes_over_stored": read[BCAST] / stored,
        "broadcast_over_copy_floor": med[BCAST] / med[COPY],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (fp32) per rank")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", default="2,4", help="world sizes to run in turn, e.g. 2,4")
    ap.add_argument("--tmp", type=Path, default=None, help="parent of the temp dir (local disk)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON record here")
    ap.add_argument("--smoke", action="store_true", help="tiny state (~40 MiB), 1 rep, 2 ranks")
    args = ap.parse_args()
    if args.smoke:
        args.gib, args.reps, args.ranks = 1 / 64, 1, "2"
    worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
    target = int(args.gib * 2**30)
    # generous: every collective of a run has this deadline, and the box may be busy
    timeout = 120.0 if args.smoke else 600.0 + 300.0 * args.gib * max(worlds) * (args.reps + 2)

    results: list[dict[str, Any]] = []
    summaries: dict[str, Any] = {}
    for world in worlds:
        print(f"{world} ranks: build, save, {args.reps} reps x {len(CANDIDATES)} candidates")
        with tempfile.TemporaryDirectory(prefix="ms-ckpt-restore-", dir=args.tmp) as tmp:
            counter = str(Path(tmp) / "reads")
            values = run_ranks(
                rank_main,
                world,
                args=(tmp, target, args.reps, counter),
                timeout=timeout,
                env={COUNTER_ENV: counter},
            )
        results.append(values[0])
        summaries[str(world)] = report(values[0])

    record = {
        "benchmark": "ckpt_restore",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(ms_ckpt=ms_ckpt.__version__),
        "parameters": {
            "gib": args.gib,
            "reps": args.reps,
            "ranks": worlds,
            "d_model": D_MODEL,
            "dtype": "float32",
            "compression": "zstd level 3",
            "storage": "local disk, warm page cache; timed restores via file://, "
            "bytes counted in separate restores via counting://",
            "backend": "gloo, localhost",
        },
        "runs": results,
        "summary": summaries,
    }
    text = json.dumps(record, indent=1)
    print("\n```json\n" + text + "\n```")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
