"""LAMB: paper-exact, multi-tensor, ZeRO-shard aware.

Nothing public ships yet; see README.md for what this package will hold.
"""

from ms_optim._version import __version__

__all__ = ["__version__"]
