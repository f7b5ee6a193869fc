"""The ``Stateful`` protocol and the RNG-state helper.

Anything with ``state_dict()`` / ``load_state_dict()`` is saved through them: modules,
optimizers, data loaders, user objects. ``rng_state()`` makes the process's random
number generators one such object, so resumed training draws the same numbers.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["RNGState", "Stateful", "rng_state"]


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


class RNGState:
    """The torch CPU, torch CUDA (every visible device), numpy and python RNG states."""

    VERSION = 1

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return {
            "version": self.VERSION,
            "torch": torch.get_rng_state(),
            "cuda": list(cuda),
            "numpy": _numpy_state(),
            "python": random.getstate(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        version = state_dict.get("version")
        if version != self.VERSION:
            raise ValueError(f"RNG state version must be {self.VERSION}, got {version!r}")
        cuda = list(state_dict["cuda"])
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cuda and len(cuda) != have:
            # A different number of devices cannot resume the same random streams.
            raise ValueError(
                f"RNG state holds {len(cuda)} CUDA generators, this process sees {have} devices"
            )
        torch.set_rng_state(state_dict["torch"])
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
        if state_dict["numpy"] is not None:
            import numpy as np

            np.random.set_state(state_dict["numpy"])
        random.setstate(state_dict["python"])


def _numpy_state() -> Any:
    # numpy is not a dependency of ms-ckpt: its generator is saved when it is installed.
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


def rng_state() -> RNGState:
    """A Stateful view of this process's RNGs: put it in the saved state as e.g. ``"rng"``."""
    return RNGState()
