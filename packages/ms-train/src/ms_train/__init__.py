"""The composition: GPT model, typed config, trainer, CLI and an embedded demo.

``ms_train.config`` (typed configuration and presets), ``ms_train.model`` (the GPT on
ms-kernels ops), ``ms_train.trainer`` (the loop over ms-data, ms-optim and ms-ckpt),
``ms_train.engine`` (the step engines by name: ms-parallel's ZeRO-2 and DDP),
``ms_train.flops`` (model FLOPs and MFU) and the ``ms-train`` command (``ms_train.cli``).

The names below load on first use (PEP 562): the launcher and a config error import
neither the model nor the engines, whose ms-parallel pulls in DTensor.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ms_train._version import __version__

if TYPE_CHECKING:
    from ms_train._stop import Stopped
    from ms_train._tp_model import parallelize
    from ms_train.config import PRESETS, Config, ConfigError, ModelConfig, load_config
    from ms_train.engine import DDPEngine, StepEngine, ZeroEngine
    from ms_train.flops import FlopsPerToken, flops_per_token, mfu
    from ms_train.model import GPT
    from ms_train.trainer import RunSummary, Trainer, build_optimizer

#: Public name -> the module that defines it.
_HOMES = {
    "GPT": "ms_train.model",
    "PRESETS": "ms_train.config",
    "Config": "ms_train.config",
    "ConfigError": "ms_train.config",
    "DDPEngine": "ms_train.engine",
    "FlopsPerToken": "ms_train.flops",
    "ModelConfig": "ms_train.config",
    "RunSummary": "ms_train.trainer",
    "StepEngine": "ms_train.engine",
    "Stopped": "ms_train._stop",
    "Trainer": "ms_train.trainer",
    "ZeroEngine": "ms_train.engine",
    "build_optimizer": "ms_train.trainer",
    "flops_per_token": "ms_train.flops",
    "load_config": "ms_train.config",
    "mfu": "ms_train.flops",
    "parallelize": "ms_train._tp_model",
}

__all__ = [
    "GPT",
    "PRESETS",
    "Config",
    "ConfigError",
    "DDPEngine",
    "FlopsPerToken",
    "ModelConfig",
    "RunSummary",
    "StepEngine",
    "Stopped",
    "Trainer",
    "ZeroEngine",
    "__version__",
    "build_optimizer",
    "flops_per_token",
    "load_config",
    "mfu",
    "parallelize",
]


if not TYPE_CHECKING:  # mypy sees the imports above, and so still catches a misspelt name

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module 'ms_train' has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        globals()[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_HOMES})
