"""Several gloo ranks, each a real process with its own stage-2 writer, on real files:
replicated state written once per DP group, broadcast recovery reading each record once
per DP group (counted through ``counting://``), per-rank and DP-sharded state,
resharding DP 4 -> 2, model-parallel parts, and failures agreed on by every rank."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ms_ckpt import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointError,
    CheckpointWriteError,
    Sharded,
    per_rank,
    rng_state,
)
from ms_testing import run_ranks
from ms_testing.fs import COUNTER_ENV, read_counts, reset_counts

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # the writer processes import the hooks by module name
    sys.path.insert(0, str(HERE))
from _writer_faults import PauseAt  # noqa: E402

DEADLINE = 60.0  # for every wait on a save
pytestmark = pytest.mark.slow  # every test starts 2 or 4 ranks, each with a writer

G = 10  # rows of the DP-sharded tensor: not a multiple of 4, so slices are uneven


def _slice(dp_rank: int, dp_size: int) -> tuple[int, int]:
    chunk = math.ceil(G / dp_size)
    lo = min(dp_rank * chunk, G)
    return lo, min(chunk, G - lo)


class ZeroLike:
    """A Stateful holding this DP rank's slice of a sharded buffer, like a ZeRO optimizer."""

    def __init__(self, dp_rank: int, dp_size: int, scale: float) -> None:
        self.offset, n = _slice(dp_rank, dp_size)
        rows = torch.arange(self.offset, self.offset + n, dtype=torch.float32)
        self.buf = rows[:, None] * scale + torch.arange(3)
        self.count = int(scale)

    def state_dict(self) -> dict[str, Any]:
        return {"exp_avg": Sharded(self.buf, (G, 3), self.offset), "count": self.count}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        shard = sd["exp_avg"]
        assert isinstance(shard, Sharded) and shard.offset == self.offset, shard
        self.buf.copy_(shard.local)
        self.count = sd["count"]


def make_state(seed: int, part: int, dp_rank: int, dp_size: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(seed * 7 + part)  # the same on every rank of a DP group
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    bf16 = torch.randn(5, 4).to(torch.bfloat16)
    torch.manual_seed(1000 * rank + seed)  # the RNG differs per rank
    return {
        "model": model,
        "optim": opt,
        "zero": ZeroLike(dp_rank, dp_size, float(seed * 10 + part)),
        "mine": per_rank({"t": torch.full((3,), float(100 * seed + rank)), "note": f"r{rank}"}),
        "rng": rng_state(),
        "bf16": bf16,
        "odd": {  # odd sizes and dtypes through the broadcast buckets
            "empty": torch.empty(0, 4),
            "i64": torch.arange(5) * seed,
            "bool": torch.arange(7) % (seed + 1) == 0,
            "f16": torch.full((3,), seed + 0.5, dtype=torch.float16),
        },
        "step": seed,
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Plain copies of everything the state holds, and the next random draw."""
    out: dict[str, Any] = {f"model/{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for i, s in state["optim"].state_dict()["state"].items():
        out |= {f"optim/{i}/{k}": v.clone() for k, v in s.items()}
    out["zero"] = state["zero"].buf.clone()
    out["zero_count"] = state["zero"].count
    out["mine"] = state["mine"].value["t"].clone()
    out["note"] = state["mine"].value["note"]
    out["bf16"] = state["bf16"].clone()
    out |= {f"odd/{k}": v.clone() for k, v in state["odd"].items()}
    out["step"] = state["step"]
    out["draw"] = torch.rand(3)  # consumes the RNG: snapshot last
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _dp_groups(parts: int) -> tuple[Any, int, int]:
    """Split the world into ``parts`` DP groups by rank % parts; returns
    (this rank's dp group, part, dp rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(p, world, parts))) for p in range(parts)]
    part = rank % parts
    return groups[part], part, rank // parts


def _shard_reads(counter: str) -> int:
    return sum(n for p, n in read_counts(counter).by_path.items() if p.endswith(".bin"))


def rank_round_trip(root: str, counter: str, parts: int) -> dict[str, Any]:
    rank = dist.get_rank()
    dp_group, part, dp_rank = _dp_groups(parts)
    dp_size = dist.get_world_size() // parts
    url = f"counting://{root}"
    with Checkpointer(url, dp_group=dp_group, commit_timeout=60) as ckpt:
        saved = make_state(1, part, dp_rank, dp_size, rank)
        ckpt.save(1, saved).wait(timeout=DEADLINE)
        before = snapshot(saved)
    dist.barrier()  # step 1 committed on rank 0 before anyone loads

    out: dict[str, Any] = {"before": before}
    for broadcast in (True, False):
        fresh = make_state(2, part, dp_rank, dp_size, rank)
        if rank == 0:
            reset_counts(counter)
        dist.barrier()
        with Checkpointer(url, dp_group=dp_group) as ckpt:
            assert ckpt.load(fresh, broadcast=broadcast) == 1
        dist.barrier()
        out[f"after_{broadcast}"] = snapshot(fresh)
        out[f"reads_{broadcast}"] = _shard_reads(counter)
        dist.barrier()
    return out


@pytest.mark.parametrize(("world", "parts"), [(2, 1), (4, 1), (4, 2)])
def test_round_trip_writes_and_reads_each_record_once_per_dp_group(
    tmp_path: Path, world: int, parts: int
) -> None:
    root, counter = tmp_path / "ckpt", str(tmp_path / "reads")
    results = run_ranks(
        rank_round_trip,
        world,
        args=(str(root), counter, parts),
        env={COUNTER_ENV: counter},
        timeout=150,
    )
    for r in results:
        assert_same(r["before"], r["after_True"])
        assert_same(r["before"], r["after_False"])
    step = root / "step-00000001"
    expected_files = {f"rank-{r:05d}.bin" for r in range(world)} | {"manifest.json"}
    assert {p.name for p in step.iterdir()} == expected_files  # fragments removed
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["world"] | {"writers": None} == {
        "world_size": world,
        "dp_size": world // parts,
        "parts": parts,
        "writers": None,
    }
    records = manifest["records"]
    replicated = [r for r in records if "dp_rank" not in r]
    # Written once per DP group: one record per (part, key), spread over the group.
    assert len({(r["part"], r["key"]) for r in replicated}) == len(replicated)
    assert {r["key"] for r in replicated if r["part"] == 0} >= {
        "model/0.weight",
        "optim/state/0/exp_avg",
    }
    writers = {r["file"] for r in replicated}
    assert len(writers) == world  # every rank writes a share of the replicated bytes
    per_rank = [r for r in records if r.get("dp_rank") is not None and "shard" not in r]
    assert len([r for r in per_rank if r["key"] == "mine/t"]) == world
    pieces = [r for r in records if r["key"] == "zero/exp_avg"]
    assert sorted((r["part"], r["shard"]["offset"]) for r in pieces) == sorted(
        (p, _slice(d, world // parts)[0]) for p in range(parts) for d in range(world // parts)
    )
    # Bytes read from storage: every record once with broadcast; replicated records once
    # per rank without.
    total = sum(r["length"] for r in records)
    repl = sum(r["length"] for r in replicated)
    dp = world // parts
    assert all(r["reads_True"] == total for r in results)
    assert all(r["reads_False"] == total + (dp - 1) * repl for r in results)
    assert results[0]["reads_False"] > results[0]["reads_True"]


def rank_reshard(root: str, save_world: int) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == save_world:
        with Checkpointer(root) as ckpt:
            state = make_state(3, 0, rank, world, rank)
            del state["mine"], state["rng"]  # per-rank values cannot reshard
            ckpt.save(5, state).wait(timeout=DEADLINE)
            state["mine"] = per_rank(torch.zeros(1))
            ckpt.save(6, state).wait(timeout=DEADLINE)
        return None
    with Checkpointer(root) as ckpt:
        fresh = make_state(4, 0, rank, world, rank)
        del fresh["mine"], fresh["rng"]
        assert ckpt.load(fresh, step=5) == 5
        # A plain tensor where the checkpoint has a sharded one gets the whole tensor.
        whole: dict[str, Any] = {"zero": {"exp_avg": torch.zeros(G, 3), "count": 0}}
        ckpt.load(whole, step=5)
        fresh["mine"] = per_rank(torch.zeros(1))
        with pytest.raises(CheckpointError) as info:
            ckpt.load(fresh, step=6)
        return {
            "zero": fresh["zero"].buf.clone(),
            "offset": fresh["zero"].offset,
            "count": fresh["zero"].count,
            "model": fresh["model"][0].weight.clone(),
            "error": str(info.value),
            "whole": whole["zero"]["exp_avg"],
        }


def test_dp4_checkpoint_loads_resharded_with_dp2(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(rank_reshard, 4, args=(root, 4), timeout=120)
    results = run_ranks(rank_reshard, 2, args=(root, 4), timeout=120)
    # The CLI writes sharded state whole, and one DP rank's per-rank values.
    out = tmp_path / "step5.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "ms_ckpt.cli", "convert", root, str(out), "--step", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    plain = torch.load(out, weights_only=False)
    expected = torch.arange(G, dtype=torch.float32)[:, None] * 30 + torch.arange(3)
    saved_weight = make_state(3, 0, 0, 4, 0)["model"][0].weight  # what every rank saved
    for dp_rank, r in enumerate(results):
        lo, n = _slice(dp_rank, 2)
        assert r["offset"] == lo
        assert torch.equal(r["zero"], expected[lo : lo + n])
        assert r["count"] == 30
        assert torch.equal(r["whole"], expected)
        assert torch.equal(r["model"], saved_weight)
        assert "data-parallel size changed from 4 to 2" in r["error"]
        assert "'mine'" in r["error"]
    assert torch.equal(plain["zero"]["exp_avg"], expected) and plain["zero"]["count"] == 30


def rank_parts_changed(root: str) -> str:
    with Checkpointer(root) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.load({"bf16": torch.zeros(5, 4, dtype=torch.bfloat16)})
    return str(info.value)


def rank_save_parts(root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # parts {0,1} {2,3}
    part = dist.get_rank() // 2
    with Checkpointer(root, mesh=mesh, dp_dim="dp") as ckpt:
        state = {"bf16": torch.full((5, 4), float(part), dtype=torch.bfloat16)}
        ckpt.save(1, state).wait(timeout=DEADLINE)


def test_load_refuses_state_the_parts_hold_differently_under_a_changed_part_count(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "ckpt")
    run_ranks(rank_save_parts, 4, args=(root,), timeout=120)
    manifest = json.loads((tmp_path / "ckpt" / "step-00000001" / "manifest.json").read_text())
    assert [(w["rank"], w["part"], w["dp_rank"]) for w in manifest["world"]["writers"]] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    (rec,) = [r for r in manifest["records"] if r["part"] == 1]
    assert rec["file"] in ("rank-00002.bin", "rank-00003.bin")
    # Each part saved its own plain "bf16" (0s and 1s): one part cannot tell which to take.
    errors = run_ranks(rank_parts_changed, 2, args=(root,), timeout=120)
    for e in errors:
        assert (
            "the number of model-parallel parts changed from 2 (world 4, data-parallel size "
            "2) to 1 (world 2, data-parallel size 2), and state['bf16'] cannot follow it: "
            "each part saved a copy of its own, and the bytes of parts 0 and 1 differ"
        ) in e
        assert "load it with 2 parts" in e


def rank_faults(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    # Rank 1's writer is held at step 3's first record, so that it is killed mid-shard.
    hold = PauseAt("record", 30, steps=[3]) if rank == 1 else None
    with Checkpointer(root, commit_timeout=60, hook=hold) as ckpt:
        state = {"a": torch.full((64,), float(rank == 0)), "b": torch.arange(100.0), "step": 1}
        ckpt.save(1, state).wait(timeout=DEADLINE)
        # Ranks disagree on the structure of replicated state: the save fails, named.
        bad = dict(state, extra=1) if rank == 1 else state
        handle = ckpt.save(2, bad)
        try:
            handle.wait(timeout=DEADLINE)
            out["structure"] = None
        except CheckpointWriteError as e:
            out["structure"] = str(e)
        dist.barrier()
        # A writer that dies on rank 1: its trainer reports it, rank 0 fails the step
        # at once instead of waiting for commit_timeout.
        handle = ckpt.save(3, state)
        if rank == 1:
            time.sleep(0.5)
            assert ckpt.writer_pid is not None
            os.kill(ckpt.writer_pid, signal.SIGKILL)
        try:
            handle.wait(timeout=45)
            out["killed"] = None
        except CheckpointWriteError as e:
            out["killed"] = str(e)
        dist.barrier()
        # Stage 1 fails on rank 1 only (a value it cannot pickle): rank 1's save raises,
        # rank 0 fails the step at once, and the ranks' save numbers stay in step.
        if rank == 1:
            with pytest.raises(TypeError, match="cannot pickle"):
                ckpt.save(35, dict(state, lock=threading.Lock()))
        else:
            handle = ckpt.save(35, state)
            with pytest.raises(CheckpointWriteError) as info:
                handle.wait(timeout=45)
            out["stage1"] = str(info.value)
        dist.barrier()
        state["step"] = 4
        ckpt.save(4, state).wait(timeout=DEADLINE)  # the next save works
        dist.barrier()
    # A rank whose writer is slow past commit_timeout: rank 0 gives up on the step.
    slow = PauseAt("stage2", 4) if rank == 1 else None
    with Checkpointer(root, commit_timeout=1.0, hook=slow) as quick:
        handle = quick.save(5, state)
        try:
            handle.wait(timeout=45)
            out["timeout"] = None
        except CheckpointWriteError as e:
            out["timeout"] = str(e)
        dist.barrier()
        out["steps"] = quick.steps()
    return out


def test_failures_on_one_rank_fail_the_step_on_rank_0(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_ranks(rank_faults, 2, args=(str(root),), timeout=120)
    assert results[1]["structure"] is None  # rank 1's part was written
    assert (
        "ranks 0 and 1 of one data-parallel group saved differently structured state"
        in (results[0]["structure"])
    )
    assert "'extra'" in results[0]["structure"] and "per_rank" in results[0]["structure"]
    assert "rank 1 failed to write its part" in results[0]["killed"]
    assert (
        "rank 1 failed to write its part: rank 1: state['lock']: cannot pickle"
        in (results[0]["stage1"])
    )
    assert "died" in results[1]["killed"]
    assert (
        "ranks [1] did not finish writing step 5 within commit_timeout=1.0 s"
        in (results[0]["timeout"])
    )
    assert results[1]["timeout"] is None  # its part was written, late
    steps = results[0]["steps"]
    assert steps[1] and steps[4] and not any(steps.get(s, False) for s in (2, 3, 5, 35))
    assert (root / "latest").read_text() == "step-00000004\n"


def rank_corrupt(root: str, phase: str) -> Any:
    rank = dist.get_rank()
    state = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}
    with Checkpointer(root, stage2="inline") as ckpt:
        if phase == "save":
            ckpt.save(1, state).wait(timeout=DEADLINE)
            state["t0"] += 1
            ckpt.save(2, state).wait(timeout=DEADLINE)
            return None
        fresh = {k: torch.zeros_like(v) for k, v in state.items()}
        with pytest.raises(CheckpointCorruptError) as info:
            ckpt.load(fresh)
        untouched = all(torch.equal(v, torch.zeros_like(v)) for v in fresh.values())
        with pytest.warns(UserWarning, match="falling back to step 1"):
            step = ckpt.load(fresh, fallback=True)
        return {
            "error": str(info.value),
            "untouched": untouched,
            "step": step,
            "t0": fresh["t0"][0].item(),
            "rank": rank,
        }


def test_a_damaged_record_fails_the_load_on_every_rank_and_falls_back_together(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    run_ranks(rank_corrupt, 2, args=(str(root), "save"), timeout=120)
    manifest = json.loads((root / "step-00000002" / "manifest.json").read_text())
    rec = next(r for r in manifest["records"] if r["file"] == "rank-00001.bin")
    shard = root / "step-00000002" / rec["file"]
    data = bytearray(shard.read_bytes())
    data[rec["offset"] + rec["length"] // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    results = run_ranks(rank_corrupt, 2, args=(str(root), "load"), timeout=120)
    for r in results:
        assert f"rank 1: {shard}" in r["error"] and repr(rec["key"]) in r["error"]
        assert r["untouched"] and r["step"] == 1 and r["t0"] == 0.0


class Loader:
    """A per-rank data source with a position: what a data loader's state_dict holds."""

    def __init__(self, rank: int) -> None:
        self.rank, self.pos = rank, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.rank * 10_000 + self.pos)
        self.pos += 1
        return torch.randn(16, 8, generator=g)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def rank_train(root: str, steps: int, save_at: int, resume: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial model on every rank
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + rank)  # dropout masks differ per rank
    loader = Loader(rank)
    state: dict[str, Any] = {
        "model": net,
        "optim": opt,
        "rng": rng_state(),
        "loader": per_rank(loader),
        "step": 0,
    }
    losses: list[str] = []
    with Checkpointer(root, commit_timeout=60) as ckpt:
        if resume:
            assert ckpt.load(state) == save_at
        for step in range(state["step"] + 1, steps + 1):
            x = loader.next()
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss).hex())
            state["step"] = step
            if step == save_at and not resume:
                ckpt.save(step, state)
    return {"losses": losses, "weight": net[0].weight.detach().clone()}


def test_resumed_data_parallel_training_is_bit_identical(tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    full = run_ranks(rank_train, 2, args=(root, 8, 4, False), timeout=120)
    resumed = run_ranks(rank_train, 2, args=(root, 8, 4, True), timeout=120)
    assert full[0]["losses"] != full[1]["losses"]  # the ranks really saw different data
    for a, b in zip(full, resumed, strict=True):
        assert b["losses"] == a["losses"][4:]
        assert torch.equal(a["weight"], b["weight"])


class Tally:
    """A per-rank Stateful that counts the loads it was given."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.loads = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = sd["value"]
        self.loads += 1


def keep_state(rank: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)  # the replicated model: the same on every rank
    return {
        "model": torch.nn.Linear(3, 2),
        "mine": per_rank(Tally(100 * seed + rank)),
        "rng": rng_state(),
        "step": seed,
    }


def keep_load(root: str, rank: int) -> dict[str, Any]:
    """Load with per_rank='keep' into fresh state; what came back and what stayed."""
    fresh = keep_state(rank, 2)
    without = {"model": torch.nn.Linear(3, 2)}  # leaves the per-rank keys out
    torch.manual_seed(1000 + rank)
    rng_before = torch.get_rng_state()
    with Checkpointer(root) as ckpt:
        assert ckpt.load(fresh, per_rank="keep") == 1
        ckpt.load(without, per_rank="keep")
    tally = fresh["mine"].value
    return {
        "weight": fresh["model"].weight.detach().clone(),
        "step": fresh["step"],
        "mine": (tally.value, tally.loads),
        "rng_kept": torch.equal(torch.get_rng_state(), rng_before),
        "keys": sorted(without),
    }


def rank_save_then_keep(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    state = keep_state(rank, 1)
    with Checkpointer(root) as ckpt:
        ckpt.save(1, state).wait(timeout=DEADLINE)
    return keep_load(root, rank)


def rank_keep(root: str) -> dict[str, Any]:
    return keep_load(root, dist.get_rank())


def test_per_rank_keep_loads_the_rest_under_another_dp_size(tmp_path: Path) -> None:
    """Saved on 2 DP ranks. On 2 ranks, per_rank='keep' loads the per-rank values like
    the default; on 1 rank and on 4 it loads the replicated state and leaves each live
    per-rank value alone (no load_state_dict, the RNG as it was), where the default
    refuses."""
    root = str(tmp_path / "ckpt")
    same = run_ranks(rank_save_then_keep, 2, args=(root,), timeout=120)
    saved_weight = keep_state(0, 1)["model"].weight.detach()
    for rank, r in enumerate(same):
        assert r["mine"] == (100 + rank, 1) and not r["rng_kept"]
        assert torch.equal(r["weight"], saved_weight) and r["step"] == 1
        assert r["keys"] == ["mine", "model", "rng", "step"]  # materialized: same DP size

    with Checkpointer(root) as ckpt, pytest.raises(CheckpointError) as info:
        ckpt.load(keep_state(0, 2))
    assert "data-parallel size changed from 2 to 1" in str(info.value)
    assert "per_rank='keep'" in str(info.value)
    with (
        Checkpointer(root) as ckpt,
        pytest.raises(ValueError, match="per_rank must be 'refuse' or 'keep', got 'skip'"),
    ):
        ckpt.load({}, per_rank="skip")  # type: ignore[arg-type]
    one = keep_load(root, 0)
    four = run_ranks(rank_keep, 4, args=(root,), timeout=120)
    for rank, r in [(0, one), *enumerate(four)]:
        assert r["mine"] == (200 + rank, 0) and r["rng_kept"], rank
        assert torch.equal(r["weight"], saved_weight) and r["step"] == 1
        assert r["keys"] == ["model", "step"]  # the per-rank values are not made up
