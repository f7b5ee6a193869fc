"""The composition: GPT model, typed config, trainer, CLI and an embedded demo.

``ms_train.config`` (typed configuration and presets), ``ms_train.model`` (the GPT on
ms-kernels ops), ``ms_train.trainer`` (the loop over ms-data, ms-optim and ms-ckpt),
``ms_train.engine`` (the step engines by name: ms-parallel's ZeRO-2 and DDP),
``ms_train.flops`` (model FLOPs and MFU) and the ``ms-train`` command (``ms_train.cli``).
"""

from ms_train._stop import Stopped
from ms_train._version import __version__
from ms_train.config import PRESETS, Config, ConfigError, ModelConfig, load_config
from ms_train.engine import DDPEngine, StepEngine, ZeroEngine
from ms_train.flops import FlopsPerToken, flops_per_token, mfu
from ms_train.model import GPT
from ms_train.trainer import RunSummary, Trainer, build_optimizer

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
]
