"""The composition: GPT model, typed config, CLI and an embedded demo.

Built so far: the configuration (``ms_train.config``), the GPT model on ms-kernels ops
(``ms_train.model``) and model-FLOPs / MFU accounting (``ms_train.flops``). The trainer,
the ``ms-train`` command and the demo are not built yet (README.md).
"""

from ms_train._version import __version__
from ms_train.config import PRESETS, Config, ConfigError, ModelConfig, load_config
from ms_train.flops import FlopsPerToken, flops_per_token, mfu
from ms_train.model import GPT

__all__ = [
    "GPT",
    "PRESETS",
    "Config",
    "ConfigError",
    "FlopsPerToken",
    "ModelConfig",
    "__version__",
    "flops_per_token",
    "load_config",
    "mfu",
]
