"""ZeroEngine's state through ms-ckpt with replicated chunks: a checkpoint saved with one
``replicated_chunks`` and data-parallel size resumes with another, and training goes on
as in one uninterrupted process.

ZeRO saves a replicated chunk's optimizer state as ``Replicate()`` DTensors and the rest
as ``Shard(0)``; ms-ckpt fills each live DTensor with its region of the saved global
tensor, whatever placement wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ms_ckpt import Checkpointer
from ms_parallel import ZeroEngine
from ms_testing.dist import run_ranks

BATCH, STEPS, SAVED, SEQ, VOCAB = 8, 5, 2, 6, 23
DEADLINE = 60.0


class Net(nn.Module):
    """An embedding, two blocks, a head, and a parameter of the root (chunk 0)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2)
        )
        self.head = nn.Linear(16, VOCAB)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        logits = self.head(x) * self.scale
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(STEPS):
        t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def adamw(groups: Any, shards: Any = None) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=2e-2, weight_decay=0.1)


def one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    net = Net()
    opt = adamw(net.parameters())
    losses = []
    for tokens, targets in data():
        loss = net(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in net.state_dict().items()}


def _loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return module(*batch)


def rank_leg(root: str, replicated: int, resume: bool) -> dict[str, Any]:
    """Train to SAVED and save, or resume from ``root`` and train to STEPS."""
    rank, world = dist.get_rank(), dist.get_world_size()
    net = Net()
    if resume:
        with torch.no_grad():  # other weights: everything must come from the checkpoint
            for p in net.parameters():
                p.add_(1.0)
    engine = ZeroEngine(bucket_mb=0.001, replicated_chunks=replicated)
    engine.setup(net, [{"params": list(net.parameters())}], adamw)
    state = engine.state()
    local = BATCH // world
    losses = []
    with Checkpointer(root, stage2="inline") as ckpt:
        first = ckpt.load(state) + 1 if resume else 0
        for tokens, targets in data()[first : STEPS if resume else SAVED]:
            mine = iter(
                [
                    (
                        tokens[rank * local : (rank + 1) * local],
                        targets[rank * local : (rank + 1) * local],
                    )
                ]
            )
            loss = engine.step(mine.__next__, _loss, grad_accum=1, max_norm=None).loss
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        if not resume:
            ckpt.save(SAVED - 1, state).wait(timeout=DEADLINE)
    model = state["model"].state_dict()
    return {"losses": losses, "model": {k: v.clone() for k, v in model.items()}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 1), (2, 0)), ((2, 0), (2, 1)), ((2, 1), (4, 2))],
    ids=lambda c: f"dp{c[0]}-replicated{c[1]}",
)
def test_a_checkpoint_resumes_with_other_replicated_chunks(
    tmp_path: Path, before: tuple[int, int], after: tuple[int, int]
) -> None:
    ref_losses, ref_model = one_process()
    root = str(tmp_path / "ckpt")
    saved = run_ranks(rank_leg, before[0], args=(root, before[1], False), timeout=120)
    resumed = run_ranks(rank_leg, after[0], args=(root, after[1], True), timeout=120)
    for r in saved:
        assert r["losses"] == pytest.approx(ref_losses[:SAVED], rel=1e-5)
    for r in resumed:
        assert r["losses"] == pytest.approx(ref_losses[SAVED:], rel=1e-5)
        for name, value in ref_model.items():
            torch.testing.assert_close(r["model"][name], value, rtol=1e-5, atol=1e-6, msg=name)
