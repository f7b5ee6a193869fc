"""Checkpoint stall on CPU: ms-ckpt's two-stage save against torch.save and DCP async_save.

    .venv/bin/python tools/bench/ckpt/stall.py [--gib 1] [--reps 3]

The state is ``--gib`` GiB of fp32 tensors shaped like a GPT (d_model 1024): an
embedding, per layer qkv / out / fc1 / fc2 weights, biases and layer norms, each with
its two Adam moments. Values are random and non-constant (weights ~ N(0, 0.02),
exp_avg ~ N(0, 1e-3), exp_avg_sq ~ N(0, 1e-3)^2), so compression sees realistic
mantissas: random fp32 barely compresses, only its exponent bytes do.

Three measurements, each writing to a fresh directory under a temp dir on local disk,
removed afterwards (with ``os.sync()`` outside the timed region, so one candidate's
dirty pages do not slow the next):

1. Training-blocking stall, candidates alternating (order rotating) over ``--reps``,
   every one reported against the same baseline, the floor: a bare copy of the same
   bytes into preallocated ``torch.empty_like`` tensors (reused, so warm like the
   buffers below). Candidates: ms-ckpt ``Checkpointer.save()`` until it returns (zstd
   level 3, the default; after a warm-up save so the host buffer and writer process
   exist; each save is waited for outside the timed region); synchronous ``torch.save``
   (page cache, no fsync); and ``torch.distributed.checkpoint.async_save`` until it
   returns (its future is waited for outside the timed region) in two set-ups: given a
   ``DefaultStager`` kept across saves with synchronous staging, so its staging copies
   land in warm CPU storages it caches per tensor, as ms-ckpt's host buffer is warm
   (pinned memory and non-blocking or background staging need CUDA and are off); and
   as called by default, with a fresh stager, and so fresh staging memory, per save.
   On torch 2.13 CPU async_save needs no process group: without one it assumes a
   single process; ``no_dist=True`` says so explicitly.
2. ms-ckpt stage 2 throughput (raw bytes / time from ``save()`` return to
   ``wait()`` done, including fsync and the manifest commit) and compression ratio
   (raw bytes / shard bytes) for zstd level 1, zstd level 3 and no compression,
   settings alternating.
3. Slowdown of a training-like loop (square fp32 matmuls of ~10 ms each, counted per
   second) while ms-ckpt stage 2 (zstd 3) runs in its writer process, at the default
   writer niceness 10 and at niceness 0 (the trainer's priority), against the same loop
   outside a save, alternating.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import ms_ckpt
from ms_ckpt import Checkpointer
from ms_testing.bench import machine_info

D_MODEL = 1024
FLOOR = "memory copy (floor)"
DCP_KEPT = "DCP async_save, kept stager"
DCP_FRESH = "DCP async_save, default"
STALL = ("ms-ckpt save()", "torch.save", DCP_KEPT, DCP_FRESH, FLOOR)
SETTINGS = (("zstd", 1), ("zstd", 3), ("none", 3))


def shapes_for(target_bytes: int) -> dict[str, tuple[int, ...]]:
    """GPT-like parameter shapes whose params + 2 Adam moments total about target_bytes."""
    d = D_MODEL
    floats = target_bytes // 4 // 3  # parameters; each has exp_avg and exp_avg_sq too
    vocab = max(1, min(32000, int(0.3 * floats) // d))
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    total, layer = vocab * d, 0
    while total < floats:
        layer_shapes = {
            "ln1.weight": (d,), "ln1.bias": (d,),
            "attn.qkv.weight": (3 * d, d), "attn.qkv.bias": (3 * d,),
            "attn.out.weight": (d, d), "attn.out.bias": (d,),
            "ln2.weight": (d,), "ln2.bias": (d,),
            "mlp.fc1.weight": (4 * d, d), "mlp.fc1.bias": (4 * d,),
            "mlp.fc2.weight": (d, 4 * d), "mlp.fc2.bias": (d,),
        }  # fmt: skip
        for name, shape in layer_shapes.items():
            if total >= floats:
                break
            shapes[f"layers.{layer}.{name}"] = shape
            total += int(torch.Size(shape).numel())
        layer += 1
    return shapes


def make_state(target_bytes: int, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    model, optim = {}, {}
    for name, shape in shapes_for(target_bytes).items():
        model[name] = torch.randn(shape, generator=gen) * 0.02
        optim[name] = {
            "exp_avg": torch.randn(shape, generator=gen) * 1e-3,
            "exp_avg_sq": (torch.randn(shape, generator=gen) * 1e-3).square_(),
        }
    return {"model": model, "optim": optim, "step": 1000}


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    return []


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()


class MsCandidate:
    """One Checkpointer kept warm across saves; every save is a fresh step directory."""

    def __init__(
        self, root: Path, compression: str = "zstd", level: int = 3, nice: int = 10
    ) -> None:
        self.root = root
        self.ckpt = Checkpointer(str(root), compression=compression, level=level, nice=nice)  # type: ignore[arg-type]
        self.step = 0

    def save(self, state: dict[str, Any]) -> tuple[float, Any]:
        self.step += 1
        t0 = time.perf_counter()
        handle = self.ckpt.save(self.step, state)
        return time.perf_counter() - t0, handle

    def step_dir(self) -> Path:
        return self.root / f"step-{self.step:08d}"

    def stored_bytes(self) -> int:
        manifest = json.loads((self.step_dir() / "manifest.json").read_text())
        return sum(w["bytes"] for w in manifest["world"]["writers"])

    def cleanup(self) -> None:
        remove(self.step_dir())


def measure_stall(state: dict[str, Any], tmp: Path, reps: int) -> dict[str, list[float]]:
    ms = MsCandidate(tmp / "ms")
    floor_dst = {id(t): torch.empty_like(t) for t in tensors_of(state)}
    run_id = 0

    def ms_save() -> float:
        elapsed, handle = ms.save(state)
        handle.wait()
        ms.cleanup()
        return elapsed

    def torch_save() -> float:
        path = tmp / f"torch-{run_id}.pt"
        t0 = time.perf_counter()
        torch.save(state, path)
        elapsed = time.perf_counter() - t0
        remove(path)
        return elapsed

    # Synchronous staging: async_save returns once the state is copied, when training
    # may change it again, the same promise as ms-ckpt's save(). The other options need
    # CUDA (pinned memory, non-blocking copies, a staging stream for background staging).
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )

    def dcp_save(kept: bool) -> float:
        path = tmp / f"dcp-{run_id}"
        t0 = time.perf_counter()
        future = dcp.async_save(
            state, checkpoint_id=str(path), no_dist=True, async_stager=stager if kept else None
        )
        elapsed = time.perf_counter() - t0
        future.result()  # type: ignore[union-attr]
        remove(path)
        return elapsed

    def copy() -> float:
        t0 = time.perf_counter()
        for t in tensors_of(state):
            floor_dst[id(t)].copy_(t)
        return time.perf_counter() - t0

    fns: dict[str, Callable[[], float]] = {
        STALL[0]: ms_save,
        STALL[1]: torch_save,
        DCP_KEPT: lambda: dcp_save(kept=True),
        DCP_FRESH: lambda: dcp_save(kept=False),
        FLOOR: copy,
    }
    for name in STALL:  # warm-up: ms buffer pool and writer, DCP's stager cache, pages
        fns[name]()
        run_id += 1
    times: dict[str, list[float]] = {n: [] for n in STALL}
    for rep in range(reps):
        k = rep % len(STALL)
        for name in STALL[k:] + STALL[:k]:
            times[name].append(fns[name]())
            run_id += 1
            print(f"  rep {rep} {name:22} {times[name][-1] * 1e3:8.1f} ms", flush=True)
    ms.ckpt.finalize()
    stager.close()
    return times


def measure_stage2(
    state: dict[str, Any], tmp: Path, reps: int, raw: int
) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for codec, level in SETTINGS:
        key = label(codec, level)
        out[key] = {"stage2_s": [], "stall_s": [], "stored_bytes": []}
    for rep in range(reps):
        k = rep % len(SETTINGS)
        for codec, level in SETTINGS[k:] + SETTINGS[:k]:
            key = label(codec, level)
            ms = MsCandidate(tmp / f"s2-{key}", codec, level)
            ms.save(state)[1].wait()  # warm-up: pool and writer
            ms.cleanup()
            stall, handle = ms.save(state)
            t0 = time.perf_counter()
            handle.wait()
            stage2 = time.perf_counter() - t0
            out[key]["stage2_s"].append(stage2)
            out[key]["stall_s"].append(stall)
            out[key]["stored_bytes"].append(ms.stored_bytes())
            ms.cleanup()
            ms.ckpt.finalize()
            print(
                f"  rep {rep} {key:8} stage 2 {stage2:6.2f} s  {raw / stage2 / 2**20:7.0f} MiB/s",
                flush=True,
            )
    return out


def label(codec: str, level: int) -> str:
    return f"zstd-{level}" if codec == "zstd" else codec


def calibrate_matmul(target_s: float = 0.010) -> int:
    """The square size n whose fp32 ``a @ a`` takes about ``target_s`` here."""
    n = 512
    for _ in range(6):
        a = torch.randn(n, n)
        a @ a  # warm-up
        reps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.2:
            a @ a
            reps += 1
        per = (time.perf_counter() - t0) / reps
        n = max(64, round(n * (target_s / per) ** (1 / 3)))
    return n


def matmul_loop(a: torch.Tensor, until: Callable[[float], bool]) -> tuple[int, float]:
    """Run ``a @ a`` until ``until(elapsed)`` is true; (count, elapsed seconds)."""
    count, t0 = 0, time.perf_counter()
    while True:
        a @ a
        count += 1
        elapsed = time.perf_counter() - t0
        if until(elapsed):
            return count, elapsed


SLOW = ("outside a save", "during stage 2 (nice 10)", "during stage 2 (nice 0)")


def measure_slowdown(state: dict[str, Any], tmp: Path, reps: int) -> dict[str, Any]:
    n = calibrate_matmul()
    a = torch.randn(n, n)
    writers = {
        SLOW[1]: MsCandidate(tmp / "nice10", nice=10),
        SLOW[2]: MsCandidate(tmp / "nice0", nice=0),
    }
    for ms in writers.values():
        ms.save(state)[1].wait()
        ms.cleanup()
    rates: dict[str, list[float]] = {case: [] for case in SLOW}
    windows: list[float] = []
    for rep in range(reps):
        k = rep % len(SLOW)
        for case in SLOW[k:] + SLOW[:k]:
            if case == SLOW[0]:
                window = statistics.median(windows) if windows else 3.0
                count, elapsed = matmul_loop(a, lambda e, w=window: e >= w)
            else:
                ms = writers[case]
                _, handle = ms.save(state)
                count, elapsed = matmul_loop(a, lambda e, h=handle: h.done())
                handle.wait()
                windows.append(elapsed)
                ms.cleanup()
            rates[case].append(count / elapsed)
            print(f"  rep {rep} {case:26} {count / elapsed:7.1f} matmuls/s", flush=True)
    for ms in writers.values():
        ms.ckpt.finalize()
    return {"matmul_n": n, "rates_per_s": rates, "stage2_windows_s": windows}


def spread(xs: list[float], scale: float = 1.0, fmt: str = ".0f") -> str:
    return f"{min(xs) * scale:{fmt}}-{max(xs) * scale:{fmt}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (fp32)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tmp", type=Path, default=None, help="parent of the temp dir (local disk)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/ckpt/stall.json"))
    args = ap.parse_args()

    state = make_state(int(args.gib * 2**30))
    tensors = tensors_of(state)
    raw = sum(t.numel() * t.element_size() for t in tensors)
    print(f"state: {len(tensors)} fp32 tensors, {raw / 2**30:.3f} GiB, reps {args.reps}")

    with tempfile.TemporaryDirectory(prefix="ms-ckpt-bench-", dir=args.tmp) as tmp_name:
        tmp = Path(tmp_name)
        print("1. training-blocking stall")
        stall = measure_stall(state, tmp, args.reps)
        print("2. ms-ckpt stage 2 throughput and compression")
        stage2 = measure_stage2(state, tmp, args.reps, raw)
        print("3. slowdown of a matmul loop during ms-ckpt stage 2")
        slow = measure_slowdown(state, tmp, args.reps)

    med = {n: statistics.median(ts) for n, ts in stall.items()}
    floor = med[FLOOR]
    header = (
        f"{'candidate':28} {'median ms':>10} {'min-max ms':>15} {'GiB/s':>7} {'/ copy floor':>13}"
    )
    print(f"\nTraining-blocking stall ({raw / 2**30:.2f} GiB, {args.reps} reps)")
    print(header)
    print("-" * len(header))
    for name in STALL:
        m = med[name]
        print(
            f"{name:28} {m * 1e3:10.0f} {spread(stall[name], 1e3):>15} {raw / m / 2**30:7.2f} "
            f"{m / floor:12.2f}x"
        )

    header2 = (
        f"{'ms-ckpt stage 2':16} {'median s':>9} {'min-max s':>11} {'MiB/s':>7} "
        f"{'raw/stored':>11} {'stall ms':>9}"
    )
    print("\n" + header2)
    print("-" * len(header2))
    s2_summary: dict[str, Any] = {}
    for codec, level in SETTINGS:
        key = label(codec, level)
        r = stage2[key]
        m = statistics.median(r["stage2_s"])
        ratio = raw / statistics.median(r["stored_bytes"])
        print(
            f"{key:16} {m:9.2f} {spread(r['stage2_s'], 1, '.2f'):>11} {raw / m / 2**20:7.0f} "
            f"{ratio:10.3f}x {statistics.median(r['stall_s']) * 1e3:9.0f}"
        )
        s2_summary[key] = {
            "median_stage2_s": m,
            "throughput_bytes_per_s": raw / m,
            "compression_ratio": ratio,
        }

    rates = slow["rates_per_s"]
    base = statistics.median(rates[SLOW[0]])
    during = {case: statistics.median(rates[case]) / base for case in SLOW[1:]}
    print(f"\nMatmul loop ({slow['matmul_n']}^2 fp32, {torch.get_num_threads()} torch threads)")
    for case, rs in rates.items():
        m = statistics.median(rs)
        print(
            f"{case:26} {m:7.1f} matmuls/s (min-max {spread(rs, 1, '.1f')})  "
            f"{m / base:.2f}x of outside"
        )

    record = {
        "benchmark": "ckpt_stall",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(ms_ckpt=ms_ckpt.__version__),
        "parameters": {
            "gib": args.gib,
            "raw_bytes": raw,
            "tensors": len(tensors),
            "d_model": D_MODEL,
            "dtype": "float32",
            "reps": args.reps,
            "ms_stall_config": "zstd level 3, stage2=process",
            "dcp": (
                "async_save, thread, no_dist=True (no process group needed on CPU); "
                "'kept stager': one DefaultStager(StagingOptions(False, False, False, False)) "
                "passed as async_stager to every save (synchronous staging into cached, "
                "warm CPU storages); 'default': no async_stager (a fresh one per save)"
            ),
        },
        "stall_s": stall,
        "stage2": stage2,
        "slowdown": slow,
        "summary": {
            "stall_median_s": med,
            "baseline": FLOOR,
            "stall_over_copy_floor": {n: med[n] / floor for n in STALL},
            "stage2": s2_summary,
            "matmul_rate_during_over_outside": during,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
