"""Sliding-window attention on CPU: ms-kernels' chunked torch path against SDPA with a mask.

    .venv/bin/python tools/bench/kernels/cpu_attention.py [--seq 8192] [--window 512] [--reps 5]

Both candidates compute the same thing: causal attention over a Hugging Face style
window of W tokens (``hf_window(W)`` = ``(W - 1, 0)``), fp32, batch 1, 8 heads of
64. The baseline is ``F.scaled_dot_product_attention`` with a full ``(S, S)``
boolean mask, the usual way to get a window out of SDPA; its mask is built once,
outside the timed region (a model reuses it across layers), but it is resident,
so it counts toward peak memory. For scale, a third row shows SDPA's causal
attention without any window: different (wider) math, O(S^2) compute, but no mask.

Time: forward, and forward + backward, median of ``--reps`` repetitions in which
the candidates alternate (the order rotates). Peak memory: the resident
high-water mark above the inputs, in a fresh process per case (see
``ms_testing.bench``). It includes what every candidate must hold (the output,
and for forward + backward also the upstream gradient and the gradients of q, k and
v): that is the floor, and peak minus floor is the working memory of each method.
The two outputs are compared first, so no case times wrong math.
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
CANDIDATES = ("ms chunked (torch)", "SDPA + bool mask", "SDPA causal, no window")
MODES = ("fwd", "fwd+bwd")


def make_inputs(seq: int, grad: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen).requires_grad_(grad) for _ in range(3)
    )


def candidate(name: str, seq: int, window: int) -> Callable[..., torch.Tensor]:
    """The attention call of ``name``, taking and returning (B, S, H, D) tensors."""
    if name == "ms chunked (torch)":
        win = hf_window(window)
        return lambda q, k, v: sliding_window_attention(q, k, v, win, backend="torch")
    if name == "SDPA + bool mask":
        mask = window_mask(seq, seq, hf_window(window))

        def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2)

        return masked

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)

    return causal


def step(fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], mode: str) -> None:
    out = fn(*inputs)
    if mode == "fwd+bwd":
        out.backward(torch.ones_like(out))
        for t in inputs:
            t.grad = None


def peak_of(name: str, mode: str, seq: int, window: int) -> int:
    """Run in a fresh process: resident peak above the inputs for one call."""
    inputs = make_inputs(seq, grad=mode == "fwd+bwd")
    fn = candidate(name, seq, window)
    step(fn, inputs, mode)  # warm-up: one-time allocations of the library
    before = reset_peak()
    out = fn(*inputs)
    if mode == "fwd+bwd":
        out.backward(torch.ones_like(out))
    return vm_bytes("VmHWM") - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--window", type=int, default=512, help="HF-style window, in tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench-results/kernels/cpu_attention.json"))
    ap.add_argument("--peak-of", nargs=2, metavar=("CANDIDATE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_of:
        print(peak_of(args.peak_of[0], args.peak_of[1], args.seq, args.window))
        return

    seq, window = args.seq, args.window
    print(f"S={seq}, window {window} tokens {hf_window(window)}, {HEADS} heads x {HEAD_DIM}, fp32")
    fns = {name: candidate(name, seq, window) for name in CANDIDATES}

    # Correctness first: the chunked path and masked SDPA must agree, values and grads.
    q, k, v = make_inputs(seq, grad=True)
    outs, grads = {}, {}
    for name in CANDIDATES[:2]:
        out = fns[name](q, k, v)
        grads[name] = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        outs[name] = out.detach()
    a, b = CANDIDATES[:2]
    max_diff = max(
        (outs[a] - outs[b]).abs().max().item(),
        *((ga - gb).abs().max().item() for ga, gb in zip(grads[a], grads[b], strict=True)),
    )
    print(f"max |difference| chunked vs masked SDPA (output and grads): {max_diff:.2e}")
    del outs, grads, q, k, v

    times: dict[str, dict[str, list[float]]] = {m: {n: [] for n in CANDIDATES} for m in MODES}
    for mode in MODES:
        inputs = make_inputs(seq, grad=mode == "fwd+bwd", seed=1)
        for name in CANDIDATES:  # warm-up
            step(fns[name], inputs, mode)
        for rep in range(args.reps):
            for name in CANDIDATES[rep % 3 :] + CANDIDATES[: rep % 3]:
                t0 = time.perf_counter()
                step(fns[name], inputs, mode)
                times[mode][name].append(time.perf_counter() - t0)
    del fns

    peaks: dict[str, dict[str, int | None]] = {m: {} for m in MODES}
    for mode in MODES:
        for name in CANDIDATES:
            line = run_probe([__file__, "--seq", str(seq), "--window", str(window),
                              "--peak-of", name, mode])  # fmt: skip
            peaks[mode][name] = None if line is None else int(line)

    act_bytes = seq * HEADS * HEAD_DIM * 4
    floors = {"fwd": act_bytes, "fwd+bwd": 5 * act_bytes}  # out; out, dout, dq, dk, dv
    header = (
        f"{'mode':8} {'candidate':24} {'median ms':>10} {'min-max ms':>15} {'time / ms':>10} "
        f"{'peak MiB':>9} {'peak / ms':>10} {'working MiB':>12} {'work / ms':>10}"
    )
    print(header)
    print("-" * len(header))
    summary: dict[str, Any] = {}
    for mode in MODES:
        ms_time = statistics.median(times[mode][CANDIDATES[0]])
        ms_peak = peaks[mode][CANDIDATES[0]]
        for name in CANDIDATES:
            ts, peak = times[mode][name], peaks[mode][name]
            med = statistics.median(ts)
            peak_mib = work_mib = peak_ratio = work_ratio = "n/a"
            if peak is not None and ms_peak:
                work, ms_work = peak - floors[mode], ms_peak - floors[mode]
                peak_mib, work_mib = f"{peak / 2**20:.0f}", f"{work / 2**20:.0f}"
                peak_ratio = f"{peak / ms_peak:.1f}x"
                work_ratio = f"{work / ms_work:.1f}x" if ms_work > 0 else "n/a"
            print(
                f"{mode:8} {name:24} {med * 1e3:10.0f} {min(ts) * 1e3:7.0f}-{max(ts) * 1e3:<7.0f} "
                f"{med / ms_time:9.2f}x {peak_mib:>9} {peak_ratio:>10} {work_mib:>12} "
                f"{work_ratio:>10}"
            )
            summary.setdefault(mode, {})[name] = {"median_s": med, "peak_bytes": peak}
        print(f"{'':8} (floor held by every candidate: {floors[mode] / 2**20:.0f} MiB)")

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
        },
        "max_abs_difference": max_diff,
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
