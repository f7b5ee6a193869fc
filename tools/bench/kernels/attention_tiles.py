"""Times ms-kernels' Triton attention kernels over a grid of tiles, warps and stages.

    python tools/bench/kernels/attention_tiles.py [--shapes 4x4096x32x8x128]
        [--windows causal,512] [--dtype bf16] [--reps 5] [--budget-s 270] [--out PATH]
    python tools/bench/kernels/attention_tiles.py --smoke

This is how the GPU launches in ``ms_kernels._attention_triton._TUNED`` are chosen.
Each of the three main kernels (forward; dK/dV; dQ) is swept on its own: a candidate
launch replaces that kernel's current one, the other two keep theirs, and the call that
runs it (the forward for the forward, the whole backward for the other two) is timed
on every (shape, window) case. A candidate's score is the geometric mean over the
cases of its time over the current launch's time (< 1: faster). Every candidate's
results are checked against the current launch's (relative L2 error under 1e-2 per
tensor), so that a launch that computes something else cannot win; one that fails to
compile (shared memory, registers) keeps its reason.

Timing: the shared harness's Timer (CUDA events after an L2-evicting write), one
warm-up call (Triton compiles there), then ``--reps`` calls; the median counts. The
sweep gives each kernel an equal share of what is left of ``--budget-s``, stops
starting new candidates of a kernel once its share has passed, and reports what it
has (candidates run in the order of ``GRID``, so list the likely winners early).
Without CUDA it prints "no CUDA device" and exits 0; ``--smoke`` runs the plumbing
once on a tiny case in the Triton interpreter and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any
from unittest import mock

if "--smoke" in sys.argv[1:] and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton defines a kernel

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_harness import (
    Timer,
    nvidia_smi,
    positive,
    randn,
    shapes_parser,
    sync,
    version,
    window_list,
)

from ms_kernels import _attention_triton as kernels

SCRIPT = "tools/bench/kernels/attention_tiles.py"
KERNELS = ("fwd", "dkdv", "dq")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MAX_REL_ERROR = 1e-2

# (BLOCK_M, BLOCK_N) per kernel; BLOCK_N is the dK/dV kernel's home (keys per program).
GRID = {
    "fwd": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128), (64, 128)],
    "dkdv": [(16, 64), (32, 32), (32, 64), (64, 64), (16, 128), (32, 128), (64, 128)],
    "dq": [(32, 32), (64, 32), (64, 64), (128, 32), (128, 64), (32, 64)],
}
WARPS = (4, 8)
STAGES = {"fwd": (2, 3, 4), "dkdv": (2, 3), "dq": (2, 3)}
SMOKE_GRID = {"fwd": [(16, 32)], "dkdv": [(16, 32)], "dq": [(32, 16)]}


def candidates(kernel: str, smoke: bool) -> Iterator[kernels._Tile]:
    if smoke:
        for m, n in SMOKE_GRID[kernel]:
            yield kernels._Tile(m, n)
        return
    for (m, n), w, s in itertools.product(GRID[kernel], WARPS, STAGES[kernel]):
        yield kernels._Tile(m, n, num_warps=w, num_stages=s)


@contextmanager
def launches(blocks: kernels._Blocks) -> Iterator[None]:
    with mock.patch.object(kernels, "_block_sizes", return_value=blocks):
        yield


def window_of(tokens: int | None) -> tuple[int, int]:
    """A causal window of ``tokens`` (the query and the tokens - 1 before it); None: causal."""
    return (1 << 30 if tokens is None else tokens - 1), 0


class Case:
    """One (shape, window) case's inputs and the current launches' results."""

    def __init__(
        self, shape: tuple[int, ...], tokens: int | None, dtype: torch.dtype, device: torch.device
    ) -> None:
        b, s, hq, hkv, d = shape
        self.shape, self.tokens = shape, tokens
        gen = torch.Generator(device).manual_seed(0)
        self.q = randn((b, s, hq, d), gen, dtype)
        self.k = randn((b, s, hkv, d), gen, dtype)
        self.v = randn((b, s, hkv, d), gen, dtype)
        self.dout = randn((b, s, hq, d), gen, dtype)
        self.left, self.right = window_of(tokens)
        self.scale = d**-0.5
        self.out, self.lse = self.forward()
        self.grads = self.backward()

    @property
    def label(self) -> str:
        b, s, hq, hkv, d = self.shape
        window = "causal" if self.tokens is None else f"W={self.tokens}"
        return f"{b}x{s}x{hq}/{hkv}x{d} {window}"

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.attention_forward(self.q, self.k, self.v, self.left, self.right, self.scale)

    def backward(self) -> tuple[torch.Tensor, ...]:
        return kernels.attention_backward(
            self.q, self.k, self.v, self.out, self.lse, self.dout,
            self.left, self.right, self.scale,
        )  # fmt: skip

    def call(self, kernel: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        return self.forward if kernel == "fwd" else self.backward

    def reference(self, kernel: str) -> tuple[torch.Tensor, ...]:
        return (self.out,) if kernel == "fwd" else self.grads


def rel_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        scale = b.float().norm().item()
        worst = max(worst, (a.float() - b.float()).norm().item() / max(scale, 1e-30))
    return worst


def time_launch(
    kernel: str,
    tile: kernels._Tile,
    base: kernels._Blocks,
    cases: Sequence[Case],
    timer: Timer,
    device: torch.device,
    reps: int,
) -> dict[str, Any]:
    """One candidate on every case: times, error against the current launch, or why none."""
    blocks = replace(base, **{kernel: tile})
    entry: dict[str, Any] = {"kernel": kernel, "tile": asdict(tile), "cases": {}}
    with launches(blocks):
        for case in cases:
            fn = case.call(kernel)
            try:
                got = fn()
                got = got[:1] if kernel == "fwd" else got
                sync(device)
                times = [timer(fn) for _ in range(reps)]
            except Exception as exc:  # a launch that does not compile or run
                first = (str(exc).strip().splitlines() or [""])[0]
                entry["status"] = f"{type(exc).__name__}: {first[:100]}"
                return entry
            error = rel_error(got, case.reference(kernel))
            entry["cases"][case.label] = {"times_s": times, "median_s": statistics.median(times),
                                          "rel_error": error}  # fmt: skip
            if not error < MAX_REL_ERROR:
                entry["status"] = f"wrong: relative error {error:.2e} on {case.label}"
                return entry
    entry["status"] = "ok"
    return entry


def score(entry: dict[str, Any], base: dict[str, Any]) -> float | None:
    """Geometric mean over cases of time / the current launch's time."""
    if entry.get("status") != "ok" or base.get("status") != "ok":
        return None
    ratios = [entry["cases"][c]["median_s"] / base["cases"][c]["median_s"] for c in base["cases"]]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def tile_text(tile: dict[str, Any]) -> str:
    return f"{tile['block_m']}x{tile['block_n']} w{tile['num_warps']} s{tile['num_stages']}"


def sweep(
    args: argparse.Namespace, device: torch.device, timer: Timer, deadline: float
) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    by_dim: dict[int, list[tuple[int, ...]]] = {}
    for shape in args.shapes:
        by_dim.setdefault(shape[4], []).append(shape)
    report: dict[str, Any] = {}
    for dim, shapes in by_dim.items():
        base = kernels._block_sizes(dim, dtype, interpreting=device.type != "cuda")
        cases = [Case(s, w, dtype, device) for s in shapes for w in args.windows]
        per_dim: dict[str, Any] = {"current": asdict(base), "kernels": {}}
        report[str(dim)] = per_dim
        for k, kernel in enumerate(KERNELS):
            # Each kernel gets an equal share of what is left, so that all three are swept.
            left = max(0.0, deadline - time.monotonic())
            kernel_deadline = time.monotonic() + left / (len(KERNELS) - k)
            current = time_launch(kernel, getattr(base, kernel), base, cases, timer, device,
                                  args.reps)  # fmt: skip
            rows = [current | {"score": 1.0 if current["status"] == "ok" else None}]
            print(f"\n## d={dim} {kernel}: current {tile_text(current['tile'])}: "
                  f"{current['status']}  " + "  ".join(
                      f"{c} {v['median_s'] * 1e3:.3f} ms" for c, v in current["cases"].items()),
                  flush=True)  # fmt: skip
            for tile in candidates(kernel, args.smoke):
                if tile == getattr(base, kernel):
                    continue
                if time.monotonic() > kernel_deadline:
                    print(f"{kernel}: its share of --budget-s is spent; next kernel", flush=True)
                    per_dim.setdefault("stopped_early", []).append(kernel)
                    break
                entry = time_launch(kernel, tile, base, cases, timer, device, args.reps)
                entry["score"] = score(entry, current)
                rows.append(entry)
                shown = f"{entry['score']:.3f}" if entry["score"] is not None else entry["status"]
                print(f"  {tile_text(entry['tile']):16} {shown}", flush=True)
            per_dim["kernels"][kernel] = rows
            ranked = sorted((r for r in rows if r["score"] is not None), key=lambda r: r["score"])
            if ranked:
                best = ranked[0]
                print(f"best {kernel} d={dim}: {tile_text(best['tile'])} "
                      f"score {best['score']:.3f}", flush=True)  # fmt: skip
    return report


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--shapes",
        type=shapes_parser(5, "batch x seq x q heads x kv heads x head dim"),
        default=[(4, 4096, 32, 8, 128)],
    )
    ap.add_argument("--windows", type=window_list, default=[None, 512])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reps", type=positive, default=5, help="timed calls per case")
    ap.add_argument("--budget-s", type=float, default=270.0, help="seconds for the whole sweep")
    ap.add_argument("--out", type=Path, help="JSON path (default bench-results/...)")
    ap.add_argument("--smoke", action="store_true", help="one tiny interpreted case per kernel")
    args = ap.parse_args(argv)
    for _, _, hq, hkv, _ in args.shapes:
        if hq % hkv:
            ap.error(f"--shapes: query heads {hq} are not a multiple of key/value heads {hkv}")
    if args.smoke:
        args.shapes, args.windows, args.reps = [(1, 40, 2, 1, 16)], [None, 8], 1
    elif not torch.cuda.is_available():
        print(f"no CUDA device: {SCRIPT} tunes GPU launches only; nothing measured")
        return 0
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: Triton kernels would be interpreted; unset it to measure")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    start = time.monotonic()
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": version("triton"),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "nvidia_smi": nvidia_smi(None) if device.type == "cuda" else {},
        "dtype": args.dtype,
        "reps": args.reps,
        "results": sweep(args, device, Timer(device), start + args.budget_s),
    }
    if args.smoke:
        print("smoke: not a measurement; no JSON written")
        return 0
    out = args.out or Path("bench-results") / f"attention_tiles-{report['date'][:10]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
