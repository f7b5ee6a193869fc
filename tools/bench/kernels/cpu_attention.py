"""Sliding-window attention on CPU: ms-kernels' chunked torch path against SDPA and FlexAttention.

    .venv/bin/python tools/bench/kernels/cpu_attention.py [--seq 8192] [--window 512] [--reps 5]
        [--threads N] [--out PATH]

Every candidate computes the same thing: causal attention over a Hugging Face style
window of W tokens (``hf_window(W)`` = ``(W - 1, 0)``), fp32, batch 1, 8 heads of
64. Peers:

- ``F.scaled_dot_product_attention`` with a full ``(S, S)`` boolean mask, the usual
  way to get a window out of SDPA; its mask is built once, outside the timed region
  (a model reuses it across layers), but it is resident, so it counts toward peak
  memory.
- FlexAttention (``torch.nn.attention.flex_attention``) with a sliding-window block
  mask from ``create_block_mask``: torch's own O(S*W) path, which skips the blocks
  outside the band. It runs compiled (``torch.compile``; eager FlexAttention is a
  reference implementation), the block mask is built once outside the timed region,
  and the compile happens in the warm-up. On CPU, torch 2.13's FlexAttention has no
  backward ("does not support backward on CPU"), so it appears in the forward only.
  ms-kernels runs eager: the comparison favours FlexAttention in that respect.
- For scale, SDPA's causal attention without any window: different (wider) math,
  O(S^2) compute, but no mask.

Time: forward, and forward + backward with a random upstream gradient, median of
``--reps`` repetitions in which the candidates alternate (the order rotates).

FLOP floor: the band's matmul FLOPs at this machine's measured fp32 matmul rate
(median of a few 2048^3 products, run before the candidates). The forward does
``4 * P * H * D`` FLOPs (``Q K^T`` and ``P V``), with ``P`` the (query, key) pairs inside
the window (about S * W); the backward 2.5 times that (five products to the forward's
two; flash-attn's convention). "x floor" is each median over that floor.

Peak memory: the resident high-water mark above the inputs, in a fresh process per
case (see ``ms_testing.bench``). It includes what every candidate must hold (the
output, and for forward + backward also the upstream gradient and the gradients of q,
k and v): that is the floor, and peak minus floor is the working memory of each
method. The outputs are compared first, so no case times wrong math.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import ms_kernels
from ms_kernels import hf_window, sliding_window_attention, window_mask
from ms_testing.bench import machine_info, reset_peak, run_probe, vm_bytes

HEADS, HEAD_DIM = 8, 64
MS, SDPA_MASK, FLEX, SDPA_CAUSAL = (
    "ms chunked (torch)",
    "SDPA + bool mask",
    "FlexAttention (compiled)",
    "SDPA causal, no window",
)
CANDIDATES = (MS, SDPA_MASK, FLEX, SDPA_CAUSAL)
MODES = ("fwd", "fwd+bwd")
# FlexAttention has no backward on CPU in torch 2.13.
RUNS_IN = {"fwd": CANDIDATES, "fwd+bwd": (MS, SDPA_MASK, SDPA_CAUSAL)}
BACKWARD_FLOP_RATIO = 2.5


def make_inputs(seq: int, grad: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad when ``grad``) and a random upstream gradient."""
    gen = torch.Generator().manual_seed(seed)
    qkv = tuple(
        torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).requires_grad_(grad) for _ in range(3)
    )
    return (*qkv, torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen))


def candidate(name: str, seq: int, window: int) -> Callable[..., torch.Tensor]:
    """The attention call of ``name``, taking and returning (B, S, H, D) tensors."""
    if name == MS:
        win = hf_window(window)
        return lambda q, k, v: sliding_window_attention(q, k, v, window=win, backend="torch")
    if name == SDPA_MASK:
        mask = window_mask(seq, seq, hf_window(window))

        def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2)

        return masked
    if name == FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def in_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        block_mask = create_block_mask(in_window, None, None, seq, seq, device="cpu")
        compiled = torch.compile(flex_attention)

        def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            out: torch.Tensor = compiled(qh, kh, vh, block_mask=block_mask)
            return out.transpose(1, 2)

        return flex

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)

    return causal


def step(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], mode: str) -> None:
    q, k, v, dout = inputs
    out = fn(q, k, v)
    if mode == "fwd+bwd":
        out.backward(dout)
        for t in (q, k, v):
            t.grad = None


def peak_of(name: str, mode: str, seq: int, window: int) -> int:
    """Run in a fresh process: resident peak above the inputs for one call."""
    inputs = make_inputs(seq, grad=mode == "fwd+bwd")
    fn = candidate(name, seq, window)
    step(fn, inputs, mode)  # warm-up: one-time allocations (and compilation) of the library
    before = reset_peak()
    out = fn(*inputs[:3])
    if mode == "fwd+bwd":
        out.backward(inputs[3])
    return vm_bytes("VmHWM") - before


def matmul_flops_per_s(n: int = 2048, reps: int = 5) -> float:
    """The machine's fp32 matmul rate: median over ``reps`` of an n^3 product."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    a @ b  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def band_pairs(seq: int, window: int) -> int:
    """(query, key) pairs inside a causal window of ``window`` tokens."""
    return int(window_mask(seq, seq, hf_window(window)).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512, help="HF-style window, in tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own choice); on a loaded machine "
        "2 threads can wait on each other at every op",
    )
    ap.add_argument("--out", type=Path, default=Path("bench-results/kernels/cpu_attention.json"))
    ap.add_argument("--peak-of", nargs=2, metavar=("CANDIDATE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.peak_of:
        print(peak_of(args.peak_of[0], args.peak_of[1], args.seq, args.window))
        return

    seq, window = args.seq, args.window
    print(f"S={seq}, window {window} tokens {hf_window(window)}, {HEADS} heads x {HEAD_DIM}, fp32")
    rate = matmul_flops_per_s()
    fwd_flops = 4 * band_pairs(seq, window) * HEADS * HEAD_DIM
    floor_s = {"fwd": fwd_flops / rate, "fwd+bwd": (1 + BACKWARD_FLOP_RATIO) * fwd_flops / rate}
    print(
        f"measured fp32 matmul rate {rate / 1e9:.1f} GFLOP/s; band FLOPs forward "
        f"{fwd_flops / 1e9:.2f} G: floor {floor_s['fwd'] * 1e3:.0f} ms forward, "
        f"{floor_s['fwd+bwd'] * 1e3:.0f} ms forward + backward"
    )
    fns = {name: candidate(name, seq, window) for name in CANDIDATES}

    # Correctness first: every windowed candidate agrees with the chunked path (values,
    # and gradients where the candidate has a backward).
    q, k, v, dout = make_inputs(seq, grad=True)
    ref_out = fns[MS](q, k, v)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    max_diff: dict[str, float] = {}
    for name in (SDPA_MASK, FLEX):
        if name in RUNS_IN["fwd+bwd"]:
            out = fns[name](q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), dout)
        else:
            # Detached: FlexAttention refuses inputs that require grad on CPU. This
            # call also compiles it, outside any timing.
            out = fns[name](q.detach(), k.detach(), v.detach())
            grads = ()
        diffs = [(out - ref_out).abs().max().item()]
        diffs += [(g - r).abs().max().item() for g, r in zip(grads, ref_grads, strict=False)]
        max_diff[name] = max(diffs)
        what = "output and grads" if grads else "output"
        print(f"max |difference| {name} vs chunked ({what}): {max_diff[name]:.2e}")
    del ref_out, ref_grads, q, k, v, dout

    times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in RUNS_IN[m]} for m in MODES}
    for mode in MODES:
        names = RUNS_IN[mode]
        inputs = make_inputs(seq, grad=mode == "fwd+bwd", seed=1)
        for name in names:  # warm-up
            step(fns[name], inputs, mode)
        for rep in range(args.reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                step(fns[name], inputs, mode)
                times[mode][name].append(time.perf_counter() - t0)
    del fns

    peaks: dict[str, dict[str, int | None]] = {m: {} for m in MODES}
    for mode in MODES:
        for name in RUNS_IN[mode]:
            threads = [] if args.threads is None else ["--threads", str(args.threads)]
            line = run_probe([__file__, "--seq", str(seq), "--window", str(window), *threads,
                              "--peak-of", name, mode])  # fmt: skip
            peaks[mode][name] = None if line is None else int(line)

    act_bytes = seq * HEADS * HEAD_DIM * 4
    floors = {"fwd": act_bytes, "fwd+bwd": 5 * act_bytes}  # out; out, dout, dq, dk, dv
    header = (
        f"{'mode':8} {'candidate':26} {'median ms':>10} {'min-max ms':>15} {'time / ms':>10} "
        f"{'x floor':>8} {'peak MiB':>9} {'peak / ms':>10} {'working MiB':>12} {'work / ms':>10}"
    )
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {}
    for mode in MODES:
        ms_time = statistics.median(times[mode][MS])
        ms_peak = peaks[mode][MS]
        for name in RUNS_IN[mode]:
            ts, peak = times[mode][name], peaks[mode][name]
            med = statistics.median(ts)
            peak_mib = work_mib = peak_ratio = work_ratio = "n/a"
            if peak is not None and ms_peak:
                work, ms_work = peak - floors[mode], ms_peak - floors[mode]
                peak_mib, work_mib = f"{peak / 2**20:.0f}", f"{work / 2**20:.0f}"
                peak_ratio = f"{peak / ms_peak:.1f}x"
                work_ratio = f"{work / ms_work:.1f}x" if ms_work > 0 else "n/a"
            print(
                f"{mode:8} {name:26} {med * 1e3:10.0f} {min(ts) * 1e3:7.0f}-{max(ts) * 1e3:<7.0f} "
                f"{med / ms_time:9.2f}x {med / floor_s[mode]:7.1f}x {peak_mib:>9} "
                f"{peak_ratio:>10} {work_mib:>12} {work_ratio:>10}"
            )
            summary.setdefault(mode, {})[name] = {
                "median_s": med,
                "over_flop_floor": med / floor_s[mode],
                "peak_bytes": peak,
            }
        print(
            f"{'':8} (FLOP floor {floor_s[mode] * 1e3:.0f} ms; memory floor held by every "
            f"candidate: {floors[mode] / 2**20:.0f} MiB)"
        )
    print(f"{'':8} FlexAttention: forward only (no backward on CPU in torch {torch.__version__})")

    record = {
        "benchmark": "cpu_attention",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(ms_kernels=ms_kernels.__version__),
        "parameters": {
            "seq": seq,
            "window_tokens": window,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "dtype": "float32",
            "reps": args.reps,
            "threads": torch.get_num_threads(),
            "upstream_gradient": "randn",
        },
        "matmul_flops_per_s": rate,
        "band_flops_forward": fwd_flops,
        "flop_floor_s": floor_s,
        "max_abs_difference_vs_chunked": max_diff,
        "times_s": times,
        "peak_bytes": peaks,
        "floor_bytes": floors,
        "summary": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
