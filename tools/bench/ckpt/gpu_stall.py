"""Checkpoint stall of CUDA state: ms-ckpt's stage 1 against bare device-to-host copies.

    python tools/bench/ckpt/gpu_stall.py [--gib 4] [--reps 5] [--out PATH]

Without a CUDA device it prints one line starting "no CUDA device" and exits 0.

The state is ``--gib`` GiB of fp32 CUDA tensors shaped like a GPT's weights and two
Adam moments (d_model 2048; random, non-constant values). Measured in one run, the
candidates alternating with the order rotating over ``--reps``, each timed from the
call until it returns (the training-blocking stall):

- floor, pinned: copy every tensor into preallocated page-locked host tensors
  (``pin_memory=True``), non-blocking, then synchronize the current stream. The
  fastest a stage 1 can be on this machine's host link.
- pageable: the same into preallocated ordinary host tensors (blocking copies).
- ms-ckpt ``Checkpointer.save()``, warm: after a first save has made and page-locked
  its host buffer; each save is waited for outside the timed region.
- ms-ckpt first save: a fresh Checkpointer's first ``save()`` (it creates the
  shared-memory buffer and registers it with CUDA), once per repetition, after the
  three above (it is not in their rotation).

Also recorded, not timed: whether a warm ``save()`` returned while a kernel on another
stream was still running (stage 1 waits for the current stream only).

Reported: median and spread of each, GB/s (state bytes over the median) and the ratio
to the pinned floor. JSON (default bench-results/ckpt/gpu_stall-<date>.json) holds
the machine, parameters and every repetition.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ms_ckpt
from ms_ckpt import Checkpointer

D_MODEL = 2048


def make_state(target_bytes: int, device: torch.device) -> dict[str, Any]:
    """GPT-like weights and two moments per weight, about ``target_bytes`` in all."""
    d = D_MODEL
    per_layer = {"qkv": (3 * d, d), "out": (d, d), "fc1": (4 * d, d), "fc2": (d, 4 * d)}
    layer_bytes = 3 * 4 * sum(a * b for a, b in per_layer.values())
    layers = max(1, round(target_bytes / layer_bytes))
    gen = torch.Generator(device).manual_seed(0)
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(layers):
        for name, shape in per_layer.items():
            key = f"layers.{i}.{name}"
            model[key] = torch.randn(shape, generator=gen, device=device) * 0.02
            optim[key] = {
                "exp_avg": torch.randn(shape, generator=gen, device=device) * 1e-3,
                "exp_avg_sq": (torch.randn(shape, generator=gen, device=device) * 1e-3).square_(),
            }
    return {"model": model, "optim": optim, "step": 1000}


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    return []


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def save_returned_before_side_kernel(
    ckpt: Checkpointer, step: int, state: dict[str, Any], save_s: float
) -> bool:
    """True when a warm save() returned while a kernel on another stream still ran (one
    of about 2 s, or 10 times ``save_s``, a warm save's time, if that is longer)."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    cycles = int(2e9 * max(2.0, 10 * save_s))  # at about 2 GHz
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        done = torch.cuda.Event()
        done.record()
    handle = ckpt.save(step, state)
    returned_first = not done.query()
    handle.wait(timeout=600)
    done.synchronize()
    return returned_first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--gib",
        type=float,
        default=4.0,
        help="state size in GiB (fp32), rounded to whole layers of 0.5625 GiB",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tmp", type=Path, default=None, help="parent of the temp dir (local disk)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.gib <= 0 or args.reps < 1:
        ap.error(f"--gib must be > 0 and --reps >= 1, got {args.gib} and {args.reps}")
    if not torch.cuda.is_available():
        print("no CUDA device: gpu_stall.py measures CUDA state only; nothing measured")
        return 0
    device = torch.device("cuda")
    state = make_state(int(args.gib * 2**30), device)
    tensors = tensors_of(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    pageable = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]

    def copy_pinned() -> None:
        for dst, src in zip(pinned, tensors, strict=True):
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def copy_pageable() -> None:
        for dst, src in zip(pageable, tensors, strict=True):
            dst.copy_(src)

    copy_pinned()  # untimed: the host pages are touched before any timed copy
    copy_pageable()

    tmp = Path(tempfile.mkdtemp(dir=args.tmp, prefix="gpu_stall-"))
    times: dict[str, list[float]] = {
        "floor, pinned": [],
        "pageable": [],
        "ms-ckpt save, warm": [],
        "ms-ckpt first save": [],
    }
    try:
        with Checkpointer(str(tmp / "warm")) as ckpt:
            ckpt.save(0, state).wait(timeout=600)  # makes and registers the host buffer
            step = 1
            order = ["floor, pinned", "pageable", "ms-ckpt save, warm"]
            for rep in range(args.reps):
                for name in order[rep % 3 :] + order[: rep % 3]:
                    if name == "floor, pinned":
                        times[name].append(timed(copy_pinned))
                    elif name == "pageable":
                        times[name].append(timed(copy_pageable))
                    else:
                        t0 = time.perf_counter()
                        handle = ckpt.save(step, state)
                        times[name].append(time.perf_counter() - t0)
                        handle.wait(timeout=600)
                        step += 1
                fresh = tmp / f"first-{rep}"
                with Checkpointer(str(fresh)) as first:
                    t0 = time.perf_counter()
                    h = first.save(0, state)
                    times["ms-ckpt first save"].append(time.perf_counter() - t0)
                    h.wait(timeout=600)
                shutil.rmtree(fresh)
            other_stream_free = save_returned_before_side_kernel(
                ckpt, step, state, statistics.median(times["ms-ckpt save, warm"])
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    floor = statistics.median(times["floor, pinned"])
    print(
        f"## checkpoint stall of {nbytes / 2**30:.2f} GiB of CUDA state "
        f"({len(tensors)} tensors), {args.reps} reps, {torch.cuda.get_device_name()}"
    )
    print(f"{'candidate':22} {'median s':>9} {'min-max s':>15} {'GB/s':>7} {'x floor':>8}")
    summary: dict[str, Any] = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        summary[name] = {"median_s": med, "gb_per_s": nbytes / med / 1e9, "x_floor": med / floor}
        print(
            f"{name:22} {med:9.3f} {min(ts):7.3f}-{max(ts):<7.3f} {nbytes / med / 1e9:7.1f} "
            f"{med / floor:8.2f}"
        )
    print(f"warm save() returned while another stream's kernel ran: {other_stream_free}")
    date = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or Path(f"bench-results/ckpt/gpu_stall-{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "ckpt_gpu_stall",
        "date": date.isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "ms_ckpt": ms_ckpt.__version__,
            "gpu": torch.cuda.get_device_name(),
        },
        "parameters": {"gib": args.gib, "reps": args.reps, "bytes": nbytes},
        "times_s": times,
        "summary": summary,
        "warm_save_returned_before_other_stream": other_stream_free,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
