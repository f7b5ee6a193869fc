"""Two-stage checkpointing with atomic commit and broadcast recovery.

Nothing public ships yet; see README.md for what this package will hold.
"""

from ms_ckpt._version import __version__

__all__ = ["__version__"]
