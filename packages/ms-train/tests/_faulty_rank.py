"""``ms-train`` on two simulated nodes under ms-health, whose ranks can be given faults
from inside: the fault-injection tests of the health issue.

    python -m _faulty_rank CONFIG NODE_ARGS_JSON [FAULT ...]

launches this node (``launch(..., module="_faulty_rank")`` with the ``Nodes`` of
NODE_ARGS_JSON); each rank trains CONFIG with a :class:`FaultyTrainer` that applies the
FAULTs meant for it. A FAULT is ``kind:rank:step[:arg]``:

- ``nan:R:K``: rank R's loss is NaN at step K (its weights poisoned), once per job: a
  marker file beside the config records that it happened, so the rolled-back rerun of
  step K is clean;
- ``gil:R:K``: rank R enters, at step K and once per job, a C call that holds the GIL
  and never checks for signals (``sum`` over a huge range);
- ``slow:R:K:F``: from step K on, rank R's steps take F times as long (it sleeps).

Crashes and hangs (SIGKILL, SIGSTOP) come from the test, from outside.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import torch

from ms_train._launch import launch, run_rank
from ms_train._nodes import Nodes
from ms_train.config import load_config
from ms_train.trainer import Trainer


class FaultyTrainer(Trainer):
    faults: ClassVar[list[tuple[str, int, int, float]]] = []
    markers: ClassVar[Path] = Path(".")
    _last_start: float | None = None

    def train_step(self, step: int) -> Any:
        done = step + 1
        slow = 1.0
        for kind, rank, at, arg in self.faults:
            if rank != self.rank:
                continue
            if kind == "slow" and done >= at:
                slow = arg
            if done != at:
                continue
            marker = self.markers / f"{kind}-{rank}-{at}.done"
            if kind in ("nan", "gil") and not marker.exists():
                marker.write_text(str(os.getpid()))
                if kind == "nan":
                    with torch.no_grad():
                        for p in self.model.parameters():
                            p.fill_(float("nan"))
                else:
                    sum(range(10**15))
        now = time.perf_counter()
        if slow > 1.0 and self._last_start is not None:
            # The whole step slower, as a slower machine would be: the sleep comes before
            # the step's compute, where its peers then wait for it in the collectives.
            time.sleep((now - self._last_start) * (slow - 1.0) / slow)
        self._last_start = time.perf_counter()
        return super().train_step(step)


def _fault(text: str) -> tuple[str, int, int, float]:
    kind, rank, step, *arg = text.split(":")
    return kind, int(rank), int(step), float(arg[0]) if arg else 0.0


def main(argv: list[str]) -> int:
    config_path, node_args, *faults = argv
    config = load_config(config_path)
    if "WORLD_SIZE" not in os.environ:
        spec = json.loads(node_args)
        nproc = spec.pop("nproc")
        return launch(nproc, argv, config, module="_faulty_rank", nodes=Nodes(**spec))
    FaultyTrainer.faults = [_fault(f) for f in faults]
    FaultyTrainer.markers = Path(config_path).parent
    return run_rank(config, 1e9, trainer_cls=FaultyTrainer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
