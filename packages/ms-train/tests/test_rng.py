"""The RNG rule of ``ms_train._rng``, checked against its documented formula; the
resumes that apply it are in test_reshard.py."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

from ms_ckpt import Checkpointer
from ms_train._rng import RankRNG, rank_seed, seed_rank


def documented_seed(seed: int, rank: int, step: int) -> int:
    """The README's formula, written out here rather than imported."""
    digest = hashlib.sha256(f"{seed}:rng/rank{rank}/step{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@pytest.fixture(autouse=True)
def _keep_global_rngs() -> object:
    """These tests reseed the process's generators; give the next test its own back."""
    saved = RankRNG().state_dict()
    yield None
    RankRNG().load_state_dict(saved)


def test_rank_seed_is_the_documented_hash_of_seed_rank_and_step() -> None:
    for seed, rank, step in [(0, 0, 0), (0, 1, 0), (7, 3, 120), (12345, 191, 10**6)]:
        assert rank_seed(seed, rank, step) == documented_seed(seed, rank, step)
    seeds = {rank_seed(5, r, s) for r in range(8) for s in (0, 2, 4)}
    assert len(seeds) == 24  # every rank and step draws its own stream
    assert all(0 <= s < 2**63 for s in seeds)


def test_seed_rank_seeds_torch_python_and_numpy_by_the_rule() -> None:
    value = seed_rank(3, 2, 40)
    expected = documented_seed(3, 2, 40)
    assert value == expected and torch.initial_seed() == expected
    assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(expected).get_state())
    assert random.getstate() == random.Random(expected).getstate()
    words = [expected & 0xFFFF_FFFF, expected >> 32]
    state = np.random.get_state()
    reference = np.random.RandomState(words).get_state()
    assert state[0] == reference[0] and np.array_equal(state[1], reference[1])
    assert state[2:] == reference[2:]
    draws = (torch.rand(3), random.random(), np.random.rand())
    seed_rank(3, 2, 40)
    assert torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
    assert np.random.rand() == draws[2]
    seed_rank(3, 2, 41)
    assert not torch.equal(torch.rand(3), draws[0])


def test_rank_rng_says_whether_a_load_restored_it() -> None:
    """Per rank in ms-ckpt like rng_state(); restored only by a load of its state."""
    with Checkpointer("memory://rank-rng") as ckpt:
        torch.manual_seed(11)
        saved = torch.get_rng_state()
        ckpt.save(1, {"rng": RankRNG()}).wait(timeout=60)
        torch.manual_seed(12)
        live = RankRNG()
        assert not live.restored
        ckpt.load({"rng": live})
    assert live.restored and torch.equal(torch.get_rng_state(), saved)
