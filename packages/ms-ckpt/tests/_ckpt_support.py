"""Test support shared by the ms-ckpt tests; also a small trainer run as a script.

As a script: ``python _ckpt_support.py train ROOT STEPS SAVE_AT [resume]`` trains a
tiny model with dropout and prints one JSON line of per-step losses (``float.hex``);
``python _ckpt_support.py hang ROOT POINT [STEP]`` commits the steps before ``STEP``
(default 2; none when it is 1), then saves ``STEP`` with stage 2 held at ``POINT`` for
60 s (``_writer_faults.PauseAt``), prints its own pid, the writer's pid and the host
buffer's name as one JSON line, and sleeps until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch
from _writer_faults import PauseAt

from ms_ckpt import Checkpointer, rng_state


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)  # type: ignore[no-any-return]


def train(root: str, steps: int, save_at: int, resume: bool) -> list[str]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, Any] = {"model": model, "optim": opt, "rng": rng_state(), "step": 0}
    losses: list[str] = []
    with Checkpointer(root) as ckpt:
        if resume:
            ckpt.load(state)
        for step in range(state["step"] + 1, steps + 1):
            x = torch.randn(16, 8)  # data drawn from the checkpointed RNG
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss).hex())
            state["step"] = step
            if step == save_at and not resume:
                ckpt.save(step, state)
    return losses


def big_state() -> dict[str, torch.Tensor]:
    """12 tensors of 16 KiB of random (incompressible) values, the same on every call."""
    return {
        f"t{i}": torch.rand(64, 64, generator=torch.Generator().manual_seed(i)) for i in range(12)
    }


def hang(root: str, point: str, step: int) -> None:
    ckpt = Checkpointer(root, hook=PauseAt(point, 60, steps=[step]))
    state = big_state()
    for earlier in range(1, step):
        ckpt.save(earlier, state).wait(timeout=60)
    ckpt.save(step, state)
    info = {"trainer": os.getpid(), "writer": ckpt.writer_pid, "pool": ckpt._pool.name}
    print(json.dumps(info), flush=True)
    time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        resume = len(sys.argv) > 5 and sys.argv[5] == "resume"
        print(json.dumps(train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), resume)))
    else:
        hang(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 2)
