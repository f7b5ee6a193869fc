"""Saving a step that is already committed replaces it, and a re-save that fails leaves
the committed checkpoint as it was: one process (writer process and inline) and 2 gloo
ranks, on real files."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ms_ckpt import Checkpointer, CheckpointWriteError
from ms_testing import run_ranks

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # the writer process imports the hooks by module name
    sys.path.insert(0, str(HERE))
from _writer_faults import FailAt  # noqa: E402

DEADLINE = 60.0  # for every wait on a save


def state(value: float) -> dict[str, Any]:
    return {
        "w": torch.full((64, 32), value),
        "b": torch.arange(16, dtype=torch.float64) + value,
        "meta": {"value": value},
    }


def loaded(ckpt: Checkpointer, step: int) -> float:
    """The value the checkpoint of ``step`` holds (every entry must agree)."""
    fresh = state(-1.0)
    assert ckpt.load(fresh, step) == step
    value = fresh["meta"]["value"]
    assert torch.equal(fresh["w"], torch.full((64, 32), value))
    assert torch.equal(fresh["b"], torch.arange(16, dtype=torch.float64) + value)
    return float(value)


def files(root: Path, step: int) -> set[str]:
    return {p.name for p in (root / f"step-{step:08d}").iterdir()}


@pytest.mark.parametrize("stage2", ["process", "inline"])
def test_saving_a_committed_step_again_replaces_it(tmp_path: Path, stage2: str) -> None:
    """A run resumed from step 1 (or from the fallback past a damaged newer step) trains
    again and saves step 1: the checkpoint of step 1 is then what it saved."""
    root = tmp_path / "ck"
    with Checkpointer(str(root), stage2=stage2) as ckpt:  # type: ignore[arg-type]
        ckpt.save(1, state(1.0)).wait(timeout=DEADLINE)
        ckpt.save(2, state(2.0)).wait(timeout=DEADLINE)
        ckpt.save(1, state(7.0)).wait(timeout=DEADLINE)
        assert loaded(ckpt, 1) == 7.0 and loaded(ckpt, 2) == 2.0
        assert ckpt.steps() == {1: True, 2: True}
        assert ckpt.latest_step() == 2
    assert (root / "latest").read_text() == "step-00000002\n"  # never backwards
    # The replaced checkpoint's shard is gone; the new one has a name of its own.
    (shard,) = files(root, 1) - {"manifest.json"}
    assert shard.startswith("rank-00000.") and shard.endswith(".bin")
    assert shard != "rank-00000.bin"
    # Saved again, the step replaces that one in turn.
    with Checkpointer(str(root), stage2=stage2) as ckpt:  # type: ignore[arg-type]
        ckpt.save(1, state(8.0)).wait(timeout=DEADLINE)
        assert loaded(ckpt, 1) == 8.0
    assert len(files(root, 1) - {"manifest.json"}) == 1 and shard not in files(root, 1)


@pytest.mark.parametrize("point", ["record", "manifest"])
def test_a_failed_resave_leaves_the_committed_step_as_it_was(tmp_path: Path, point: str) -> None:
    """The re-save fails before its first record, or with every new shard durable just
    before the manifest's rename: the committed step still loads, with its old values,
    and nothing of the failed attempt stays behind."""
    root = tmp_path / "ck"
    with Checkpointer(str(root)) as ckpt:
        ckpt.save(1, state(1.0)).wait(timeout=DEADLINE)
    before = files(root, 1)
    with Checkpointer(str(root), hook=FailAt(point)) as ckpt:
        handle = ckpt.save(1, state(7.0))
        with pytest.raises(CheckpointWriteError, match=os.strerror(errno.ENOSPC)):
            handle.wait(timeout=DEADLINE)
        assert ckpt.steps() == {1: True}
        assert loaded(ckpt, 1) == 1.0
    assert files(root, 1) == before


def rank_resave(root: str) -> dict[str, Any]:
    """Both ranks write parts of each step (replicated state split over DP 2); rank 1's
    writer fails the second re-save."""
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    many = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}
    with Checkpointer(root) as ckpt:
        ckpt.save(1, {**many, **state(1.0)}).wait(timeout=DEADLINE)
        ckpt.save(1, {**many, **state(7.0)}).wait(timeout=DEADLINE)
        out["replaced"] = loaded_many(ckpt, many)
    dist.barrier()
    hook = FailAt("record") if rank == 1 else None
    with Checkpointer(root, hook=hook) as ckpt:
        try:
            ckpt.save(1, {**many, **state(9.0)}).wait(timeout=DEADLINE)
            out["failed"] = None
        except CheckpointWriteError as e:
            out["failed"] = str(e)
        dist.barrier()
        out["after"] = loaded_many(ckpt, many)
    return out


def loaded_many(ckpt: Checkpointer, many: dict[str, torch.Tensor]) -> float:
    fresh = {**{k: torch.zeros_like(v) for k, v in many.items()}, **state(-1.0)}
    ckpt.load(fresh, 1)
    assert all(torch.equal(fresh[k], v) for k, v in many.items())
    return float(fresh["meta"]["value"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_resave_a_committed_step_and_survive_a_failed_resave(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    results = run_ranks(rank_resave, 2, args=(str(root),), timeout=150)
    assert [r["replaced"] for r in results] == [7.0, 7.0]
    assert "rank 1 failed to write its part" in results[0]["failed"]
    assert os.strerror(errno.ENOSPC) in results[1]["failed"]
    # Rank 1's failed part did not take the committed step's shard with it.
    assert [r["after"] for r in results] == [7.0, 7.0]
    shards = files(root, 1) - {"manifest.json"}
    assert len(shards) == 2 and not shards & {"rank-00000.bin", "rank-00001.bin"}
