"""Each rank's random number generators: restored on resume, or seeded by a rule.

In training only dropout draws from them: the weights come from per-parameter
generators seeded by name (``ms_train.model.derive_seed``) and the sample from a
generator of its own. The rule, for rank ``r`` (its data-parallel rank, so that the
TP ranks of one replica draw the same dropout masks of the tensors they share):

- **Resumed at the same layout** (data- and tensor-parallel sizes): the generators are the ones the
  checkpoint saved for rank ``r`` (ms-ckpt's per-rank ``rng_state()``), bit for bit, so
  the resumed run draws what the uninterrupted one would have.
- **Otherwise**, at a fresh start (step 0) and when resuming at step ``s`` with another
  data-parallel size: torch's CPU generator and every CUDA device's, Python's
  ``random`` and numpy's global generator (when numpy is installed) are seeded with
  ``rank_seed(train.seed, r, s) = derive_seed(train.seed, f"rng/rank{r}/step{s}")``:
  the first 8 bytes of ``SHA-256(f"{train.seed}:rng/rank{r}/step{s}")`` as a
  little-endian integer, shifted right by one bit (numpy takes its two 32-bit words).

Why not hand the saved states to the new ranks: going from 2 ranks to 4, ranks 2 and 3
have no saved state, and giving one saved state to two ranks would draw the same
dropout masks on both. The step is part of the seed so that a job resumed at another
size does not replay the masks its ranks drew from step 0. With dropout on, a resumed
run at another size therefore differs from the uninterrupted one, as two runs at
different sizes differ from the start (each sample meets another rank's masks); with
dropout off (every preset) it trains the same model, up to floating-point order.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ms_ckpt import RNGState
from ms_train.model import derive_seed

__all__ = ["RankRNG", "rank_seed", "seed_rank"]


def rank_seed(seed: int, rank: int, step: int) -> int:
    """The seed of rank ``rank``'s generators when they start at ``step`` unrestored."""
    return derive_seed(seed, f"rng/rank{rank}/step{step}")


def seed_rank(seed: int, rank: int, step: int) -> int:
    """Seed this process's generators by the rule (module docstring); returns the seed."""
    value = rank_seed(seed, rank, step)
    torch.manual_seed(value)  # the CPU generator and every CUDA device's
    random.seed(value)
    try:
        import numpy as np
    except ImportError:  # not a dependency of ms-train: seeded when installed
        return value
    np.random.seed([value & 0xFFFF_FFFF, value >> 32])
    return value


class RankRNG(RNGState):
    """``ms_ckpt.rng_state()`` that remembers whether a load restored it: a checkpoint
    loaded with ``per_rank="keep"`` under another data-parallel size does not."""

    def __init__(self) -> None:
        self.restored = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.restored = True
