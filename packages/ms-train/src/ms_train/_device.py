"""Where a rank trains: its device (``train.device``) and autocast dtype
(``train.precision``), and the torchrun variables that place it.
"""

from __future__ import annotations

import os

import torch

from ms_train.config import ConfigError

__all__ = ["env_int", "resolve_device", "resolve_precision"]


def env_int(name: str, default: int) -> int:
    """Environment variable ``name`` as an int (torchrun's ``WORLD_SIZE``, ``LOCAL_RANK``
    ...), ``default`` when it is not set."""
    value = os.environ.get(name)
    return default if value is None else int(value)


def resolve_device(choice: str, local_rank: int) -> torch.device:
    """The device of ``train.device = choice`` for this node's ``local_rank``."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device is 'cuda' but CUDA is not available here")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_precision(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for fp32."""
    if choice == "fp32":
        return None
    if choice == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.precision is 'bf16' but this GPU does not support bf16")
        return torch.bfloat16
    # auto: bf16 where it is fast (CUDA with bf16 support); fp32 on CPU.
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None
