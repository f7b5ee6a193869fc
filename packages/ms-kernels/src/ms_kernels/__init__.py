"""Triton fused kernels (LayerNorm, RMSNorm, bias+GeLU, sliding-window attention) with torch
reference paths and flash-attn dispatch.

Nothing public ships yet; see README.md for what this package will hold.
"""

from ms_kernels._version import __version__

__all__ = ["__version__"]
