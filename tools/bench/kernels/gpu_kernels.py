"""ms-kernels on CUDA against its baselines: norms, bias + GeLU, sliding-window attention.

    .venv/bin/python tools/bench/kernels/gpu_kernels.py [--reps 20] [--warmup 5]
        [--only norms|attention] [--dtypes bf16,fp16] [--out PATH]
        [--norm-shapes 8192x4096,...] [--attention-shapes 4x4096x32x8x128,...]
        [--windows causal,512,...]
    .venv/bin/python tools/bench/kernels/gpu_kernels.py --smoke

Without a CUDA device it prints one line starting "no CUDA device" and exits 0,
measuring nothing and writing nothing. --smoke runs every code path once on tiny
shapes on whatever device there is (on CPU: the torch backends and eager baselines
only; no Triton interpreter, no torch.compile), prints the tables marked "smoke: not
a measurement" and writes no JSON; it exists so that the plumbing is tested
without a GPU.

How: one run, candidates side by side. For each case and pass (forward; forward +
backward, the latter timed as one call of forward then torch.autograd.grad), every
candidate warms up (Triton and torch.compile compile there), each runs once more
through the timer untimed (since 2026-11-27's H200 run, whose first repetitions were
the slowest), then each repetition times every candidate once, the order rotating.
Each timed call follows a 256 MiB write that evicts L2 (as triton.testing.do_bench
does) and is timed between CUDA events. Inputs are random normal, never zeros or
constants; memory is freed and torch.compile's caches are reset between cases.
Reported per candidate: median, spread (min-max) and t / t_ms, its median over
ms-kernels' median (> 1: ms is faster). JSON (default
bench-results/gpu_kernels-<date>.json) holds the machine, versions, parameters and
every repetition.

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
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from _gpu_harness import (
    L2_FLUSH_BYTES,
    PASSES,
    Candidate,
    Timer,
    compare,
    copy_bandwidth,
    free_memory,
    matmul_peak,
    nvidia_smi,
    positive,
    print_table,
    randn,
    shapes_parser,
    summarize,
    version,
    window_list,
)

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
COPY_BYTES, SMOKE_COPY_BYTES = 2**30, 4 * 2**20
GEMM_N, SMOKE_GEMM_N = 8192, 256
NORMS_TITLE = "## norms and activations"
ATTENTION_TITLE = "## sliding-window attention"
SMOKE_MARK = "smoke: not a measurement"


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


def norm_inputs(
    op: NormOp, m: int, n: int, dtype: torch.dtype, gen: torch.Generator
) -> list[torch.Tensor]:
    made = {
        "x": lambda: randn((m, n), gen, dtype),
        "residual": lambda: randn((m, n), gen, dtype),
        "weight": lambda: 1 + 0.1 * randn((n,), gen, dtype),
        "bias": lambda: 0.1 * randn((n,), gen, dtype),
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
    shapes = SMOKE_NORM_SHAPES if args.smoke else args.norm_shapes
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
        grads = [randn(tuple(o.shape), gen, dtype) for o in outs]
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
        return (swa(q, k, v, window=window, causal=True, backend=backend),)

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
    shapes = SMOKE_ATTENTION_SHAPES if args.smoke else args.attention_shapes
    windows = SMOKE_WINDOWS if args.smoke else args.windows
    # A window as wide as the sequence is full causal attention again: not a new case.
    cases = [
        (shape, w, d)
        for shape in shapes
        for w in windows
        if w is None or w < shape[1]
        for d in args.dtypes
    ]
    dropped = sorted({w for w in windows if w is not None for sh in shapes if w >= sh[1]})
    if dropped:  # as wide as the sequence: full causal attention again, not a new case
        print(f"attention: windows {dropped} skipped where they cover the whole sequence")
    records = []
    for i, ((b, s, hq, hkv, d), w, dtype_name) in enumerate(cases):
        label = f"{b}x{s}x{hq}/{hkv}x{d} {'causal' if w is None else f'W={w}'} {dtype_name}"
        print(f"[attention {i + 1}/{len(cases)}] {label}", file=sys.stderr)
        dtype = DTYPES[dtype_name]
        window = None if w is None else (w - 1, 0)
        gen = torch.Generator(device).manual_seed(i)

        bshd = [randn((b, s, h, d), gen, dtype).requires_grad_() for h in (hq, hkv, hkv)]
        bshd_grads = [randn((b, s, hq, d), gen, dtype)]
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


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "triton": version("triton"),
        "flash_attn": version("flash-attn"),
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
            "nvidia_smi": nvidia_smi(str(uuid) if uuid is not None else None),
        }
    return info


def norm_key(rec: dict[str, Any]) -> str:
    shape = f"{rec['tokens']}x{rec['hidden']}"
    return f"{rec['op']:18} {shape:11} {rec['dtype']:5} {rec['pass']:7}"


def attention_key(rec: dict[str, Any]) -> str:
    shape = f"{rec['batch']}x{rec['seqlen']}x{rec['q_heads']}/{rec['kv_heads']}x{rec['head_dim']}"
    window = "causal" if rec["window_tokens"] is None else f"W={rec['window_tokens']}"
    return f"{shape:18} {window:7} {rec['dtype']:5} {rec['pass']:7}"


# --- main ------------------------------------------------------------------------


def _dtypes(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in DTYPES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"must name dtypes from {', '.join(DTYPES)}, got {text!r}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=positive, default=20, help="timed repetitions per candidate")
    ap.add_argument("--warmup", type=positive, default=5, help="untimed calls first")
    ap.add_argument("--only", choices=("norms", "attention"), help="run one section")
    ap.add_argument("--dtypes", type=_dtypes, default=["bf16", "fp16"], help="e.g. bf16,fp16,fp32")
    ap.add_argument(
        "--out", type=Path, help="JSON path (default bench-results/gpu_kernels-<date>.json)"
    )
    ap.add_argument(
        "--norm-shapes",
        type=shapes_parser(2, "tokens x hidden"),
        default=NORM_SHAPES,
        help="norm cases, e.g. 8192x4096,16384x8192 (default: %(default)s)",
    )
    ap.add_argument(
        "--attention-shapes",
        type=shapes_parser(5, "batch x seq x q heads x kv heads x head dim"),
        default=ATTENTION_SHAPES,
        help="attention cases, e.g. 4x4096x32x8x128 (default: %(default)s)",
    )
    ap.add_argument(
        "--windows",
        type=window_list,
        default=WINDOWS,
        help="attention windows in tokens or 'causal', e.g. causal,512 (default: %(default)s)",
    )
    ap.add_argument("--smoke", action="store_true", help="run every path once on tiny shapes")
    args = ap.parse_args(argv)
    for b, s, hq, hkv, d in args.attention_shapes:
        if hq % hkv:
            ap.error(
                f"--attention-shapes: query heads must be a multiple of key/value heads, "
                f"got {b}x{s}x{hq}x{hkv}x{d} ({hq} query heads, {hkv} key/value heads)"
            )

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
            "norm_shapes": args.norm_shapes,
            "attention_shapes_b_s_hq_hkv_d": args.attention_shapes,
            "windows_tokens": args.windows,
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
