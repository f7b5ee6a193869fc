"""Test support shared by the ms-ckpt tests; also a small trainer run as a script.

``FaultyFileSystem`` must be importable by name in the stage-2 writer process (it is
pickled to it), so it lives in this plain module; the tests put this folder on
``sys.path``, and the writer inherits the trainer's ``sys.path``.

As a script: ``python _ckpt_support.py train ROOT STEPS SAVE_AT [resume]`` trains a
tiny model with dropout and prints one JSON line of per-step losses (``float.hex``);
``python _ckpt_support.py hang ROOT POINT`` commits step 1, then saves step 2 with the
``MS_CKPT_TEST_PAUSE`` hook set to ``POINT:60``, prints the writer's pid and the host
buffer's name, and sleeps until killed.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from typing import Any

import torch
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

from ms_ckpt import Checkpointer, rng_state


class _FaultyOpener(LocalFileOpener):  # type: ignore[misc]
    def __init__(self, *args: Any, flag: str, err: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._flag, self._err = flag, err

    def write(self, data: Any) -> int:
        if os.path.exists(self._flag):
            raise OSError(self._err, os.strerror(self._err), self.path)
        return int(self.f.write(data))


class FaultyFileSystem(LocalFileSystem):  # type: ignore[misc]
    """The local filesystem, except that every write raises ``OSError(err)`` while the
    file ``flag`` exists: a real error through the real writer's code path."""

    def __init__(self, flag: str, err: int = errno.ENOSPC, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flag, self.err = flag, err

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "w" in mode or "a" in mode:
            return _FaultyOpener(path, mode, fs=self, flag=self.flag, err=self.err, **kwargs)
        return super()._open(path, mode, block_size, **kwargs)


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


def hang(root: str, point: str) -> None:
    ckpt = Checkpointer(root)
    state = big_state()
    ckpt.save(1, state).wait()
    os.environ["MS_CKPT_TEST_PAUSE"] = f"{point}:60"
    ckpt.save(2, state)
    print(json.dumps({"writer": ckpt.writer_pid, "pool": ckpt._pool.name}), flush=True)
    time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        resume = len(sys.argv) > 5 and sys.argv[5] == "resume"
        print(json.dumps(train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), resume)))
    else:
        hang(sys.argv[2], sys.argv[3])
