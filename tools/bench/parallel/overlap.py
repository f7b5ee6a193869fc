"""Data-parallel step time under injected network latency, over the compute-only step.

    .venv/bin/python tools/bench/parallel/overlap.py [--ranks 2] [--latency 0,block]
        [--network uniform|ring] [--rounds 3] [--steps 4] [--warmup 2] [--threads 1]
        [--out PATH] [--smoke]

On a 2-core CPU, loopback gloo is almost free and compute and communication share the
cores, so overlap cannot show by wall clock alone (BENCH.md). Here every collective runs
on ``ms_parallel.latency``'s backend: real gloo inside, each op completing no earlier
than its issue time + L. A data-parallel scheme that hides its communication behind
compute keeps its step time as L grows; one that waits on each op pays L per op.

``--ranks`` gloo ranks (spawned processes, ``ms_testing.run_ranks``), each with
``torch.set_num_threads(--threads)``, train the same model on their own batch: 8
pre-norm MLP blocks (``x + W2 gelu(W1 LayerNorm(x))``, width 512, hidden 2048, 16.8M
parameters, fp32), 1,024 random tokens (rows) per rank against random targets, MSE loss,
``AdamW(lr=1e-4, foreach=True)`` for every candidate. The candidates (``CANDIDATES``):

1. **compute only (floor)**: the plain model, no communication at all; the floor every
   data-parallel step sits on.
2. **ms ZeRO-2**: ``ms_parallel.ZeroDataParallel`` (a chunk per block, 25 MiB buckets),
   AdamW on its shard views, stepped through ``zero.step(opt)``: chunk by chunk in
   forward order, each chunk's all-gather issued as soon as its shard is updated, so
   the next step's first all-gather hides behind the rest of the optimizer step.
   **ms ZeRO-2, gathers after the whole step**: the same stepped with ``opt.step()``,
   every all-gather issued when the whole step ends (nothing hides the first one in a
   loop with nothing between steps). **ms ZeRO-2, first chunk replicated**: the
   default with ``replicated_chunks=1``: the first block's gradients all-reduced, its
   optimizer step on every rank, and no all-gather between the optimizer step and the
   first forward (DeepSpeed's persistence of small parameters). **ms ZeRO-2, first 3
   chunks replicated**: the same for the first three blocks (of the smoke model's two,
   both): before ms-parallel 0.3.0 their forward was what covered an L of three
   blocks' forward; since, the sharded chunks' update overlaps the replicated
   chunks' all-reduce and one replicated chunk covers it too. Every ms candidate
   but the one above steps through ``zero.step(opt)`` (the serialized one too, each
   chunk's all-gather waited right after its part of the step). **ms ZeRO-2, chain of
   1**: the same with
   ``prefetch_chunks=1`` (chunk k + 1's all-gather issued as chunk k starts, the
   paper's chain). **ms ZeRO-2, serialized**:
   ``prefetch=False``, every collective waited right after it is issued; overlapped /
   serialized is the overlap's effect with everything else equal.
3. **torch DDP**: ``DistributedDataParallel(model, process_group=<latency group>)``,
   torch's defaults (25 MiB buckets, all-reduce overlapped with backward).
4. **torch FSDP2 ZeRO-2**: ``fully_shard`` on each block and the root with
   ``reshard_after_forward=False`` (parameters stay gathered between forward and
   backward: ZeRO-2), on a 1-D ``DeviceMesh.from_group(<latency group>)``, with explicit
   prefetching: block i prefetches block i+1's all-gather in forward
   (``set_modules_to_forward_prefetch``) and block i-1's in backward
   (``set_modules_to_backward_prefetch``).
5. **torch FSDP2 ZeRO-2, async AG**: the same, with ``_set_unshard_async_op(True)``
   (private in torch 2.13). FSDP2 calls its collectives with ``async_op=False``, which on
   a GPU still runs them on a NCCL stream, asynchronous to the host, but on CPU gloo
   blocks the caller: candidate 3 cannot overlap anything here. This switch makes the
   (prefetched) all-gathers asynchronous; the reduce-scatters stay blocking on CPU (no
   switch exists), so FSDP2 on CPU is at a disadvantage a GPU would not give it.

A candidate is a function ``(model, comm, config) -> step``, where ``step(x, y)`` runs one
forward, backward and optimizer step; adding one is one function and one
entry in ``CANDIDATES``.

``--latency``: the sweep of L, comma separated: milliseconds, or ``block``: one block's
forward time on one rank's tokens, measured at start-up by every rank at once (median
of 15, the slowest rank's), the latency at which a scheme with one collective per block
must overlap to stay near the floor.

``--network``: how L applies to each op type. ``uniform`` (the default): every op takes
L, all-reduce included. ``ring``: an all-reduce takes 2L and every other op L, as on a
ring, where an all-reduce is a reduce-scatter followed by an all-gather (2(n-1) hops
against n-1): DDP's one all-reduce then costs what ZeRO's reduce-scatter and all-gather
cost together, as it does on a real network, where ``uniform`` charges it as one.

For each L, ``--rounds`` rounds; each round builds each candidate afresh (same seed),
runs ``--warmup`` untimed steps, then a gloo barrier (on the default group, without
latency) and ``--steps`` timed steps; candidates alternate within a round, the order
rotating from round to round. A repetition's step time is the slowest rank's time for
the timed steps over ``--steps``. Reported per L: median and min-max of the step time,
the ratio to the floor (the median over rounds of candidate / floor of the same
round, with min-max) and to torch DDP the same way, the collectives issued per step
and their bytes (this rank's input bytes, from the backend's event hook), and, for
L > 0 when L = 0 was swept too, the latency exposed per step: (median step at L -
median step at 0) / L, in units of L (for the floor, which communicates nothing, this
figure is the run's noise). For the ms candidates, also where the step waited: the time
per step spent waiting on each op type and stepping the optimizer, from the events
ms-parallel reports through its ``on_event`` hook (the most any rank spent, median over
rounds; ``docs/zero-critical-path.md`` in ms-parallel reads these).

Prints the tables per L and writes a JSON record (machine info, versions, parameters,
every repetition of every rank) to ``--out`` (default
``bench-results/parallel_overlap.json``). ``--smoke``: 2 blocks of width 128, 256 tokens,
1 round of 1 warm-up and 2 timed steps: a check that the script works (its numbers mean
nothing).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

import ms_parallel
from ms_parallel.events import EventLog
from ms_parallel.latency import register_latency_backend
from ms_parallel.zero import ZeroDataParallel
from ms_testing import run_ranks
from ms_testing.bench import machine_info

BACKEND = "bench_latency"
FLOOR = "compute only (floor)"
#: The peer every candidate is also set against, round by round.
PEER = "torch DDP"


@dataclass(frozen=True)
class BenchConfig:
    """The model, the data and the optimizer, the same for every candidate."""

    #: Pre-norm MLP blocks.
    blocks: int = 8
    #: Model width; the MLP's hidden width is 4x this.
    width: int = 512
    #: Tokens (rows) per rank and step.
    tokens: int = 1024
    lr: float = 1e-4
    seed: int = 0


@dataclass(frozen=True)
class Comm:
    """Where a candidate communicates: the latency group, a 1-D mesh over it, and the
    log that the backend (every candidate's collectives) and ms-parallel (its waits and
    optimizer steps) report to."""

    group: dist.ProcessGroup
    mesh: DeviceMesh
    log: EventLog


Step = Callable[[torch.Tensor, torch.Tensor], None]
Candidate = Callable[[nn.Sequential, Comm, BenchConfig], Step]


class Block(nn.Module):
    """``x + W2 gelu(W1 LayerNorm(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def make_model(config: BenchConfig) -> nn.Sequential:
    torch.manual_seed(config.seed)
    return nn.Sequential(*(Block(config.width) for _ in range(config.blocks)))


def make_optimizer(params: Any, config: BenchConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.lr, foreach=True)


def training_step(model: nn.Module, opt: torch.optim.Optimizer) -> Step:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def compute_only(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    return training_step(model, make_optimizer(model.parameters(), config))


def torch_ddp(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    ddp = DistributedDataParallel(model, process_group=comm.group)
    return training_step(ddp, make_optimizer(ddp.parameters(), config))


def torch_fsdp2_zero2(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    blocks = list(model)
    for block in blocks:
        fully_shard(block, mesh=comm.mesh, reshard_after_forward=False)
    fully_shard(model, mesh=comm.mesh, reshard_after_forward=False)
    sharded = [b for b in blocks if isinstance(b, FSDPModule)]
    for i, block in enumerate(sharded):
        if i + 1 < len(sharded):
            block.set_modules_to_forward_prefetch([sharded[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([sharded[i - 1]])
    return training_step(model, make_optimizer(model.parameters(), config))


def torch_fsdp2_zero2_async(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    step = torch_fsdp2_zero2(model, comm, config)
    # FSDP2 issues its all-gathers with async_op=False: on a GPU still asynchronous to
    # the host (NCCL runs on a stream), on CPU gloo a blocking wait, so no prefetch can
    # overlap. This switch (private in torch 2.13) issues them async and waits before
    # the block's forward. Its reduce-scatters stay blocking on CPU: no switch exists.
    assert isinstance(model, FSDPModule)
    model._set_unshard_async_op(True)
    return step


def zero_training_step(zero: ZeroDataParallel, opt: torch.optim.Optimizer) -> Step:
    """As :func:`training_step`, stepping through ``zero.step(opt)``: AdamW chunk by
    chunk, each chunk's all-gather issued as soon as its shard is updated."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        nn.functional.mse_loss(zero(x), y).backward()
        zero.step(opt)
        opt.zero_grad(set_to_none=True)

    return step


def zero_candidate(
    model: nn.Sequential, comm: Comm, config: BenchConfig, *, by_chunk: bool = True, **options: Any
) -> Step:
    """ms-parallel ZeRO-2 over ``model`` (a chunk per block) with ``options``, reporting
    its waits to the run's log; stepped by chunk (``zero.step(opt)``) or in one
    ``opt.step()``."""
    zero = ZeroDataParallel(model, comm.group, on_event=comm.log, **options)
    opt = zero.attach_optimizer(make_optimizer(zero.optimizer_param_groups(), config))
    return zero_training_step(zero, opt) if by_chunk else training_step(zero, opt)


def ms_zero2(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    """ms-parallel ZeRO-2: a chunk per block, reduce-scatter per bucket as its gradients
    are ready, the optimizer stepped chunk by chunk with each chunk's all-gather issued
    as its shard is updated, waited just before the chunk's next forward."""
    return zero_candidate(model, comm, config)


def ms_zero2_replicated1(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    """The same with the first chunk kept replicated: its gradients all-reduced as they
    are ready, no all-gather before the next step's first forward."""
    return zero_candidate(model, comm, config, replicated_chunks=1)


def ms_zero2_replicated3(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    """The same with the first three chunks replicated (all of them if the model has
    fewer): what covered an all-gather of L = three blocks' forward before ms-parallel
    0.3.0 overlapped the sharded chunks' update with the replicated all-reduce."""
    return zero_candidate(model, comm, config, replicated_chunks=min(3, config.blocks))


def ms_zero2_whole_step(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    """The same stepped with one ``opt.step()``: every all-gather issued after the whole
    optimizer step (ms-parallel 0.1's only way), none hidden behind it."""
    return zero_candidate(model, comm, config, by_chunk=False)


def ms_zero2_chain1(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    """The same with the paper's chain: chunk k + 1's all-gather issued as chunk k
    starts (the default gathers every chunk as the optimizer step ends)."""
    return zero_candidate(model, comm, config, prefetch_chunks=1)


def ms_zero2_serialized(model: nn.Sequential, comm: Comm, config: BenchConfig) -> Step:
    """The same, each collective waited right after it is issued: the serialized
    baseline the overlapped one is measured against."""
    return zero_candidate(model, comm, config, prefetch=False)


CANDIDATES: dict[str, Candidate] = {
    FLOOR: compute_only,
    "ms ZeRO-2": ms_zero2,
    "ms ZeRO-2, first chunk replicated": ms_zero2_replicated1,
    "ms ZeRO-2, first 3 chunks replicated": ms_zero2_replicated3,
    "ms ZeRO-2, gathers after the whole step": ms_zero2_whole_step,
    "ms ZeRO-2, chain of 1": ms_zero2_chain1,
    "ms ZeRO-2, serialized": ms_zero2_serialized,
    "torch DDP": torch_ddp,
    "torch FSDP2 ZeRO-2": torch_fsdp2_zero2,
    "torch FSDP2 ZeRO-2, async AG": torch_fsdp2_zero2_async,
}


def block_forward_s(config: BenchConfig) -> float:
    """One block's forward on one rank's tokens: the median of 15 after 2 warm-ups."""
    torch.manual_seed(config.seed + 1)
    block = Block(config.width)
    x = torch.randn(config.tokens, config.width)
    times = []
    with torch.no_grad():
        for i in range(17):
            t0 = time.perf_counter()
            block(x)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


#: ``--network``: each op type's latency as a multiple of L (``default``: every other).
NETWORKS: dict[str, dict[str, float]] = {
    "uniform": {"default": 1.0},
    "ring": {"default": 1.0, "all_reduce": 2.0},
}


def network_latencies(network: str, latency: float) -> dict[str, float]:
    """The latency of each op type under ``network`` for an L of ``latency`` seconds."""
    return {op: k * latency for op, k in NETWORKS[network].items()}


def resolve_latencies(spec: str, block_s: float) -> list[float]:
    """``ms`` values, ``block`` (one block's forward) or ``<k>block`` (k of them: ``3block``
    is about one block's forward and backward, a chunk's whole compute)."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if item.endswith("block"):
            out.append(float(item[: -len("block")] or 1) * block_s)
        else:
            out.append(float(item) / 1e3)
    return out


def run_candidate(
    name: str,
    comm: Comm,
    config: BenchConfig,
    data: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    warmup: int,
    log: EventLog,
) -> dict[str, Any]:
    """Build, warm up and time one candidate on this rank; every rank's figures back."""
    gc.collect()
    model = make_model(config)
    step = CANDIDATES[name](model, comm, config)
    for _ in range(warmup):
        step(*data)
    dist.barrier()  # the default group: plain gloo, no injected latency
    log.clear()
    times = []
    t0 = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        step(*data)
        times.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - t0
    # the backend's issues (ms-parallel reports its own too, without a latency)
    issued = [e for e in log.select(kind="issue") if "latency" in e.attrs]
    ops = Counter(e.name for e in issued)
    nbytes = sum(int(e.attrs["bytes"]) for e in issued)
    # what the backend applied, per op type: a check on --network
    applied = {e.name: float(e.attrs["latency"]) for e in issued}
    del step, model
    gc.collect()
    mine = {
        "waited_s_per_step": {k: v / steps for k, v in waited(log).items()},
        "elapsed_s": elapsed,
        "step_times_s": times,
        "ops": dict(ops),
        "bytes": nbytes,
        "latency_s_by_type": applied,
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {
        "step_s": max(r["elapsed_s"] for r in every) / steps,
        "per_rank": every,
        "collectives_per_step": sum(every[0]["ops"].values()) / steps,
        "collectives_by_type": {k: v / steps for k, v in every[0]["ops"].items()},
        "bytes_per_step": every[0]["bytes"] / steps,
        "latency_s_by_type": every[0]["latency_s_by_type"],
        # the most any rank waited, op type by op type
        "waited_s_per_step": per_op([r["waited_s_per_step"] for r in every], max),
    }


def per_op(
    figures: list[dict[str, float]], reduce: Callable[[list[float]], float]
) -> dict[str, float]:
    """Per-op-type figures of several ranks or rounds reduced to one per op type (an op
    type one of them lacks counts as 0 there)."""
    ops = sorted({op for f in figures for op in f})
    return {op: reduce([f.get(op, 0.0) for f in figures]) for op in ops}


def waited(log: EventLog) -> dict[str, float]:
    """Seconds ms-parallel spent waiting on each op type, and stepping the optimizer
    (``optimizer``), from its wait and compute events (none for the peers)."""
    out: dict[str, float] = {}
    begun: dict[tuple[str, Any, Any], float] = {}
    # the optimizer's chunks stepped in one call report one span each: count it once
    stepping: set[Any] = set()
    since = 0.0
    for e in log.events:
        if e.name == "optimizer" and e.kind in ("compute_begin", "compute_end"):
            chunk = e.attrs.get("chunk")
            if e.kind == "compute_begin":
                if not stepping:
                    since = e.t
                stepping.add(chunk)
            elif chunk in stepping:
                stepping.discard(chunk)
                if not stepping:
                    out["optimizer"] = out.get("optimizer", 0.0) + e.t - since
        elif e.kind in ("wait_begin", "wait_end"):
            key = (e.name, e.attrs.get("chunk"), e.attrs.get("bucket"))
            if e.kind == "wait_begin":
                begun[key] = e.t
            elif key in begun:
                out[e.name] = out.get(e.name, 0.0) + e.t - begun.pop(key)
    return out


def rank_main(
    config: dict[str, Any],
    spec: str,
    network: str,
    rounds: int,
    steps: int,
    warmup: int,
    threads: int,
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    cfg = BenchConfig(**config)
    log = EventLog()
    net = register_latency_backend(BACKEND, latency=0.0, on_event=log)
    group = dist.new_group(backend=BACKEND)
    assert group is not None
    comm = Comm(group, DeviceMesh.from_group(group, "cpu"), log)
    dist.barrier()  # every rank measures at once, after every rank's start-up
    measured = torch.tensor([block_forward_s(cfg)], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # one L for every rank: the slowest's
    block_s = float(measured.item())
    latencies = resolve_latencies(spec, block_s)
    g = torch.Generator().manual_seed(cfg.seed + 1000 + dist.get_rank())
    data = (
        torch.randn(cfg.tokens, cfg.width, generator=g),
        torch.randn(cfg.tokens, cfg.width, generator=g),
    )
    names = list(CANDIDATES)
    sweep = []
    for latency in latencies:
        net.set_latency(network_latencies(network, latency))
        reps: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                rep = run_candidate(name, comm, cfg, data, steps, warmup, log)
                rep["round"] = r
                reps[name].append(rep)
                if dist.get_rank() == 0:
                    print(
                        f"  L {latency * 1e3:6.1f} ms  round {r}  {name:34} "
                        f"{rep['step_s'] * 1e3:8.1f} ms/step",
                        flush=True,
                    )
        sweep.append({"latency_s": latency, "reps": reps})
    return {
        "block_forward_s": block_s,
        "parameters": sum(p.numel() for p in make_model(cfg).parameters()),
        "sweep": sweep,
    }


def summarize(sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per L and candidate: median, spread, ratio to the floor and exposed latency."""
    zero = next((s for s in sweep if s["latency_s"] == 0), None)
    out = []
    for s in sweep:
        floor = {rep["round"]: rep["step_s"] for rep in s["reps"][FLOOR]}
        peer = {rep["round"]: rep["step_s"] for rep in s["reps"].get(PEER, [])}
        rows = {}
        for name, reps in s["reps"].items():
            times = [rep["step_s"] for rep in reps]
            ratios = [rep["step_s"] / floor[rep["round"]] for rep in reps]
            to_peer = [rep["step_s"] / peer[rep["round"]] for rep in reps if rep["round"] in peer]
            median = statistics.median(times)
            exposed = None
            if zero is not None and s["latency_s"] > 0:
                at_zero = statistics.median(rep["step_s"] for rep in zero["reps"][name])
                exposed = (median - at_zero) / s["latency_s"]
            rows[name] = {
                "median_step_s": median,
                "min_step_s": min(times),
                "max_step_s": max(times),
                "ratio_to_floor": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "ratio_per_round": ratios,
                "ratio_to_ddp": statistics.median(to_peer) if to_peer else None,
                "ratio_to_ddp_min": min(to_peer, default=None),
                "ratio_to_ddp_max": max(to_peer, default=None),
                "collectives_per_step": reps[0]["collectives_per_step"],
                "collectives_by_type": reps[0]["collectives_by_type"],
                "bytes_per_step": reps[0]["bytes_per_step"],
                "latency_s_by_type": reps[0]["latency_s_by_type"],
                "waited_s_per_step": per_op(
                    [rep["waited_s_per_step"] for rep in reps], statistics.median
                ),
                "latency_exposed_per_step": exposed,
            }
        out.append({"latency_s": s["latency_s"], "candidates": rows})
    return out


def print_tables(summary: list[dict[str, Any]], head: str, block_s: float) -> None:
    for s in summary:
        latency = s["latency_s"]
        what = ""
        if latency > 0 and block_s > 0:
            k = latency / block_s
            if abs(k - round(k)) < 1e-9:
                what = (
                    " (one block's forward)"
                    if round(k) == 1
                    else f" ({round(k)} x one block's forward)"
                )
        print(f"\n### {head}, L = {latency * 1e3:.1f} ms per op{what}\n")
        print(
            "| candidate | ms/step (median) | min-max | / floor | min-max | / DDP | min-max "
            "| collectives/step | MiB/step | latency exposed/step |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, row in s["candidates"].items():
            exposed = row["latency_exposed_per_step"]
            to_ddp = (
                "- | -"
                if row["ratio_to_ddp"] is None
                else f"{row['ratio_to_ddp']:.3f} "
                f"| {row['ratio_to_ddp_min']:.3f}-{row['ratio_to_ddp_max']:.3f}"
            )
            print(
                f"| {name} | {row['median_step_s'] * 1e3:.1f} "
                f"| {row['min_step_s'] * 1e3:.1f}-{row['max_step_s'] * 1e3:.1f} "
                f"| {row['ratio_to_floor']:.3f} "
                f"| {row['ratio_min']:.3f}-{row['ratio_max']:.3f} | {to_ddp} "
                f"| {row['collectives_per_step']:.0f} | {row['bytes_per_step'] / 2**20:.1f} "
                f"| {'-' if exposed is None else f'{exposed:.2f} L'} |"
            )
        ops = sorted({op for row in s["candidates"].values() for op in row["waited_s_per_step"]})
        if ops:
            print(
                "\nWhere ms-parallel's step waits: ms per step waiting on each op type, and "
                "stepping the optimizer (median over rounds of the most any rank spent)\n"
            )
            print("| candidate | " + " | ".join(ops) + " |")
            print("|---|" + "---:|" * len(ops))
            for name, row in s["candidates"].items():
                if row["waited_s_per_step"]:
                    got = row["waited_s_per_step"]
                    cells = (f"{got[op] * 1e3:.1f}" if op in got else "-" for op in ops)
                    print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument(
        "--latency",
        default="0,block,3block",
        help="L per op: ms, 'block' (one block's forward) or '<k>block' (k of them)",
    )
    ap.add_argument(
        "--network",
        choices=list(NETWORKS),
        default="uniform",
        help="uniform: every op takes L; ring: an all-reduce takes 2L, every other op L",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per repetition")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per repetition")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", type=Path, default=Path("bench-results/parallel_overlap.json"))
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 1 round: checks the script")
    args = ap.parse_args()
    config = BenchConfig()
    if args.smoke:
        config = BenchConfig(blocks=2, width=128, tokens=256)
        args.rounds, args.steps, args.warmup = 1, 2, 1
        print("smoke: not a measurement")
    if args.ranks < 2 or args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        ap.error("--ranks must be >= 2, --rounds, --steps and --warmup >= 1")
    try:
        resolve_latencies(args.latency, 0.0)
    except ValueError:
        ap.error(f"--latency must be comma-separated ms values or 'block', got {args.latency!r}")
    if any(x < 0 for x in resolve_latencies(args.latency, 0.0)):
        ap.error(f"--latency values must be >= 0, got {args.latency!r}")

    t_start = time.perf_counter()
    load_before = os.getloadavg()
    n_lat = len(args.latency.split(","))
    # generous: a full-size step takes about 2 s on one core of this kind of machine
    timeout = 300.0 + 10.0 * n_lat * args.rounds * len(CANDIDATES) * (args.steps + args.warmup + 2)
    result = run_ranks(
        rank_main,
        args.ranks,
        args=(
            asdict(config),
            args.latency,
            args.network,
            args.rounds,
            args.steps,
            args.warmup,
            args.threads,
        ),
        timeout=timeout,
    )[0]
    load_after = os.getloadavg()
    summary = summarize(result["sweep"])
    head = (
        f"{args.ranks} gloo ranks x {args.threads} thread, {config.blocks} pre-norm MLP blocks "
        f"of width {config.width} ({result['parameters'] / 1e6:.1f}M parameters), "
        f"{config.tokens} tokens per rank, AdamW; {args.rounds} rounds x {args.steps} steps; "
        f"{args.network} network"
    )
    print(f"\none block's forward: {result['block_forward_s'] * 1e3:.1f} ms")
    print_tables(summary, head, result["block_forward_s"])
    wall = time.perf_counter() - t_start
    print(
        f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"wall time {wall:.0f} s"
    )
    record = {
        "benchmark": "parallel_overlap",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "machine": machine_info(ms_parallel=ms_parallel.__version__),
        "parameters": {
            **asdict(config),
            "ranks": args.ranks,
            "threads_per_rank": args.threads,
            "rounds": args.rounds,
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
            "latency_spec": args.latency,
            "latencies_s": [s["latency_s"] for s in result["sweep"]],
            "parameter_count": result["parameters"],
            "optimizer": f"AdamW(lr={config.lr}, foreach=True)",
            "precision": "fp32",
            "candidates": list(CANDIDATES),
            "backend": "ms_parallel.latency over gloo, localhost",
            "network": args.network,
            "latency_per_op_in_L": NETWORKS[args.network],
            "order": "per L: rounds; each round every candidate, the order rotating",
            "step_time": "slowest rank's time for the timed steps / steps",
        },
        "block_forward_s": result["block_forward_s"],
        "load_average_1_5_15_min": {"before": load_before, "after": load_after},
        "summary": summary,
        "sweep": result["sweep"],
        "wall_s": wall,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
