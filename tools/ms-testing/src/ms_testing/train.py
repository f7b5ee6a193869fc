"""A small ms-train run as a TOML file, for tests and benchmarks that launch the CLI.

A GPT of 2 layers and 2 heads whose width, sequence length, window and batches scale
together (``width`` 64: d_model 64, seq_len 64, window 32, micro-batch 8, global batch
16), byte tokens, a loss line every step and no sample: a few seconds a step on 2
gloo ranks of a 2-core machine.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_train_config"]


def write_train_config(
    path: Path,
    *,
    shards: Path,
    out_dir: Path,
    steps: int,
    every: int,
    width: int = 64,
    checkpoint_dir: Path | None = None,
    micro_batch: int | None = None,
    log_every: int = 1,
    tp: int = 1,
) -> Path:
    """Write the run's TOML to ``path`` (checkpoints every ``every`` steps, 0: at the end
    only; under ``out_dir/ckpt`` unless ``checkpoint_dir``; ``micro_batch`` smaller than
    the width's for more data-parallel ranks; ``log_every`` > 1 for less of rank 0's own
    work per step; ``tp`` > 1 for tensor parallelism); returns ``path``."""
    ckpt = "" if checkpoint_dir is None else f"dir = {json.dumps(str(checkpoint_dir))}\n"
    path.write_text(
        f"""[model]
vocab_size = 257
d_model = {width}
n_layers = 2
n_heads = 2
seq_len = {width}
window = {width // 2}

[data]
shards = {json.dumps(str(shards))}
micro_batch = {width // 8 if micro_batch is None else micro_batch}
global_batch = {width // 4}

[optim]
warmup_steps = 3

[parallel]
tp = {tp}

[train]
steps = {steps}
out_dir = {json.dumps(str(out_dir))}
log_every = {log_every}
sample_tokens = 0

[checkpoint]
every = {every}
{ckpt}"""
    )
    return path
