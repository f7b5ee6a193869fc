"""The learning-rate schedule: linear warm-up from 0, then cosine decay to a floor."""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Steps ``0 .. warmup_steps - 1`` rise linearly to ``lr`` (step ``i`` uses
    ``lr * (i + 1) / warmup_steps``, so the first update is not wasted at 0); from there
    a half cosine falls to ``min_lr`` at the last step, ``total_steps - 1``. Steps past
    the end stay at ``min_lr``.
    """
    for name, value in (("step", step), ("warmup_steps", warmup_steps)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if type(total_steps) is not int or total_steps < 1:
        raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
    if warmup_steps > total_steps:
        raise ValueError(
            f"warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps})"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not (math.isfinite(min_lr) and 0 <= min_lr <= lr):
        raise ValueError(f"min_lr must be a number in [0, lr={lr}], got {min_lr!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = total_steps - 1 - warmup_steps
    if decay_steps <= 0:
        return lr if step < total_steps else min_lr
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
