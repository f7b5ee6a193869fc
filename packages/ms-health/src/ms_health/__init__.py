"""Heartbeats, driver, fault detection, diagnostics, automatic recovery, per-rank timelines.

Nothing public ships yet; see README.md for what this package will hold.
"""

from ms_health._version import __version__

__all__ = ["__version__"]
