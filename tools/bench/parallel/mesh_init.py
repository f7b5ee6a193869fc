"""Process-group init for a device mesh: ms-parallel's build_mesh against the textbook loop.

    .venv/bin/python tools/bench/parallel/mesh_init.py [--world 8] [--reps 11]
        [--shapes 2x2x2,1x8x1,1x4x2] [--out PATH] [--smoke]

``--world`` rank processes (default 8) on this host, gloo over loopback, started once
(``ms_testing.run_ranks`` without its process group). For every measurement each rank
joins a fresh default process group on a fresh store namespace (a ``PrefixStore`` of
its own over the launcher's TCPStore, so no key of an earlier measurement is seen),
waits in a barrier, then builds one pp x dp x tp mesh (``--shapes``, written
``PPxDPxTP``) with one candidate, and finally destroys every group
(``destroy_process_group``), so the next measurement starts from nothing:

1. **ms build_mesh**: ``ms_parallel.mesh.build_mesh(pp=, dp=, tp=)``: one all-gather over
   the world, then each rank creates only its own group per dim
   (``new_group(..., use_local_synchronization=True)``; a dim spanning the world reuses
   the default group).
2. **new_group per group**: the textbook loop (Megatron-LM's ``initialize_model_parallel``
   shape): every rank calls ``dist.new_group(ranks)`` for every group of every dim, pp
   then dp then tp, keeps the ones it is in, and wraps them with
   ``DeviceMesh.from_group``, so all candidates end with the same ``DeviceMesh``.
3. **torch init_device_mesh**: ``init_device_mesh("cpu", (pp, dp, tp),
   mesh_dim_names=("pp", "dp", "tp"))``: on gloo, one ``new_group`` per group on every
   rank, like 2.

Each under two settings of torch's ``TORCH_DIST_INIT_BARRIER`` (read at every
``new_group``): ``0``, torch 2.13's default, where ``new_group`` ends without a barrier,
and ``1``, the behaviour of torch before 2.1 (and an opt-in since), where every
``new_group`` ends in a store-based barrier: over the whole world for 2 and 3, over the
group's members for 1 (local synchronization).

Time: from the barrier's return to the mesh's, per rank; a build's time is the maximum
over ranks (the job goes on when its slowest rank does). After each build, untimed, an
all-reduce of ``2 ** rank`` over every dim's group must give exactly that group's
ranks (checked against ``MeshShape``), or the benchmark fails instead of timing a
wrong mesh. Repetitions: one untimed warm-up of everything, then ``--reps`` rounds; in
each round every (setting, shape) runs the three candidates back to back, the order
rotating by round. Reported per setting and shape: median and min-max time, the median
over rounds of each candidate's time over build_mesh's in the same round (paired), and
the ratio of medians.

Store requests: one more build per (setting, shape, candidate), through
``ms_testing.store.CountingStore`` (every request crosses into Python, so these builds
are not timed): requests per rank, the world-wide barriers each rank joined (adds on
the default store's ``store_based_barrier_key:<group>``), the group-local barriers,
and requests on keys of groups the rank is not in. build_mesh's all-gather is a gloo
collective, not a store request: it is the one world-wide step it takes.

Prints markdown tables and writes a JSON record (machine info, versions, parameters,
every build of every rank) to ``--out`` (default
``bench-results/parallel_mesh_init.json``). ``--smoke``: 4 ranks, shapes 1x2x2 and
1x4x1, 1 round and the counted builds, a check that the script works (its numbers mean
nothing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import ms_parallel
from ms_parallel.mesh import build_mesh
from ms_parallel.mesh_shape import MESH_DIM_NAMES, MeshShape
from ms_testing import run_ranks
from ms_testing.bench import machine_info
from ms_testing.store import CountingStore

MS = "ms build_mesh"
TEXTBOOK = "new_group per group"
TORCH = "torch init_device_mesh"
CANDIDATES = (MS, TEXTBOOK, TORCH)
SETTINGS = ("0", "1")  # TORCH_DIST_INIT_BARRIER
SETTING_TITLES = {
    "0": "TORCH_DIST_INIT_BARRIER=0 (torch 2.13's default: no barrier after new_group)",
    "1": "TORCH_DIST_INIT_BARRIER=1 (torch before 2.1: a store barrier after each new_group)",
}
WORLD_BARRIER = "store_based_barrier_key:"

Shape = tuple[int, int, int]
Item = tuple[int, str, Shape, str, bool]  # round (-1: warm-up), setting, shape, candidate, counted


def build_textbook(shape: MeshShape) -> DeviceMesh:
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    for dim in MESH_DIM_NAMES:
        for ranks in shape.groups(dim):
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[dim] = group
    return DeviceMesh.from_group(
        [mine[d] for d in MESH_DIM_NAMES],
        "cpu",
        mesh=shape.mesh_tensor(),
        mesh_dim_names=MESH_DIM_NAMES,
    )


BUILDERS: dict[str, Callable[[MeshShape], DeviceMesh]] = {
    MS: lambda s: build_mesh(pp=s.pp, dp=s.dp, tp=s.tp),
    TEXTBOOK: build_textbook,
    TORCH: lambda s: init_device_mesh("cpu", s.sizes, mesh_dim_names=MESH_DIM_NAMES),
}


def check_mesh(mesh: DeviceMesh, shape: MeshShape, what: str) -> None:
    """Raise unless every dim's group connects exactly the ranks the layout says."""
    rank = dist.get_rank()
    for dim in MESH_DIM_NAMES:
        bits = torch.tensor([1 << rank], dtype=torch.int64)
        dist.all_reduce(bits, group=mesh.get_group(dim))
        want = sum(1 << r for r in shape.group_ranks(dim, rank))
        if int(bits.item()) != want:
            raise AssertionError(
                f"rank {rank}: {what} built a {dim} group that reduced {int(bits.item()):#x}, "
                f"expected {want:#x} (ranks {shape.group_ranks(dim, rank)})"
            )


def classify(requests: list[tuple[str, str]], own: set[str]) -> dict[str, Any]:
    """Store requests of one rank's build: counts, barriers, keys of other groups."""
    world_barriers: set[str] = set()
    local_barriers: set[str] = set()
    foreign = 0
    ops: dict[str, int] = {}
    for op, key in requests:
        ops[op] = ops.get(op, 0) + 1
        # Keys read <namespace>/<default group prefix>//<group name>//<device>//...
        _, _, rest = key.partition("//")
        if rest.startswith(WORLD_BARRIER):
            if op == "add":
                world_barriers.add(rest)
            continue
        group = rest.partition("//")[0]
        if group not in own:
            foreign += 1
        elif op == "add" and WORLD_BARRIER in rest:
            local_barriers.add(rest)
    return {
        "requests": len(requests),
        "by_op": ops,
        "world_barriers_joined": len(world_barriers),
        "group_local_barriers": len(local_barriers),
        "requests_on_other_groups_keys": foreign,
    }


def rank_main(plan: list[Item], timeout_s: float) -> list[dict[str, Any]] | None:
    """One rank: every item of the plan in order (runs under run_ranks, no process group)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    client = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    counting = CountingStore(client)
    out: list[dict[str, Any]] = []
    last_round = -2
    for i, (rnd, setting, sizes, candidate, counted) in enumerate(plan):
        os.environ["TORCH_DIST_INIT_BARRIER"] = setting
        shape = MeshShape(*sizes)
        store = dist.PrefixStore(f"mesh-init/{i}", counting if counted else client)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        dist.barrier()
        counting.clear()
        t0 = time.perf_counter()
        mesh = BUILDERS[candidate](shape)
        elapsed = time.perf_counter() - t0
        requests = list(counting.requests)
        check_mesh(mesh, shape, candidate)
        own = {mesh.get_group(d).group_name for d in MESH_DIM_NAMES}
        mine: dict[str, Any] = {"s": elapsed}
        if counted:
            mine["store"] = classify(requests, own)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        dist.destroy_process_group()
        if rank == 0 and rnd >= 0:
            out.append(
                {
                    "round": rnd,
                    "setting": setting,
                    "shape": list(sizes),
                    "candidate": candidate,
                    "counted": counted,
                    "s": max(g["s"] for g in gathered),
                    "s_per_rank": [g["s"] for g in gathered],
                    **({"store_per_rank": [g["store"] for g in gathered]} if counted else {}),
                }
            )
        if rank == 0 and rnd != last_round:
            print(f"  round {rnd}{' (warm-up)' if rnd < 0 else ''} started", flush=True)
            last_round = rnd
    return out if rank == 0 else None


def make_plan(shapes: list[Shape], reps: int) -> list[Item]:
    plan: list[Item] = []
    for rnd in range(-1, reps):
        k = max(rnd, 0) % len(CANDIDATES)
        order = CANDIDATES[k:] + CANDIDATES[:k]
        for setting in SETTINGS:
            for shape in shapes:
                plan.extend((rnd, setting, shape, c, False) for c in order)
    for setting in SETTINGS:
        for shape in shapes:
            plan.extend((0, setting, shape, c, True) for c in CANDIDATES)
    return plan


def shape_name(shape: Shape) -> str:
    return str(MeshShape(*shape))


def groups_per_rank_calls(shape: Shape) -> dict[str, int]:
    """new_group calls per rank each candidate makes, from the layout."""
    s = MeshShape(*shape)
    every = sum(len(s.groups(d)) for d in MESH_DIM_NAMES)
    own = sum(1 for size in s.sizes if size != s.world_size)
    return {MS: own, TEXTBOOK: every, TORCH: every - sum(size == s.world_size for size in s.sizes)}


def report(builds: list[dict[str, Any]], shapes: list[Shape], reps: int) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for setting in SETTINGS:
        print(f"\n## {SETTING_TITLES[setting]}")
        for shape in shapes:
            key = f"{setting}/{'x'.join(map(str, shape))}"
            mine = [b for b in builds if b["setting"] == setting and b["shape"] == list(shape)]
            timed = {
                c: [b for b in mine if b["candidate"] == c and not b["counted"]] for c in CANDIDATES
            }
            counted = {
                c: next(b for b in mine if b["candidate"] == c and b["counted"]) for c in CANDIDATES
            }
            by_round = {c: {b["round"]: b["s"] for b in timed[c]} for c in CANDIDATES}
            med = {c: statistics.median(by_round[c].values()) for c in CANDIDATES}
            paired = {
                c: statistics.median(by_round[c][r] / by_round[MS][r] for r in range(reps))
                for c in CANDIDATES
            }
            calls = groups_per_rank_calls(shape)
            print(f"\n### {shape_name(shape)}, {reps} rounds\n")
            print(
                "| candidate | median ms | min-max ms | time / build_mesh (paired) | ratio of "
                "medians | new_group calls per rank (layout) | store requests per rank (max) | "
                "world-wide barriers per rank | group-local barriers per rank |"
            )
            print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            entry: dict[str, Any] = {}
            for c in CANDIDATES:
                ts = list(by_round[c].values())
                store = counted[c]["store_per_rank"]
                req = max(s["requests"] for s in store)
                wb = max(s["world_barriers_joined"] for s in store)
                lb = max(s["group_local_barriers"] for s in store)
                print(
                    f"| {c} | {1e3 * med[c]:.1f} | {1e3 * min(ts):.1f}-{1e3 * max(ts):.1f} "
                    f"| {paired[c]:.2f}x | {med[c] / med[MS]:.2f}x | {calls[c]} | {req} | {wb} "
                    f"| {lb} |"
                )
                entry[c] = {
                    "median_s": med[c],
                    "min_s": min(ts),
                    "max_s": max(ts),
                    "paired_ratio_to_ms": paired[c],
                    "ratio_of_medians_to_ms": med[c] / med[MS],
                    "new_group_calls_per_rank": calls[c],
                    "store_requests_max_rank": req,
                    "store_requests_all_ranks": sum(s["requests"] for s in store),
                    "world_barriers_per_rank": wb,
                    "group_local_barriers_per_rank": lb,
                    "requests_on_other_groups_keys_max_rank": max(
                        s["requests_on_other_groups_keys"] for s in store
                    ),
                }
            summary[key] = entry
    return summary


def scale_note() -> list[dict[str, Any]]:
    """Calls and world-wide barriers at scale, from the layout alone (not measured)."""
    rows = []
    print("\nAt scale, counted from the layout (arithmetic, not a measurement):\n")
    print(
        "| ranks | mesh | new_group calls per rank, textbook | world-wide barriers "
        "(barrier on) | build_mesh |"
    )
    print("|---:|---|---:|---:|---|")
    for world, shape in ((2048, (8, 32, 8)), (12288, (8, 192, 8))):
        calls = groups_per_rank_calls(shape)[TEXTBOOK]
        print(
            f"| {world} | {shape_name(shape)} | {calls} | {calls} | 3 group creations, "
            "1 all-gather, 0 world-wide barriers |"
        )
        rows.append({"world": world, "shape": list(shape), "textbook_calls_per_rank": calls})
    return rows


def parse_shapes(text: str, world: int) -> list[Shape]:
    shapes: list[Shape] = []
    for part in text.split(","):
        pp, dp, tp = (int(x) for x in part.strip().split("x"))
        if pp * dp * tp != world:
            raise SystemExit(f"--shapes: {part} holds {pp * dp * tp} ranks, --world is {world}")
        shapes.append((pp, dp, tp))
    return shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=8, help="rank processes (gloo, this host)")
    ap.add_argument("--reps", type=int, default=11, help="timed rounds")
    ap.add_argument("--shapes", default="2x2x2,1x8x1,1x4x2", help="PPxDPxTP, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("bench-results/parallel_mesh_init.json"))
    ap.add_argument("--smoke", action="store_true", help="4 ranks, 2 shapes, 1 round")
    args = ap.parse_args()
    if args.smoke:
        args.world, args.reps, args.shapes = 4, 1, "1x2x2,1x4x1"
        print("smoke: not a measurement")
    if args.reps < 1 or args.world < 1:
        ap.error("--reps and --world must be >= 1")
    shapes = parse_shapes(args.shapes, args.world)
    plan = make_plan(shapes, args.reps)
    timeout = 120.0 + 3.0 * len(plan)
    print(
        f"{args.world} ranks, {len(shapes)} shapes x {len(SETTINGS)} settings x "
        f"{len(CANDIDATES)} candidates: 1 warm-up + {args.reps} timed rounds + 1 counted"
    )
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    values = run_ranks(
        rank_main, args.world, args=(plan, timeout), init_process_group=False, timeout=timeout
    )
    wall = time.perf_counter() - t0
    builds: list[dict[str, Any]] = values[0]
    summary = report(builds, shapes, args.reps)
    scale = scale_note()
    print(
        f"\nload average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
        f"wall {wall:.0f} s"
    )

    record = {
        "benchmark": "parallel_mesh_init",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "smoke": args.smoke,
        "machine": machine_info(ms_parallel=ms_parallel.__version__),
        "parameters": {
            "world": args.world,
            "reps": args.reps,
            "shapes": [list(s) for s in shapes],
            "backend": "gloo, loopback",
            "settings": {f"TORCH_DIST_INIT_BARRIER={s}": SETTING_TITLES[s] for s in SETTINGS},
            "candidates": list(CANDIDATES),
            "timed": "per rank from a barrier's return to the mesh's; a build is the max "
            "over ranks",
            "fresh": "every build: a new default process group on a new store namespace, "
            "destroyed after",
            "order": "1 untimed warm-up round; each round runs the 3 candidates back to back "
            "per (setting, shape), rotating the order by round; counted builds apart",
        },
        "summary": summary,
        "scale_from_layout": scale,
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "wall_s": wall,
        "builds": builds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
