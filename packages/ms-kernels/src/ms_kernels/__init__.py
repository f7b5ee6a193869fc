"""Triton fused kernels with torch reference paths: norms, bias + GeLU, windowed attention.

Each op comes in three layers: a Triton kernel behind a ``torch.autograd.Function``,
a functional API (``layer_norm``, ``rms_norm``, ``bias_gelu`` and the fused
residual-add forms) and an ``nn.Module`` drop-in (``LayerNorm``, ``RMSNorm``,
``BiasGeLU``), plus the torch reference with identical semantics
(``*_reference``). Every entry point takes ``backend="auto" | "triton" | "torch"``;
``auto`` picks Triton for CUDA tensors and torch elsewhere, per call.

Sliding-window attention (``sliding_window_attention``, ``SlidingWindowAttention``)
follows flash-attn's layout and window convention and adds ``backend="flash"``
(flash-attn's own kernel); its torch path works in query chunks, O(S*W) memory.
"""

from ms_kernels._version import __version__
from ms_kernels.attention import (
    AttentionBackend,
    SlidingWindowAttention,
    attention_reference,
    hf_window,
    sliding_window_attention,
    window_mask,
)
from ms_kernels.bias_gelu import BiasGeLU, bias_gelu, bias_gelu_reference
from ms_kernels.layer_norm import (
    MAX_HIDDEN,
    LayerNorm,
    add_layer_norm,
    add_layer_norm_reference,
    layer_norm,
    layer_norm_reference,
)
from ms_kernels.rms_norm import (
    RMSNorm,
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)

__all__ = [
    "MAX_HIDDEN",
    "AttentionBackend",
    "BiasGeLU",
    "LayerNorm",
    "RMSNorm",
    "SlidingWindowAttention",
    "__version__",
    "add_layer_norm",
    "add_layer_norm_reference",
    "add_rms_norm",
    "add_rms_norm_reference",
    "attention_reference",
    "bias_gelu",
    "bias_gelu_reference",
    "hf_window",
    "layer_norm",
    "layer_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "sliding_window_attention",
    "window_mask",
]
