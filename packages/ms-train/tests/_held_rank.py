"""``ms-train --nproc 2`` whose ranks hold their checkpoint saves in stage 2.

``python -m _held_rank CONFIG FIRST SECONDS MARKER`` launches 2 ranks through the
``ms-train`` launcher; each rank trains CONFIG like ``ms-train --config CONFIG`` with a
``Checkpointer`` whose saves from step FIRST on are held SECONDS in stage 2
(``_save_hooks.HoldSaves``): a test signals the job while a save is in flight.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from _save_hooks import HoldSaves

from ms_ckpt import Checkpointer
from ms_train._launch import launch, run_rank
from ms_train.config import load_config
from ms_train.trainer import Trainer


class HeldTrainer(Trainer):
    hold: HoldSaves

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpointer.finalize()  # nothing saved yet: swapped for one with the hook
        self.checkpointer = Checkpointer(
            self.checkpoint_dir, keep_last=self.config.checkpoint.keep_last, hook=self.hold
        )


def main(argv: list[str]) -> int:
    config = load_config(argv[0])
    if "WORLD_SIZE" not in os.environ:
        return launch(2, argv, config, module="_held_rank")
    HeldTrainer.hold = HoldSaves(int(argv[1]), float(argv[2]), argv[3])
    return run_rank(config, 1e9, trainer_cls=HeldTrainer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
