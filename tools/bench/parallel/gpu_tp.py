"""ms's collective matmuls on GPUs over NCCL, beside torch's SymmetricMemory fused ops
and the unfused collective-then-GEMM, side by side in one run.

    .venv/bin/python tools/bench/parallel/gpu_tp.py [--world N] [--shapes S,H,F;...]
        [--dtype bfloat16] [--chunks 1,2,4,8] [--warmup 5] [--reps 30] [--out PATH]

Needs at least two CUDA devices on one host (``--world``, default: all of them, at most
8). Without a CUDA device it prints one line starting "no CUDA device" and exits 0;
with one device, one starting "one CUDA device" and exits 0: nothing is measured.

Each rank holds ``S / world`` rows of ``x`` (``S`` tokens, width ``H``) and
``F / world`` columns of the weights, in ``--dtype``. Per shape, two problems:

- **all-gather + matmul** (a column-parallel layer: ``all_gather(x) @ W1.T``,
  ``W1`` of ``(F / world, H)``): ms ``all_gather_matmul`` at each ``--chunks`` (all
  pieces issued at once, this rank's rows first); torch
  ``torch.ops.symm_mem.fused_all_gather_matmul`` (the op behind torch's async TP,
  on SymmetricMemory); unfused: ``all_gather_into_tensor``, then one GEMM.
- **matmul + reduce-scatter** (a row-parallel layer: ``reduce_scatter(h @ W2.T)``,
  ``h`` of ``(S, F / world)``): ms ``matmul_reduce_scatter`` at each count; torch
  ``torch.ops.symm_mem.fused_matmul_reduce_scatter``; unfused: one GEMM, then
  ``reduce_scatter_tensor``.

Forward only for torch's ops (they have no backward outside torch.compile's async TP);
ms's forward and backward are timed as well, beside the unfused forward and backward.
A call is timed between CUDA events on every rank; a repetition is the slowest rank's
time (all-reduce MAX); candidates alternate, the order rotating per repetition. The
table gives each candidate's median (min-max) and its ratio to torch's fused op and to
unfused, and the GEMM's share of the step (the GEMM alone, timed the same way).
Writes a JSON record to ``--out`` (default ``bench-results/parallel_gpu_tp.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SCRIPT = "gpu_tp.py"
DEFAULT_SHAPES = "8192,4096,16384;16384,8192,32768"


def _shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(";"):
        s, h, f = (int(v) for v in part.split(","))
        out.append((s, h, f))
    return out


def _time(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def _compare(
    cands: dict[str, Callable[[], object]], warmup: int, reps: int
) -> dict[str, list[float]]:
    names = list(cands)
    for fn in cands.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            took = torch.tensor([_time(cands[name])], device="cuda", dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[name].append(float(took.item()))
    return times


def _case(
    s: int, h: int, f: int, world: int, rank: int, comm: Any, name: str, args: dict[str, Any]
) -> dict[str, Any]:
    """Every candidate of one shape, timed."""
    from ms_parallel import all_gather_matmul, matmul_reduce_scatter

    dtype = getattr(torch, args["dtype"])
    gen = torch.Generator(device="cuda").manual_seed(rank)

    def randn(*shape: int, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)
        return t.requires_grad_(grad)

    x = randn(s // world, h)
    w1 = randn(f // world, h)
    hid = randn(s, f // world)
    w2 = randn(h, f // world)
    x_g, w1_g = randn(s // world, h, grad=True), randn(f // world, h, grad=True)
    hid_g, w2_g = randn(s, f // world, grad=True), randn(h, f // world, grad=True)
    gy1, gy2 = randn(s, f // world), randn(s // world, h)
    gathered = torch.empty(s, h, device="cuda", dtype=dtype)
    scattered = torch.empty(s // world, h, device="cuda", dtype=dtype)

    def ag_unfused() -> None:
        dist.all_gather_into_tensor(gathered, x)
        torch.matmul(gathered, w1.t())

    def rs_unfused() -> None:
        dist.reduce_scatter_tensor(scattered, torch.matmul(hid, w2.t()))

    ag: dict[str, Callable[[], object]] = {
        "torch symm_mem fused": lambda: torch.ops.symm_mem.fused_all_gather_matmul(
            x, [w1.t()], 0, name
        ),
        "unfused": ag_unfused,
        "GEMM alone": lambda: torch.matmul(gathered, w1.t()),
    }
    rs: dict[str, Callable[[], object]] = {
        "torch symm_mem fused": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
            hid, w2.t(), "sum", 0, name
        ),
        "unfused": rs_unfused,
        "GEMM alone": lambda: torch.matmul(hid, w2.t()),
    }
    ag_bwd: dict[str, Callable[[], object]] = {}
    rs_bwd: dict[str, Callable[[], object]] = {}
    for c in args["chunks"]:

        def ag_ms(c: int = c) -> None:
            with torch.no_grad():
                all_gather_matmul(x, w1, comm, chunks=c)

        def rs_ms(c: int = c) -> None:
            with torch.no_grad():
                matmul_reduce_scatter(hid, w2, comm, chunks=c)

        def ag_ms_bwd(c: int = c) -> None:
            y = all_gather_matmul(x_g, w1_g, comm, chunks=c)
            assert isinstance(y, torch.Tensor)
            torch.autograd.grad(y, [x_g, w1_g], gy1)

        def rs_ms_bwd(c: int = c) -> None:
            y = matmul_reduce_scatter(hid_g, w2_g, comm, chunks=c)
            torch.autograd.grad(y, [hid_g, w2_g], gy2)

        ag[f"ms fused, chunks={c}"] = ag_ms
        rs[f"ms fused, chunks={c}"] = rs_ms
        ag_bwd[f"ms fused, chunks={c}"] = ag_ms_bwd
        rs_bwd[f"ms fused, chunks={c}"] = rs_ms_bwd

    def ag_ref_bwd() -> None:
        y = all_gather_matmul(x_g, w1_g, comm, overlap=False)
        assert isinstance(y, torch.Tensor)
        torch.autograd.grad(y, [x_g, w1_g], gy1)

    def rs_ref_bwd() -> None:
        y = matmul_reduce_scatter(hid_g, w2_g, comm, overlap=False)
        torch.autograd.grad(y, [hid_g, w2_g], gy2)

    ag_bwd["unfused"], rs_bwd["unfused"] = ag_ref_bwd, rs_ref_bwd
    entry: dict[str, Any] = {"shape": {"S": s, "H": h, "F": f}, "failed": {}}
    for cands in (ag, rs):
        try:  # torch's ops need SymmetricMemory support of this GPU and driver
            cands["torch symm_mem fused"]()
            torch.cuda.synchronize()
        except Exception as exc:  # reported, and the run goes on without them
            entry["failed"]["torch symm_mem fused"] = f"{type(exc).__name__}: {exc}"[:200]
            del cands["torch symm_mem fused"]
    for label, cands in (
        ("all-gather + matmul, forward", ag),
        ("matmul + reduce-scatter, forward", rs),
        ("all-gather + matmul, forward + backward", ag_bwd),
        ("matmul + reduce-scatter, forward + backward", rs_bwd),
    ):
        entry[label] = _compare(cands, args["warmup"], args["reps"])
    return entry


def _rank(rank: int, world: int, args: dict[str, Any], port: int) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)})
    os.environ["WORLD_SIZE"] = str(world)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    from torch.distributed import _symmetric_memory as symm_mem

    from ms_parallel import TPComm

    group = dist.group.WORLD
    assert group is not None
    name = group.group_name
    symm_mem.enable_symm_mem_for_group(name)
    comm = TPComm(group)
    results = [_case(s, h, f, world, rank, comm, name, args) for s, h, f in args["shapes"]]
    if rank == 0:
        Path(args["result"]).write_text(json.dumps(results))
    dist.destroy_process_group()


def _print(results: list[dict[str, Any]], world: int) -> None:
    for entry in results:
        shp = entry["shape"]
        print(f"\nS {shp['S']}, H {shp['H']}, F {shp['F']}, {world} GPUs")
        for what, why in entry["failed"].items():
            print(f"  {what}: not measured ({why})")
        for label, times in entry.items():
            if label in ("shape", "failed"):
                continue
            med = {n: statistics.median(t) for n, t in times.items()}
            print(f"  {label}")
            print(f"    {'candidate':24} {'ms (min-max)':>22} {'/torch':>7} {'/unfused':>8}")
            for n, t in times.items():
                torch_t, ref_t = med.get("torch symm_mem fused"), med.get("unfused")
                over_torch = f"{med[n] / torch_t:7.3f}" if torch_t else f"{'-':>7}"
                over_ref = f"{med[n] / ref_t:8.3f}" if ref_t else f"{'-':>8}"
                print(
                    f"    {n:24} {1e3 * med[n]:8.3f} ({1e3 * min(t):.3f}-{1e3 * max(t):.3f})"
                    f" {over_torch} {over_ref}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=0, help="GPUs (default: all, at most 8)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="S,H,F;... (tokens, width, ffn)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="bench-results/parallel_gpu_tp.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"no CUDA device: {SCRIPT} measures NCCL collective matmuls only; nothing measured")
        return
    count = torch.cuda.device_count()
    if count < 2:
        print(f"one CUDA device: {SCRIPT} needs at least 2 on one host; nothing measured")
        return
    world = min(a.world or count, count, 8)
    shapes = _shapes(a.shapes)
    for s, _, f in shapes:
        if s % world or f % world:
            raise SystemExit(f"--shapes: S ({s}) and F ({f}) must divide by --world ({world})")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result_path = out.with_suffix(".ranks.json")
    args = {
        "shapes": shapes,
        "dtype": a.dtype,
        "chunks": [int(c) for c in a.chunks.split(",")],
        "warmup": a.warmup,
        "reps": a.reps,
        "result": str(result_path),
    }
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from torch.multiprocessing.spawn import spawn

    spawn(_rank, args=(world, args, port), nprocs=world, join=True)
    results = json.loads(result_path.read_text())
    result_path.unlink()
    _print(results, world)
    import ms_parallel

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "ms_parallel": ms_parallel.__version__,
        "gpus": [torch.cuda.get_device_name(i) for i in range(world)],
        "args": vars(a),
        "results": results,
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
