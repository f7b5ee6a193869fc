"""Placement markers and the split of replicated records, in one process: argument
checks, the balance of ``assign``, sharded state that must tile its tensor, and keys
that would collide."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ms_ckpt import Checkpointer, CheckpointWriteError, Sharded, per_rank
from ms_ckpt._plan import assign


def test_sharded_checks_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"global_shape must be ints >= 0"):
        Sharded(torch.zeros(2, 3), (4, -3), 0)
    with pytest.raises(ValueError, match=r"Sharded.dim must be in \[0, 2\)"):
        Sharded(torch.zeros(2, 3), (4, 3), 0, dim=2)
    with pytest.raises(ValueError, match=r"local has shape \(2, 3\).*every dimension but dim 0"):
        Sharded(torch.zeros(2, 3), (4, 5), 0)
    with pytest.raises(ValueError, match=r"offset must be an int in \[0, 2\].*got 3"):
        Sharded(torch.zeros(2, 3), (4, 3), 3)
    with pytest.raises(TypeError, match="local must be a tensor"):
        Sharded([1, 2], (2,), 0)  # type: ignore[arg-type]
    assert Sharded(torch.zeros(4, 0), (4, 6), 6, dim=1).length == 0


@given(
    st.lists(st.integers(0, 10_000), max_size=40),
    st.integers(1, 8),
    st.integers(0, 5),
)
def test_assign_is_deterministic_complete_and_balanced(
    sizes: list[int], n: int, pickles: int
) -> None:
    items = [(f"t{i}", s, True) for i, s in enumerate(sizes)]
    items += [(f"p{i}", 10**6, False) for i in range(pickles)]
    owner = assign(items, n)
    assert owner == assign(list(reversed(items)), n)  # order of the state does not matter
    assert set(owner) == {k for k, _, _ in items} and all(0 <= j < n for j in owner.values())
    load = [0] * n
    for k, s, is_tensor in items:
        if is_tensor:
            load[owner[k]] += s
    # Largest first onto the least loaded: no rank exceeds another by more than one item.
    assert max(load) - min(load) <= max(sizes, default=0)


def test_shards_that_do_not_tile_fail_the_save(tmp_path: Path) -> None:
    with Checkpointer(str(tmp_path), stage2="inline") as ckpt:
        half = Sharded(torch.ones(2, 3), (4, 3), 0)  # one process holds only rows [0, 2)
        with pytest.raises(CheckpointWriteError, match=r"'w' cover \[0, 2\) of 4 along dim 0"):
            ckpt.save(1, {"w": half}).wait()
        assert ckpt.steps() == {}  # the partial step was removed
        whole = Sharded(torch.arange(12.0).view(4, 3), (4, 3), 0)
        ckpt.save(2, {"w": whole, "r": per_rank(torch.ones(2))}).wait()
        live = {"w": Sharded(torch.zeros(4, 3), (4, 3), 0), "r": per_rank(torch.zeros(2))}
        assert ckpt.load(live) == 2
        assert torch.equal(live["w"].local, whole.local) and torch.equal(
            live["r"].value, torch.ones(2)
        )
        mismatch = {"w": Sharded(torch.zeros(4, 2), (4, 2), 0), "r": per_rank(torch.zeros(2))}
        with pytest.raises(Exception, match=r"state\['w'\].*\(4, 3\).*\(4, 2\)"):
            ckpt.load(mismatch)


def test_keys_that_flatten_alike_are_refused(tmp_path: Path) -> None:
    with Checkpointer(str(tmp_path), stage2="inline") as ckpt:
        with pytest.raises(ValueError, match=r"state\['d/0'\]: two values flatten to this key"):
            ckpt.save(1, {"d": {0: torch.ones(1), "0": torch.zeros(1)}})
        with pytest.raises(TypeError, match="cannot be inside per_rank"):
            ckpt.save(1, {"r": per_rank({"s": Sharded(torch.ones(1), (1,), 0)})})
