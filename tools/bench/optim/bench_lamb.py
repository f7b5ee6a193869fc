"""Step time of LAMB on a GPT-like set of tensors, on CPU, against its baselines.

    .venv/bin/python tools/bench/optim/bench_lamb.py [--reps 9] [--out PATH]

Target: ms Lamb's default (``impl="auto"``) is faster than every peer's default
way of running LAMB here (a per-parameter loop, as torch-optimizer and timm's
single-tensor path run it) and than ms's own eager foreach path. AdamW is there
for scale, like with like: eager foreach AdamW against ms's eager foreach LAMB,
fused and ``torch.compile``d AdamW against ms's compiled LAMB (the default on a
CPU with a C++ compiler).

Candidates alternate within each repetition (the order rotates), each on its own
copy of the same parameters and gradients. Reported: median step time, spread
(min-max), ratio to ms Lamb's default, the warm-up time of the first two steps
(state allocation, and compilation for the compiled candidates: inductor caches
on disk, so a second run compiles faster), and the distance to the memory floor:
a LAMB (or Adam) step must read and write w, m, v and read g, at
least 7 x 4 bytes per fp32 parameter, so the floor is those bytes over this
machine's copy bandwidth (measured here with a large tensor copy, counting read
plus write). Peak extra memory of one step (beyond parameters, gradients and
optimizer state) is measured in a subprocess per candidate from the kernel's
high-water mark of resident memory (/proc/self/status VmHWM after clear_refs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

import ms_optim
from ms_optim import Lamb
from ms_testing.bench import machine_info, reset_peak, run_probe, vm_bytes

BYTES_PER_PARAM = 7 * 4  # read w, g, m, v; write w, m, v (fp32)


def gpt_shapes(
    vocab: int = 32000, d: int = 512, layers: int = 14, ctx: int = 1024
) -> list[tuple[int, ...]]:
    """A GPT-2-style mix: two embeddings, per layer 4 matrices, their biases, 2 LayerNorms."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]  # ln1, qkv, proj
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]  # ln2, mlp
    shapes += [(d,), (d,)]  # final LayerNorm; the head is tied to the embedding
    return shapes


class LoopLamb(torch.optim.Optimizer):
    """A straightforward per-parameter LAMB, as written by hand in many projects."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["m"] = torch.zeros_like(p)
                    st["v"] = torch.zeros_like(p)
                st["step"] += 1
                m, v, t = st["m"], st["v"], st["step"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt_().add_(group["eps"]))
                u.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), u.norm()
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                p.sub_(u.mul_(ratio * group["lr"]))


class Stepper(Protocol):
    def step(self) -> object: ...


class CompiledStep:
    """An optimizer whose ``step`` runs under ``torch.compile`` (torch's recipe for
    compiling an optimizer: one graph for the whole step)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt
        self._step = torch.compile(opt.step, fullgraph=False)

    def step(self) -> object:
        return self._step()


DEFAULT = "ms Lamb default (auto)"
CANDIDATES: dict[str, Callable[[list[torch.Tensor]], Stepper]] = {
    DEFAULT: lambda ps: Lamb(ps),
    "ms Lamb compiled": lambda ps: Lamb(ps, impl="compiled"),
    "ms Lamb foreach": lambda ps: Lamb(ps, impl="foreach"),
    "per-parameter loop LAMB": lambda ps: LoopLamb(ps),
    "AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
    "AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True),
    "AdamW torch.compile'd step": lambda ps: CompiledStep(torch.optim.AdamW(ps, foreach=False)),
}


def make_params(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = (torch.randn(s, generator=gen) * 0.02).requires_grad_()
        p.grad = torch.randn(s, generator=gen) * 1e-3  # never zeros or constants
        params.append(p)
    return params


def copy_bandwidth(reps: int) -> tuple[float, list[float]]:
    """Bytes per second moved by a large tensor copy (read + write), median of reps."""
    n = 64 * 2**20  # 256 MiB per buffer, far beyond any cache
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * 4 * n / statistics.median(times), times


def peak_extra(name: str) -> int:
    """Run in a subprocess: transient bytes one step needs beyond params, grads, state."""
    params = make_params(gpt_shapes())
    opt = CANDIDATES[name](params)
    for _ in range(2):  # allocate state, compile
        opt.step()
    before = reset_peak()
    opt.step()
    return vm_bytes("VmHWM") - before


def measure_peaks() -> dict[str, int | None]:
    peaks: dict[str, int | None] = {}
    for name in CANDIDATES:
        line = run_probe([__file__, "--peak-of", name])
        peaks[name] = None if line is None else int(line)
    return peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path("bench-results/optim/bench_lamb.json"))
    ap.add_argument("--peak-of", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peak_of:
        print(peak_extra(args.peak_of))
        return

    shapes = gpt_shapes()
    n_params = sum(torch.Size(s).numel() for s in shapes)
    threads = torch.get_num_threads()
    load_before = os.getloadavg()
    print(f"{len(shapes)} tensors, {n_params / 1e6:.1f}M parameters, {threads} threads")
    print(f"load average before: {load_before[0]:.2f} (1 min), {os.cpu_count()} cores")
    opts = {}
    warm_up: dict[str, float] = {}
    for name, make in CANDIDATES.items():
        opts[name] = make(make_params(shapes))
        t0 = time.perf_counter()
        for _ in range(2):  # warm-up: state allocation, torch.compile
            opts[name].step()
        warm_up[name] = time.perf_counter() - t0
        print(f"  warmed up {name} in {warm_up[name]:.1f}s")

    bandwidth, copy_times = copy_bandwidth(args.reps)
    times: dict[str, list[float]] = {name: [] for name in CANDIDATES}
    names = list(CANDIDATES)
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - t0)
    bandwidth2, copy_times2 = copy_bandwidth(args.reps)  # drift check
    # Another busy process makes OpenMP regions cost milliseconds each (libgomp's
    # threads spin at barriers for a thread that is not scheduled): record the load.
    load_after = os.getloadavg()
    del opts
    peaks = measure_peaks()

    floor = BYTES_PER_PARAM * n_params / bandwidth
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = median[DEFAULT]
    print(
        f"\ncopy bandwidth {bandwidth / 1e9:.2f} GB/s (after: {bandwidth2 / 1e9:.2f}); "
        f"memory floor of a step {floor * 1e3:.1f} ms; load average after: {load_after[0]:.2f}"
    )
    header = (
        f"{'candidate':28} {'median ms':>10} {'min-max ms':>15} {'/ floor':>8} "
        f"{'/ default':>10} {'peak extra MB':>14} {'warm-up s':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, ts in times.items():
        peak = peaks[name]
        print(
            f"{name:28} {median[name] * 1e3:10.1f} "
            f"{min(ts) * 1e3:7.1f}-{max(ts) * 1e3:<7.1f} {median[name] / floor:8.2f} "
            f"{median[name] / base:10.2f} {'n/a' if peak is None else f'{peak / 2**20:.0f}':>14} "
            f"{warm_up[name]:10.1f}"
        )
    state_mb = 2 * 4 * n_params / 2**20
    print(
        f"(optimizer state: {state_mb:.0f} MB for every candidate; params and grads "
        f"{2 * 4 * n_params / 2**20:.0f} MB)"
    )

    record = {
        "benchmark": "bench_lamb",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(ms_optim=ms_optim.__version__),
        "parameters": {
            "shapes": shapes,
            "n_params": n_params,
            "reps": args.reps,
            "bytes_per_param_floor": BYTES_PER_PARAM,
        },
        "load_average_1_5_15_min": {"before": load_before, "after": load_after},
        "copy_bandwidth_bytes_per_s": [bandwidth, bandwidth2],
        "copy_times_s": [copy_times, copy_times2],
        "floor_s": floor,
        "step_times_s": times,
        "median_s": median,
        "ratio_to_floor": {n: m / floor for n, m in median.items()},
        "peak_extra_bytes": peaks,
        "warm_up_s": warm_up,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
