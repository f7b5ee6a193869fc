"""Token shard format, tree-based node loading through shared memory, prefetch.

Nothing public ships yet; see README.md for what this package will hold.
"""

from ms_data._version import __version__

__all__ = ["__version__"]
