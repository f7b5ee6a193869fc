"""The composition: GPT model, typed config, CLI and an embedded demo.

Nothing public ships yet; see README.md for what this package will hold.
"""

from ms_train._version import __version__

__all__ = ["__version__"]
