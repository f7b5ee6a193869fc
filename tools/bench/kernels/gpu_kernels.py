"""ms-kernels on CUDA against its baselines: norms, bias + GeLU, sliding-window attention.

    .venv/bin/python tools/bench/kernels/gpu_kernels.py [--reps 20] [--warmup 5]
        [--only norms|attention] [--dtypes bf16,fp16] [--out PATH]
    .venv/bin/python tools/bench/kernels/gpu_kernels.py --smoke

Without a CUDA device it prints one line starting "no CUDA device" and exits 0,
measuring nothing and writing nothing. --smoke runs every code path once on tiny
shapes on whatever device there is (on CPU: the torch backends and eager baselines
only; no Triton interpreter, no torch.compile), prints the tables marked "smoke: not
a measurement" and writes no JSON; it exists so that the plumbing is tested
without a GPU.

How: one run, candidates side by side. For each case and pass (forward; forward +
backward, the latter timed as one call of forward then torch.autograd.grad), every
candidate warms up (Triton and torch.compile compile there), then each repetition
times every candidate once, the order rotating. Each timed call follows a 256 MiB
write that evicts L2 (as triton.testing.do_bench does) and is timed between CUDA
events. Inputs are random normal, never zeros or constants; memory is freed and
torch.compile's caches are reset between cases. Reported per candidate: median,
spread (min-max) and t / t_ms, its median over ms-kernels' median (> 1: ms is
faster). JSON (default bench-results/gpu_kernels-<date>.json) holds the machine,
versions, parameters and every repetition.

Norms and activations: ms-kernels' Triton kernels (backend="triton") vs the torch
reference with the same semantics in eager mode (ms_kernels.*_reference:
F.layer_norm, F.rms_norm, gelu(x + bias), after x + residual for the add forms) vs
torch.compile of that reference. Effective bandwidth is the minimum bytes an op must
move over its time: every input read once and every output written once, all in
the input dtype; saved statistics (8 bytes a row) are not counted. For M tokens x
N hidden and e bytes an element:

    op               forward       backward      backward reads / writes
    layer_norm       (2MN + 2N)e   (3MN + 3N)e   x, dy, w / dx, dw, db
    add + layer_norm (4MN + 2N)e   (4MN + 3N)e   s, dy, ds, w / dx (x's and residual's), dw, db
    rms_norm         (2MN +  N)e   (3MN + 2N)e   x, dy, w / dx, dw
    add + rms_norm   (4MN +  N)e   (4MN + 2N)e   s, dy, ds, w / dx, dw
    bias + gelu      (2MN +  N)e   (3MN + 2N)e   x, dy, b / dx, db

and forward + backward counts both. The floor is the device's copy bandwidth,
measured here as a 1 GiB device-to-device copy counted as read plus write; "% floor"
is the achieved bandwidth over it.

Attention: ms_kernels.sliding_window_attention (backend="triton") vs flash-attn's
flash_attn_func with window_size (when installed) vs torch SDPA with is_causal and no
mask (its flash backend; it ignores the window, so on windowed rows it computes full
causal attention, a different and larger result) vs SDPA with the dense boolean
window mask from ms_kernels.window_mask (GQA key/value heads repeated first, as
transformers' repeat_kv does, since SDPA's masked kernels take no GQA). A window of
W tokens is transformers' sliding_window=W: the query and the W - 1 keys before it,
window=(W - 1, 0) with causal=True. FLOPs count only the (query, key) pairs inside
the window, P = the sum over queries of their allowed keys (the diagonal included):

    forward            4 * B * Hq * D * P   (QK^T and PV, 2 FLOPs a multiply-add)
    backward           2.5 x forward        (5 matmuls to the forward's 2; flash-attn's convention)
    forward + backward 3.5 x forward

Every candidate is charged the same useful FLOPs, so SDPA's work on masked-out pairs
counts for nothing. The peak is an 8192^3 GEMM in the same dtype timed here (2 n^3
FLOPs); "% peak" is the achieved TFLOP/s over it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import ms_kernels
from ms_kernels import (
    add_layer_norm,
    add_layer_norm_reference,
    add_rms_norm,
    add_rms_norm_reference,
    bias_gelu,
    bias_gelu_reference,
    layer_norm,
    layer_norm_reference,
    rms_norm,
    rms_norm_reference,
)

SCRIPT = "tools/bench/kernels/gpu_kernels.py"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NORM_SHAPES = [(4096, 1024), (8192, 4096), (16384, 8192), (4096, 12288)]  # tokens x hidden
# (batch, sequence, query heads, key/value heads, head dim)
ATTENTION_SHAPES = [
    (4, 2048, 16, 16, 128),
    (4, 4096, 32, 8, 128),
    (2, 4096, 32, 32, 64),
    (2, 8192, 32, 8, 128),
    (1, 8192, 16, 16, 64),
    (1, 16384, 32, 8, 128),
    (1, 16384, 16, 2, 64),
]
WINDOWS: list[int | None] = [None, 512, 4096]  # tokens; None: full causal
SMOKE_NORM_SHAPES = [(64, 256)]
SMOKE_ATTENTION_SHAPES = [(1, 128, 4, 4, 32), (2, 96, 4, 2, 16)]
SMOKE_WINDOWS: list[int | None] = [None, 32]
L2_FLUSH_BYTES = 256 * 2**20  # beyond any GPU's L2 (H100: 50 MB)
COPY_BYTES, SMOKE_COPY_BYTES = 2**30, 4 * 2**20
GEMM_N, SMOKE_GEMM_N = 8192, 256
NORMS_TITLE = "## norms and activations"
ATTENTION_TITLE = "## sliding-window attention"
SMOKE_MARK = "smoke: not a measurement"

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


def _sync(device: torch.device) -> None:
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
    """Warm up every runnable candidate, then time them alternately, the order rotating.

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
            _sync(device)
        except Exception as exc:  # one failing candidate must not end a long run
            traceback.print_exc(file=sys.stderr)
            results[name].status = _failure(exc)
            del runnable[name]
            free_memory(device)
    for rep in range(reps):
        names = list(runnable)
        k = rep % len(names) if names else 0
        for name in names[k:] + names[:k]:
            try:
                results[name].times.append(timer(runnable[name]))
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                results[name].status = _failure(exc)
                del runnable[name]
                free_memory(device)
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


# --- norms and activations -------------------------------------------------------


@dataclass(frozen=True)
class NormOp:
    """One op of the norms section: its inputs, its two implementations, its bytes."""

    name: str
    inputs: tuple[str, ...]  # "x" and "residual" are (M, N); "weight" and "bias" (N,)
    ms: Callable[..., Sequence[torch.Tensor]]  # (*inputs, backend=...) -> outputs
    reference: Callable[..., Sequence[torch.Tensor]]  # (*inputs) -> outputs, eager torch
    fwd_bytes: tuple[int, int]  # minimum (M x N tensors, N vectors) the forward moves
    bwd_bytes: tuple[int, int]  # the same for the backward


NORM_OPS = [
    NormOp(
        "layer_norm",
        ("x", "weight", "bias"),
        lambda x, w, b, *, backend: (layer_norm(x, x.shape[-1:], w, b, backend=backend),),
        lambda x, w, b: (layer_norm_reference(x, x.shape[-1:], w, b),),
        (2, 2),
        (3, 3),
    ),
    NormOp(
        "add + layer_norm",
        ("x", "residual", "weight", "bias"),
        lambda x, r, w, b, *, backend: add_layer_norm(x, r, x.shape[-1:], w, b, backend=backend),
        lambda x, r, w, b: add_layer_norm_reference(x, r, x.shape[-1:], w, b),
        (4, 2),
        (4, 3),
    ),
    NormOp(
        "rms_norm",
        ("x", "weight"),
        lambda x, w, *, backend: (rms_norm(x, x.shape[-1:], w, backend=backend),),
        lambda x, w: (rms_norm_reference(x, x.shape[-1:], w),),
        (2, 1),
        (3, 2),
    ),
    NormOp(
        "add + rms_norm",
        ("x", "residual", "weight"),
        lambda x, r, w, *, backend: add_rms_norm(x, r, x.shape[-1:], w, backend=backend),
        lambda x, r, w: add_rms_norm_reference(x, r, x.shape[-1:], w),
        (4, 1),
        (4, 2),
    ),
    NormOp(
        "bias + gelu (erf)",
        ("x", "bias"),
        lambda x, b, *, backend: (bias_gelu(x, b, "none", backend=backend),),
        lambda x, b: (bias_gelu_reference(x, b, "none"),),
        (2, 1),
        (3, 2),
    ),
    NormOp(
        "bias + gelu (tanh)",
        ("x", "bias"),
        lambda x, b, *, backend: (bias_gelu(x, b, "tanh", backend=backend),),
        lambda x, b: (bias_gelu_reference(x, b, "tanh"),),
        (2, 1),
        (3, 2),
    ),
]


def norm_bytes(op: NormOp, pass_name: str, m: int, n: int, elem: int) -> int:
    parts = [op.fwd_bytes] + ([op.bwd_bytes] if pass_name == "fwd+bwd" else [])
    return sum((rows * m * n + vecs * n) * elem for rows, vecs in parts)


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal in fp32 on gen's device, then rounded to dtype."""
    return torch.randn(shape, generator=gen, device=gen.device).to(dtype)


def norm_inputs(
    op: NormOp, m: int, n: int, dtype: torch.dtype, gen: torch.Generator
) -> list[torch.Tensor]:
    made = {
        "x": lambda: _randn((m, n), gen, dtype),
        "residual": lambda: _randn((m, n), gen, dtype),
        "weight": lambda: 1 + 0.1 * _randn((n,), gen, dtype),
        "bias": lambda: 0.1 * _randn((n,), gen, dtype),
    }
    return [made[name]().requires_grad_() for name in op.inputs]


def norm_candidates(op: NormOp, on_cuda: bool) -> dict[str, Callable[..., Any] | str]:
    if not on_cuda:  # smoke on CPU: no Triton interpreter, no compile
        return {
            "ms (torch backend)": partial(op.ms, backend="torch"),
            "torch eager": op.reference,
            "torch.compile": "skipped: smoke without CUDA",
        }
    return {
        "ms triton": partial(op.ms, backend="triton"),
        "torch eager": op.reference,
        "torch.compile": torch.compile(op.reference, dynamic=False),
    }


def run_norms(
    args: argparse.Namespace, device: torch.device, timer: Timer, bandwidth: float
) -> list[dict[str, Any]]:
    shapes = SMOKE_NORM_SHAPES if args.smoke else NORM_SHAPES
    cases = [(op, s, d) for op in NORM_OPS for s in shapes for d in args.dtypes]
    records = []
    for i, (op, (m, n), dtype_name) in enumerate(cases):
        print(f"[norms {i + 1}/{len(cases)}] {op.name} {m}x{n} {dtype_name}", file=sys.stderr)
        torch._dynamo.reset()  # a fresh compile per case, never a recompile limit
        dtype = DTYPES[dtype_name]
        gen = torch.Generator(device).manual_seed(i)
        inputs = norm_inputs(op, m, n, dtype, gen)
        with torch.no_grad():
            outs = op.reference(*inputs)
        grads = [_randn(tuple(o.shape), gen, dtype) for o in outs]
        impls = norm_candidates(op, device.type == "cuda")
        for pass_name, make in PASSES.items():
            cands: dict[str, Candidate] = {
                k: v if isinstance(v, str) else make(v, inputs, grads) for k, v in impls.items()
            }
            results = compare(cands, timer, device, args.warmup, args.reps)
            nbytes = norm_bytes(op, pass_name, m, n, dtype.itemsize)
            records.append(
                {
                    "op": op.name,
                    "tokens": m,
                    "hidden": n,
                    "dtype": dtype_name,
                    "pass": pass_name,
                    "bytes": nbytes,
                    "floor_s": nbytes / bandwidth,
                    "candidates": summarize(results, nbytes, bandwidth),
                }
            )
        del inputs, outs, grads, impls, cands
        free_memory(device)
    return records


# --- attention -------------------------------------------------------------------


def attended_pairs(s: int, window: tuple[int | None, int | None] | None, causal: bool) -> int:
    """(query, key) pairs inside the window for sq = sk = s; None bounds are unbounded."""
    i = torch.arange(s, dtype=torch.int64)
    left, right = window if window is not None else (None, None)
    lo = (i - left).clamp(min=0) if left is not None else torch.zeros_like(i)
    hi = (i + right).clamp(max=s - 1) if right is not None else torch.full_like(i, s - 1)
    if causal:
        hi = torch.minimum(hi, i)
    return int((hi - lo + 1).clamp(min=0).sum())


def _flash_attn_func() -> Callable[..., torch.Tensor] | None:
    """flash-attn's flash_attn_func, or None when it is not installed (pip install flash-attn)."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func  # type: ignore[no-any-return]


def attention_candidates(
    swa: Callable[..., torch.Tensor],
    flash: Callable[..., torch.Tensor] | None,
    mask: torch.Tensor,
    window: tuple[int, int] | None,
    dtype: torch.dtype,
    groups: int,
    on_cuda: bool,
) -> dict[str, tuple[Callable[..., Sequence[torch.Tensor]], str] | str]:
    """Each candidate with the layout of its inputs: "bshd" (flash-attn's) or "bhsd" (SDPA's)."""
    backend = "triton" if on_cuda else "torch"

    def ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Sequence[torch.Tensor]:
        return (swa(q, k, v, window, causal=True, backend=backend),)

    def flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Sequence[torch.Tensor]:
        assert flash is not None
        size = (-1, -1) if window is None else window  # flash-attn's -1: unbounded
        return (flash(q, k, v, causal=True, window_size=size),)

    def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Sequence[torch.Tensor]:
        return (F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1),)

    def sdpa_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Sequence[torch.Tensor]:
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask),)

    flash_cand: tuple[Callable[..., Sequence[torch.Tensor]], str] | str
    if flash is None:
        flash_cand = "flash-attn not installed"
    elif not on_cuda:
        flash_cand = "skipped: flash-attn needs CUDA"
    elif dtype not in (torch.float16, torch.bfloat16):
        flash_cand = "skipped: flash-attn needs fp16/bf16"
    else:
        flash_cand = (flash_attn, "bshd")
    return {
        "ms triton" if on_cuda else "ms (torch backend)": (ms, "bshd"),
        "flash-attn": flash_cand,
        "SDPA causal (no window)": (sdpa_causal, "bhsd"),
        "SDPA + window mask": (sdpa_mask, "bhsd"),
    }


def run_attention(
    args: argparse.Namespace, device: torch.device, timer: Timer, peaks: dict[str, float]
) -> list[dict[str, Any]] | None:
    try:
        from ms_kernels import sliding_window_attention, window_mask
    except ImportError as exc:
        print(f"attention: skipped, ms_kernels has no sliding_window_attention yet ({exc})")
        return None
    flash = _flash_attn_func()
    shapes = SMOKE_ATTENTION_SHAPES if args.smoke else ATTENTION_SHAPES
    windows = SMOKE_WINDOWS if args.smoke else WINDOWS
    # A window as wide as the sequence is full causal attention again: not a new case.
    cases = [
        (shape, w, d)
        for shape in shapes
        for w in windows
        if w is None or w < shape[1]
        for d in args.dtypes
    ]
    records = []
    for i, ((b, s, hq, hkv, d), w, dtype_name) in enumerate(cases):
        label = f"{b}x{s}x{hq}/{hkv}x{d} {'causal' if w is None else f'W={w}'} {dtype_name}"
        print(f"[attention {i + 1}/{len(cases)}] {label}", file=sys.stderr)
        dtype = DTYPES[dtype_name]
        window = None if w is None else (w - 1, 0)
        gen = torch.Generator(device).manual_seed(i)

        bshd = [_randn((b, s, h, d), gen, dtype).requires_grad_() for h in (hq, hkv, hkv)]
        bshd_grads = [_randn((b, s, hq, d), gen, dtype)]
        # SDPA gets its own contiguous (B, H, S, D) copies, so no candidate times a transpose.
        bhsd = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in bshd]
        bhsd_grads = [g.transpose(1, 2).contiguous() for g in bshd_grads]
        layouts = {"bshd": (bshd, bshd_grads), "bhsd": (bhsd, bhsd_grads)}
        mask = window_mask(s, s, window, causal=True, device=device)
        impls = attention_candidates(
            sliding_window_attention, flash, mask, window, dtype, hq // hkv, device.type == "cuda"
        )
        pairs = attended_pairs(s, window, causal=True)
        if pairs != int(mask.sum()):  # the FLOP count must mean ms-kernels' window
            raise RuntimeError(
                f"window {window}: {pairs} pairs counted here, {int(mask.sum())} in window_mask"
            )
        flops_fwd = 4 * b * hq * d * pairs
        for pass_name, make in PASSES.items():
            cands: dict[str, Candidate] = {}
            for name, impl in impls.items():
                if isinstance(impl, str):
                    cands[name] = impl
                else:
                    fn, layout = impl
                    cands[name] = make(fn, *layouts[layout])
            results = compare(cands, timer, device, args.warmup, args.reps)
            flops = flops_fwd * (1 if pass_name == "fwd" else 3.5)
            records.append(
                {
                    "batch": b,
                    "seqlen": s,
                    "q_heads": hq,
                    "kv_heads": hkv,
                    "head_dim": d,
                    "window_tokens": w,
                    "window": window,
                    "causal": True,
                    "dtype": dtype_name,
                    "pass": pass_name,
                    "attended_pairs": pairs,
                    "flops": flops,
                    "peak_flop_per_s": peaks[dtype_name],
                    "candidates": summarize(results, flops, peaks[dtype_name]),
                }
            )
        del bshd, bshd_grads, bhsd, bhsd_grads, layouts, mask, impls, cands
        free_memory(device)
    return records


# --- floors, machine, tables -----------------------------------------------------


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
    a, b = (_randn((n, n), gen, dtype) for _ in range(2))
    for _ in range(warmup):
        torch.mm(a, b)
    _sync(device)
    times = [timer(lambda: torch.mm(a, b)) for _ in range(reps)]
    return 2 * n**3 / statistics.median(times), times


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi(uuid: str | None) -> dict[str, str]:
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


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": _version("triton"),
        "flash_attn": _version("flash-attn"),
        "ms_kernels": ms_kernels.__version__,
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        info |= {
            "gpu": props.name,
            "gpu_memory_bytes": props.total_memory,
            "sm_count": props.multi_processor_count,
            "compute_capability": f"{props.major}.{props.minor}",
            "cudnn": torch.backends.cudnn.version(),
            "nvidia_smi": _nvidia_smi(str(uuid) if uuid is not None else None),
        }
    return info


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


def norm_key(rec: dict[str, Any]) -> str:
    shape = f"{rec['tokens']}x{rec['hidden']}"
    return f"{rec['op']:18} {shape:11} {rec['dtype']:5} {rec['pass']:7}"


def attention_key(rec: dict[str, Any]) -> str:
    shape = f"{rec['batch']}x{rec['seqlen']}x{rec['q_heads']}/{rec['kv_heads']}x{rec['head_dim']}"
    window = "causal" if rec["window_tokens"] is None else f"W={rec['window_tokens']}"
    return f"{shape:18} {window:7} {rec['dtype']:5} {rec['pass']:7}"


# --- main ------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"must name dtypes from {', '.join(DTYPES)}, got {text!r}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=_positive, default=20, help="timed repetitions per candidate")
    ap.add_argument("--warmup", type=_positive, default=5, help="untimed calls first")
    ap.add_argument("--only", choices=("norms", "attention"), help="run one section")
    ap.add_argument("--dtypes", type=_dtypes, default=["bf16", "fp16"], help="e.g. bf16,fp16,fp32")
    ap.add_argument(
        "--out", type=Path, help="JSON path (default bench-results/gpu_kernels-<date>.json)"
    )
    ap.add_argument("--smoke", action="store_true", help="run every path once on tiny shapes")
    args = ap.parse_args(argv)

    if not args.smoke and not torch.cuda.is_available():
        print(f"no CUDA device: {SCRIPT} measures GPU kernels only; nothing measured")
        return 0
    if not args.smoke and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: Triton kernels would be interpreted; unset it to measure")
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.reps, args.warmup, args.dtypes = 1, 1, args.dtypes[:1]
        print(f"{SMOKE_MARK}: tiny shapes, one repetition, on {device}; no JSON written")
    date = datetime.datetime.now(datetime.timezone.utc)
    timer = Timer(device)
    copy_bytes = SMOKE_COPY_BYTES if args.smoke else COPY_BYTES
    bandwidth, copy_times = copy_bandwidth(device, copy_bytes, timer, args.reps)
    record: dict[str, Any] = {
        "benchmark": "gpu_kernels",
        "date": date.isoformat(timespec="seconds"),
        "machine": machine(device),
        "parameters": {
            "reps": args.reps,
            "warmup": args.warmup,
            "dtypes": args.dtypes,
            "only": args.only,
            "norm_shapes": NORM_SHAPES,
            "attention_shapes_b_s_hq_hkv_d": ATTENTION_SHAPES,
            "windows_tokens": WINDOWS,
            "l2_flush_bytes": L2_FLUSH_BYTES,
            "copy_bytes": copy_bytes,
            "gemm_n": GEMM_N,
            "timing": "CUDA events around one call, after an L2-evicting write",
            "flops_convention": "fwd 4*B*Hq*D*pairs in window; bwd 2.5x fwd",
        },
        "copy_bandwidth_bytes_per_s": [bandwidth],
        "copy_times_s": [copy_times],
    }
    smoke = f" [{SMOKE_MARK}]" if args.smoke else ""

    if args.only in (None, "norms"):
        norms = run_norms(args, device, timer, bandwidth)
        record["norms"] = norms
        print_table(
            f"{NORMS_TITLE}: ms-kernels vs torch eager vs torch.compile{smoke}\n"
            f"floor: copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write, "
            f"{copy_bytes / 2**20:.0f} MiB copy); GB/s counts the minimum bytes of each op",
            f"{'op':18} {'tokens x N':11} {'dtype':5} {'pass':7}",
            norms,
            norm_key,
            "GB/s",
            "% floor",
        )

    if args.only in (None, "attention"):
        n = SMOKE_GEMM_N if args.smoke else GEMM_N
        peak_runs = {
            d: matmul_peak(device, DTYPES[d], n, timer, args.warmup, args.reps) for d in args.dtypes
        }
        peaks = {d: p for d, (p, _) in peak_runs.items()}
        record["matmul_peak_flop_per_s"] = peaks
        record["matmul_times_s"] = {d: ts for d, (_, ts) in peak_runs.items()}
        attention = run_attention(args, device, timer, peaks)
        if attention is not None:
            record["attention"] = attention
            peak_text = ", ".join(f"{d} {p / 1e12:.1f}" for d, p in peaks.items())
            print_table(
                f"{ATTENTION_TITLE}: ms-kernels vs flash-attn vs torch SDPA{smoke}\n"
                f"peak: {n}^3 GEMM, TFLOP/s {peak_text}; TFLOP/s counts only in-window pairs "
                "(fwd 4*B*Hq*D*pairs, bwd 2.5x fwd)",
                f"{'B x S x Hq/Hkv x D':18} {'window':7} {'dtype':5} {'pass':7}",
                attention,
                attention_key,
                "TFLOP/s",
                "% peak",
            )
            print(
                "SDPA causal (no window) ignores the window: on W= rows it computes full causal "
                "attention, a different result."
            )

    bandwidth2, copy_times2 = copy_bandwidth(device, copy_bytes, timer, args.reps)  # drift
    print(f"\ncopy bandwidth before {bandwidth / 1e9:.1f} GB/s, after {bandwidth2 / 1e9:.1f} GB/s")
    if args.smoke:
        print(f"{SMOKE_MARK}; no JSON written")
        return 0
    record["copy_bandwidth_bytes_per_s"].append(bandwidth2)
    record["copy_times_s"].append(copy_times2)
    out = args.out or Path(f"bench-results/gpu_kernels-{date:%Y-%m-%d}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
