"""Timing machinery shared by the GPU benchmark scripts: alternating candidates, floors,
and the command-line types of their case lists.

Candidates run side by side in one process: each warms up, then every repetition
times each candidate once, the order rotating. On CUDA a call is timed between
CUDA events after a write that evicts L2 (as ``triton.testing.do_bench`` does); on
CPU (``--smoke`` only) by wall clock. A candidate that raises keeps its reason and
the run goes on.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "L2_FLUSH_BYTES",
    "PASSES",
    "Candidate",
    "Result",
    "Timer",
    "compare",
    "copy_bandwidth",
    "free_memory",
    "matmul_peak",
    "nvidia_smi",
    "positive",
    "print_table",
    "randn",
    "shapes_parser",
    "summarize",
    "sync",
    "version",
    "window_list",
]

L2_FLUSH_BYTES = 256 * 2**20  # beyond any GPU's L2 (H100: 50 MB)


Candidate = Callable[[], object] | str  # a timed call, or why there is none


class Timer:
    """Seconds one call takes: CUDA events after an L2-evicting write; wall time on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._scratch = (
            torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if self.cuda else None
        )

    def __call__(self, fn: Callable[[], object]) -> float:
        if self._scratch is None:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        self._scratch.zero_()  # queued before the start event, so not timed
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3


@dataclass
class Result:
    """One candidate's repetitions in one case and pass."""

    status: str = "ok"  # "ok", or why there are no times (not installed, OOM, error)
    times: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _failure(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "OOM"
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"error: {type(exc).__name__}: {first[:80]}"


def compare(
    candidates: dict[str, Candidate],
    timer: Timer,
    device: torch.device,
    warmup: int,
    reps: int,
) -> dict[str, Result]:
    """Warm up every runnable candidate, run each once more through the timer untimed,
    then time them alternately, the order rotating.

    A candidate that raises (OOM, an unsupported case) keeps its reason instead of
    times; the others go on.
    """
    results = {
        name: Result(status=c) if isinstance(c, str) else Result() for name, c in candidates.items()
    }
    runnable = {name: c for name, c in candidates.items() if not isinstance(c, str)}
    for name, fn in list(runnable.items()):
        try:
            for _ in range(warmup):
                fn()
            sync(device)
        except Exception as exc:  # one failing candidate must not end a long run
            traceback.print_exc(file=sys.stderr)
            results[name].status = _failure(exc)
            del runnable[name]
            free_memory(device)
    # One untimed round through the timer first (L2 flush and events included): on an
    # H200 (2026-11-27), without it, the first timed call of ms-kernels' norms, which
    # came right after the other candidates' warm-up, was their slowest in 23 of 24 cases.
    for rep in range(-1, reps):
        names = list(runnable)
        k = max(rep, 0) % len(names) if names else 0
        for name in names[k:] + names[:k]:
            try:
                took = timer(runnable[name])
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                results[name].status = _failure(exc)
                del runnable[name]
                free_memory(device)
            else:
                if rep >= 0:
                    results[name].times.append(took)
    return results


def forward(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: list[torch.Tensor],
    grads: list[torch.Tensor],  # unused: the same signature as forward_backward
) -> Candidate:
    def call() -> None:
        with torch.no_grad():
            fn(*inputs)

    return call


def forward_backward(
    fn: Callable[..., Sequence[torch.Tensor]],
    inputs: list[torch.Tensor],
    grads: list[torch.Tensor],
) -> Candidate:
    # autograd.grad rather than backward(): accumulating into .grad would add a
    # read and a write of every input gradient that no candidate needs.
    def call() -> None:
        torch.autograd.grad(fn(*inputs), inputs, grads)

    return call


PASSES = {"fwd": forward, "fwd+bwd": forward_backward}


def summarize(
    results: dict[str, Result], work: float, reference_rate: float
) -> dict[str, dict[str, Any]]:
    """Per candidate: every time, median, min, max, work per second, its fraction of
    the reference rate (copy bandwidth or matmul peak), and t / t_ms (the first
    candidate is ms-kernels)."""
    first = next(iter(results.values()))
    base = statistics.median(first.times) if first.ok else None
    out: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        entry: dict[str, Any] = {"status": r.status, "times_s": r.times}
        if r.ok:
            median = statistics.median(r.times)
            entry |= {
                "median_s": median,
                "min_s": min(r.times),
                "max_s": max(r.times),
                "per_s": work / median,
                "fraction_of_reference": work / median / reference_rate,
                "ratio_to_ms": median / base if base else None,
            }
        out[name] = entry
    return out


def randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal in fp32 on gen's device, then rounded to dtype."""
    return torch.randn(shape, generator=gen, device=gen.device).to(dtype)


def copy_bandwidth(
    device: torch.device, nbytes: int, timer: Timer, reps: int
) -> tuple[float, list[float]]:
    """Bytes per second of a large device copy counted as read + write, median of reps."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [timer(lambda: dst.copy_(src)) for _ in range(reps)]
    return 2 * nbytes / statistics.median(times), times


def matmul_peak(
    device: torch.device, dtype: torch.dtype, n: int, timer: Timer, warmup: int, reps: int
) -> tuple[float, list[float]]:
    """FLOP/s of an n^3 GEMM (2 n^3 FLOPs) in dtype, median of reps."""
    gen = torch.Generator(device).manual_seed(0)
    a, b = (randn((n, n), gen, dtype) for _ in range(2))
    for _ in range(warmup):
        torch.mm(a, b)
    sync(device)
    times = [timer(lambda: torch.mm(a, b)) for _ in range(reps)]
    return 2 * n**3 / statistics.median(times), times


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvidia_smi(uuid: str | None) -> dict[str, str]:
    fields = ["driver_version", "clocks.max.sm", "clocks.max.memory", "power.limit"]
    cmd = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"]
    if uuid:
        cmd += ["-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in proc.stdout.splitlines()[0].split(",")]
    return dict(zip(fields, values, strict=False))


def _rows(
    records: list[dict[str, Any]], key: Callable[[dict[str, Any]], str], scale: float
) -> list[str]:
    lines = []
    for rec in records:
        for name, c in rec["candidates"].items():
            head = f"{key(rec)} {name:24}"
            if "median_s" not in c:
                lines.append(f"{head} {c['status']}")
                continue
            ratio = "n/a" if c["ratio_to_ms"] is None else f"{c['ratio_to_ms']:.2f}"
            spread = f"{c['min_s'] * 1e3:.4f}-{c['max_s'] * 1e3:.4f}"
            lines.append(
                f"{head} {c['median_s'] * 1e3:10.4f} {spread:>19} {c['per_s'] / scale:9.4g} "
                f"{100 * c['fraction_of_reference']:7.1f} {ratio:>7}"
            )
    return lines


def print_table(
    title: str, key_header: str, records: list[dict[str, Any]], key: Any, rate: str, of: str
) -> None:
    header = (
        f"{key_header} {'candidate':24} {'median ms':>10} {'min-max ms':>19} {rate:>9} "
        f"{of:>7} {'t/t_ms':>7}"
    )
    print(f"\n{title}\n{header}\n{'-' * len(header)}")
    scale = 1e9 if rate == "GB/s" else 1e12
    print("\n".join(_rows(records, key, scale)))


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def shapes_parser(size: int, what: str) -> Callable[[str], list[tuple[int, ...]]]:
    """A parser of comma-separated shapes such as 8192x4096, each of `size` integers >= 1."""

    def parse(text: str) -> list[tuple[int, ...]]:
        shapes = []
        for item in (t.strip() for t in text.split(",")):
            dims = item.split("x")
            whole = all(d.isascii() and d.isdigit() and int(d) >= 1 for d in dims)
            if len(dims) != size or not whole:
                raise argparse.ArgumentTypeError(
                    f"must be comma-separated {what} ({size} integers >= 1 joined by x), "
                    f"got {item!r}"
                )
            shapes.append(tuple(int(d) for d in dims))
        return shapes

    return parse


def window_list(text: str) -> list[int | None]:
    """An argparse type: comma-separated window sizes in tokens, or 'causal' (None)."""
    windows: list[int | None] = []
    for item in (t.strip() for t in text.split(",")):
        if item == "causal":
            windows.append(None)
        elif item.isascii() and item.isdigit() and int(item) >= 1:
            windows.append(int(item))
        else:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated window sizes in tokens (integers >= 1) or 'causal', "
                f"got {item!r}"
            )
    return windows
