"""ZeRO data parallel with overlap, tensor/sequence parallel with chunked collective matmul,
interleaved 1F1B pipeline with decoupled async p2p.

Nothing public ships yet; see README.md for what this package will hold.
"""

from ms_parallel._version import __version__

__all__ = ["__version__"]
