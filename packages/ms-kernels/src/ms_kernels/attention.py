"""Sliding-window attention: flash-attn, a Triton kernel, and a chunked O(S*W) torch path.

The call follows flash-attn's ``flash_attn_func(q, k, v, dropout_p, softmax_scale,
causal, window_size, ..., deterministic)``: same positional order, same keywords for
those, same layout and the same window rules, so such calls port without edits
(``softcap``, ``alibi_slopes`` and ``return_attn_probs`` are not taken: TypeError).
Tensors are (batch, seqlen, heads, head_dim); ``k`` and ``v`` may have fewer heads
than ``q`` (grouped-query attention: query head ``h`` reads kv head
``h // (Hq // Hkv)``). A window ``(left, right)`` is inclusive and bottom-right aligned:
with ``Sq`` queries and ``Sk`` keys, query ``i`` attends to the keys ``j`` with
``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``causal=True`` is ``right = 0``.

Two ways to give it. ``window_size=(left, right)`` is flash-attn's, read by its rules
(``_flash_window``): -1 is unbounded, ``causal`` overrides the right side, and a -1
beside a bounded side means ``Sk``. ``window=(left, right)`` is ours, taken as written,
with ``None`` or -1 for an unbounded side; ``causal=True`` beside a window that reaches
right is an error there. A Hugging Face style window of ``W`` tokens, the current one
included, is ``(W - 1, 0)``: use ``hf_window(W)``, because that off-by-one has bitten
several projects.

``dropout_p`` drops attention weights after the softmax and scales the survivors by
``1 / (1 - p)``, as flash-attn does; the torch path draws its masks from the default
generator of the inputs' device (so ``torch.manual_seed`` governs them) and redraws
them in the backward from a saved seed. The Triton kernel has no dropout and refuses
``dropout_p > 0``.

A query whose window holds no key (possible when ``Sq > Sk``, or with ``(0, 0)``
windows off the diagonal) gets a zero output and zero gradients, as in flash-attn;
SDPA with a boolean mask gives NaN there instead. Keys that no query of a block (or
chunk) attends are never read, so NaN or inf there cannot reach any result.

Backends, chosen per call: ``"flash"`` (flash-attn's ``flash_attn_func``; CUDA,
fp16/bf16), ``"triton"`` (our FlashAttention-2 style kernel, which skips key blocks
outside the window in both passes), ``"torch"`` (query chunks against only the keys
their window can reach, with a hand-written backward that recomputes the scores, so
memory is O(S*W) in both passes, not O(S^2)). ``"auto"`` takes flash, then Triton, on
CUDA, and torch elsewhere.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from ms_kernels._backend import resolve_backend, triton_available

__all__ = [
    "AttentionBackend",
    "SlidingWindowAttention",
    "attention_reference",
    "hf_window",
    "sliding_window_attention",
    "window_mask",
]

AttentionBackend = Literal["auto", "flash", "triton", "torch"]
_BACKENDS = ("auto", "flash", "triton", "torch")
_FLASH_MAX_HEAD_DIM = 256
# Queries per chunk on the torch path: large enough that the matmuls are efficient,
# small enough that a chunk's scores (chunk x (chunk + window)) stay in cache-sized
# pieces. Chunks only trade speed; results do not depend on the size.
_TORCH_CHUNK = 256


def hf_window(tokens: int) -> tuple[int, int]:
    """The ``(left, right)`` window for a causal window of ``tokens`` tokens, itself included.

    Hugging Face (Mistral ``sliding_window``, Gemma) counts the current token in the
    window: ``W`` tokens means ``W - 1`` keys to the left and none to the right.
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1 (the current token counts), got {tokens!r}")
    return (tokens - 1, 0)


def _check_window_pair(name: str, window: object) -> tuple[int | None, int | None]:
    """``window`` as a ``(left, right)`` pair of ints ``>= 0``, -1 or None; -1 becomes None."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"{name} must be (left, right), got {window!r}")
    sides: list[int | None] = []
    for side, value in zip(("left", "right"), window, strict=True):
        if value is None or (type(value) is int and value == -1):
            sides.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name} must be (left, right) with {side} an int >= 0, or -1 or None for "
                f"unbounded, got {tuple(window)!r}"
            )
        sides.append(value)
    return sides[0], sides[1]


def _normalize_window(
    window: Sequence[int | None] | None, causal: bool
) -> tuple[int | None, int | None]:
    """ms-kernels' ``window=``: ``(left, right)`` with ``None`` for an unbounded side.

    The window is taken as written: ``-1`` (or ``None``) is unbounded, whatever the
    lengths, and ``causal=True`` beside a window that reaches right is refused.
    """
    if window is None:
        left, right = None, None
    else:
        left, right = _check_window_pair("window", window)
    if causal:
        if right not in (None, 0):
            raise ValueError(
                f"causal=True means window right = 0; got window {tuple(window or ())!r} "
                "(pass causal=False to see keys to the right)"
            )
        right = 0
    return left, right


def _flash_window(
    window_size: Sequence[int], causal: bool, sq: int, sk: int
) -> tuple[int | None, int | None]:
    """flash-attn's ``window_size=`` read the way flash-attn 2 reads it (flash_api.cpp).

    A side ``>= Sk`` becomes -1; ``causal`` forces right to 0 (even over a wider right
    side: transformers passes ``(W, W)`` with ``causal=True``); and when exactly one side
    is -1 it is set to ``Sk``. That last rule bounds an "unbounded" right side at Sk
    keys, which differs from unbounded when ``Sq > Sk + 1``; we follow flash-attn.
    """
    left, right = _check_window_pair("window_size", window_size)
    if left is not None and left >= sk:
        left = None
    if right is not None and right >= sk:
        right = None
    if causal:
        right = 0
    if left is None and right is not None:
        return None, right  # flash-attn's left = Sk reaches key 0 from every query
    if left is not None and right is None:
        return left, sk
    return left, right


def _canonical(
    left: int | None, right: int | None, sq: int, sk: int
) -> tuple[int | None, int | None]:
    """The same mask with every side that reaches past the sequence written as None."""
    if left is not None and left >= sk - 1:
        left = None
    if right is not None and right >= sq - 1:
        right = None
    return left, right


_UNSET_WINDOW_SIZE = (-1, -1)


def _resolve_window(
    window: Sequence[int | None] | None,
    window_size: Sequence[int] | None,
    causal: bool,
    sq: int,
    sk: int,
) -> tuple[int | None, int | None]:
    """``(left, right)`` from whichever of ``window`` / ``window_size`` the caller used."""
    if window_size is not None and window is not None:
        _check_window_pair("window_size", window_size)
        if tuple(window_size) != _UNSET_WINDOW_SIZE:
            raise ValueError(
                f"pass window (ms-kernels' convention) or window_size (flash-attn's), not "
                f"both; got window={window!r} and window_size={window_size!r}"
            )
    if window is None and window_size is not None:
        return _flash_window(window_size, causal, sq, sk)
    return _normalize_window(window, causal)


def window_mask(
    sq: int,
    sk: int,
    window: Sequence[int | None] | None = None,
    *,
    causal: bool = False,
    window_size: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean ``(sq, sk)`` mask, True where a query may attend to a key.

    The O(Sq*Sk) definition of the window, for references and for SDPA baselines.
    ``window_size`` reads a flash-attn window instead, by flash-attn's rules.
    """
    left, right = _resolve_window(window, window_size, causal, sq, sk)
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left is not None:
        allowed &= j >= i - left
    if right is not None:
        allowed &= j <= i + right
    return allowed


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: Sequence[int | None] | None = None,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: Sequence[int] | None = None,
) -> torch.Tensor:
    """Attention with a full ``(Sq, Sk)`` mask, in the inputs' dtype: the definition.

    O(S^2) memory, no dropout. Queries with no key in their window get zeros (not
    SDPA's NaN). ``window_size`` takes a flash-attn window instead of ``window``.
    """
    scale = _check_inputs(q, k, v, softmax_scale)
    sq, hq = q.shape[1], q.shape[2]
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    allowed = window_mask(sq, sk, window, causal=causal, window_size=window_size, device=q.device)
    qh = q.transpose(1, 2)  # (B, Hq, Sq, D)
    kh = k.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty rows: 0/0 -> 0
    return (probs @ vh).transpose(1, 2)


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None
) -> float:
    """Validate shapes, dtypes and devices; return the softmax scale to use."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    b, _, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(
            "k must match q in batch and head_dim (dims 0 and 3), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"q heads must be a multiple of k/v heads (grouped-query attention), got {hq} "
            f"query heads and {hkv} k/v heads"
        )
    if d == 0:
        raise ValueError(f"head_dim must be >= 1, got shape {tuple(q.shape)}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return float(softmax_scale)


# --- the torch path: query chunks, each against the keys its window reaches -------------


def _key_range(a: int, b: int, sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """Keys ``[lo, hi)`` that any query in ``[a, b)`` may see (empty when ``lo >= hi``)."""
    off = sk - sq
    return max(0, a + off - left), min(sk, b - 1 + off + right + 1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _ChunkState:
    """Per-call views shared by the chunked forward and backward."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, left: int, right: int) -> None:
        self.b, self.sq, self.hq, self.d = q.shape
        self.sk, self.hkv = k.shape[1], k.shape[2]
        self.group = self.hq // self.hkv
        self.left, self.right = left, right

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, Hq, D) -> (B, Hkv, G, S, D) view: a kv head's query heads side by side."""
        return x.view(x.shape[0], x.shape[1], self.hkv, self.group, x.shape[3]).permute(
            0, 2, 3, 1, 4
        )

    def chunk(
        self, q5: torch.Tensor, kh: torch.Tensor, a: int, b: int, lo: int, hi: int, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of queries ``[a, b)`` against keys ``[lo, hi)``, masked, as (B, Hkv, G*C, L)."""
        ct = kh.dtype
        rows_n = self.group * (b - a)  # explicit: -1 is ambiguous when batch is 0
        qc = q5[:, :, :, a:b].to(ct).reshape(self.b, self.hkv, rows_n, self.d)
        scores = (qc @ kh[:, :, lo:hi].transpose(-1, -2)).mul_(scale)
        rows = torch.arange(a, b, device=kh.device).unsqueeze(1) + (self.sk - self.sq)
        cols = torch.arange(lo, hi, device=kh.device).unsqueeze(0)
        outside = (cols < rows - self.left) | (cols > rows + self.right)  # (C, L)
        scores = scores.view(self.b, self.hkv, self.group, b - a, hi - lo)
        scores.masked_fill_(outside, float("-inf"))
        return scores.view(self.b, self.hkv, rows_n, hi - lo), qc


class _ChunkedAttention(torch.autograd.Function):
    """O(S*W) attention on any device; saves q, k, v, out and the log-sum-exp only."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        left: int,
        right: int,
        scale: float,
        chunk: int,
        dropout_p: float,
        seed: int,
    ) -> torch.Tensor:
        st = _ChunkState(q, k, left, right)
        drop = _Dropout(dropout_p, seed, q.device)
        ct = _compute_dtype(q.dtype)
        out = torch.empty(st.b, st.sq, st.hq, st.d, dtype=q.dtype, device=q.device)
        lse = torch.full((st.b, st.hkv, st.group, st.sq), float("inf"), dtype=ct, device=q.device)
        q5, out5 = st.heads(q), st.heads(out)
        kh, vh = k.transpose(1, 2).to(ct), v.transpose(1, 2).to(ct)  # (B, Hkv, Sk, D)
        for a in range(0, st.sq, chunk):
            b = min(a + chunk, st.sq)
            lo, hi = _key_range(a, b, st.sq, st.sk, left, right)
            if lo >= hi:
                out5[:, :, :, a:b] = 0
                continue
            scores, _ = st.chunk(q5, kh, a, b, lo, hi, scale)
            row_max = scores.amax(dim=-1, keepdim=True)
            # A row with every key masked has max -inf; offsetting by 0 keeps exp() at 0.
            row_max = torch.where(torch.isinf(row_max), 0.0, row_max)
            probs = scores.sub_(row_max).exp_()
            total = probs.sum(dim=-1, keepdim=True)
            if drop.active:
                probs.mul_(drop.next_mask(probs))  # after the sum: lse is dropout's
            o = (probs @ vh[:, :, lo:hi]) / torch.where(total > 0, total, 1.0)
            out5[:, :, :, a:b] = o.view(st.b, st.hkv, st.group, b - a, st.d)
            row_lse = torch.where(total > 0, row_max + total.log(), float("inf"))
            lse[:, :, :, a:b] = row_lse.view(st.b, st.hkv, st.group, b - a)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (left, right, scale, chunk, dropout_p, seed)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        left, right, scale, chunk, dropout_p, seed = ctx.config
        st = _ChunkState(q, k, left, right)
        # The same seed and the same chunks, in the same order: the forward's masks again.
        drop = _Dropout(dropout_p, seed, q.device)
        ct = lse.dtype
        kh, vh = k.transpose(1, 2).to(ct), v.transpose(1, 2).to(ct)
        q5, do5, o5 = st.heads(q), st.heads(dout), st.heads(out)
        dq = torch.zeros(st.b, st.sq, st.hq, st.d, dtype=ct, device=q.device)
        dq5 = st.heads(dq)
        # dk, dv in k's (B, Sk, Hkv, D) layout, so autograd takes them without a copy.
        dk = torch.zeros(st.b, st.sk, st.hkv, st.d, dtype=ct, device=q.device)
        dv = torch.zeros_like(dk)
        dkh, dvh = dk.transpose(1, 2), dv.transpose(1, 2)
        for a in range(0, st.sq, chunk):
            b = min(a + chunk, st.sq)
            lo, hi = _key_range(a, b, st.sq, st.sk, left, right)
            if lo >= hi:
                continue
            scores, qc = st.chunk(q5, kh, a, b, lo, hi, scale)
            # lse is +inf on rows with no key, which makes every probability exactly 0.
            rows_n = st.group * (b - a)
            row_lse = lse[:, :, :, a:b].reshape(st.b, st.hkv, rows_n, 1)
            probs = scores.sub_(row_lse).exp_()
            do = do5[:, :, :, a:b].to(ct).reshape(st.b, st.hkv, rows_n, st.d)
            o = o5[:, :, :, a:b].to(ct).reshape(st.b, st.hkv, rows_n, st.d)
            # rowsum(dO * O) = sum_j P dP, dropout or not: O already holds the dropped P.
            delta = (do * o).sum(dim=-1, keepdim=True)
            dpv = do @ vh[:, :, lo:hi].transpose(-1, -2)
            if drop.active:
                # out = (P * Z) V with Z = keep / (1 - p): dV sees P * Z, dP sees dO V^T * Z.
                keep = drop.next_mask(probs)
                dvh[:, :, lo:hi] += (probs * keep).transpose(-1, -2) @ do
                dpv.mul_(keep)
            else:
                dvh[:, :, lo:hi] += probs.transpose(-1, -2) @ do
            dscores = dpv.sub_(delta).mul_(probs)
            dscores.mul_(scale)
            dq5[:, :, :, a:b] = (dscores @ kh[:, :, lo:hi]).view(
                st.b, st.hkv, st.group, b - a, st.d
            )
            dkh[:, :, lo:hi] += dscores.transpose(-1, -2) @ qc
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


class _Dropout:
    """Dropout masks of the chunked path, one per visited chunk, from one seed.

    A chunk's mask is drawn when the chunk is visited, so the backward, visiting the
    same chunks in the same order from the same seed, redraws exactly the forward's
    masks without storing them (memory stays O(chunk * window)).
    """

    def __init__(self, p: float, seed: int, device: torch.device) -> None:
        self.active = p > 0
        self.p = p
        self.gen: torch.Generator | None = None
        if self.active:
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(seed)

    def next_mask(self, like: torch.Tensor) -> torch.Tensor:
        """``keep / (1 - p)`` shaped like ``like``: 0 with probability p (as flash-attn)."""
        draw = torch.rand(like.shape, generator=self.gen, dtype=like.dtype, device=like.device)
        return draw.ge_(self.p).to(like.dtype).mul_(1.0 / (1.0 - self.p))


def _dropout_seed(device: torch.device) -> int:
    """A seed from the default generator of ``device``: ``torch.manual_seed`` governs it,
    as it governs flash-attn's dropout."""
    return int(torch.randint(0, 2**62, (), device=device).item())


def _torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    left: int,
    right: int,
    scale: float,
    chunk: int = _TORCH_CHUNK,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    seed = _dropout_seed(q.device) if dropout_p > 0 else 0
    out: torch.Tensor = _ChunkedAttention.apply(  # type: ignore[no-untyped-call]
        q, k, v, left, right, scale, chunk, dropout_p, seed
    )
    return out


# --- the Triton path ----------------------------------------------------------------------


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        left: int,
        right: int,
        scale: float,
    ) -> torch.Tensor:
        from ms_kernels._attention_triton import attention_forward

        out, lse = attention_forward(q, k, v, left, right, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (left, right, scale)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from ms_kernels._attention_triton import attention_backward

        q, k, v, out, lse = ctx.saved_tensors
        left, right, scale = ctx.config
        dq, dk, dv = attention_backward(q, k, v, out, lse, dout, left, right, scale)
        return dq, dk, dv, None, None, None


def _triton_max_head_dim() -> int:
    from ms_kernels._attention_triton import MAX_HEAD_DIM

    return MAX_HEAD_DIM


# --- flash-attn ---------------------------------------------------------------------------


@functools.cache
def _flash_attn_func() -> Callable[..., torch.Tensor] | None:
    """flash-attn's ``flash_attn_func`` if installed and new enough for ``window_size``."""
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    if "window_size" not in inspect.signature(flash_attn_func).parameters:
        return None  # flash-attn < 2.3 has no sliding window
    fn: Callable[..., torch.Tensor] = flash_attn_func
    return fn


def _flash_can_run(
    q: torch.Tensor, k: torch.Tensor, left: int | None, right: int | None
) -> str | None:
    """Why flash-attn cannot run on ``q`` with this window (None when it can)."""
    if _flash_attn_func() is None:
        return (
            "flash-attn >= 2.3 is not installed: pip install 'ms-kernels[flash]' "
            "(needs CUDA and a matching torch build)"
        )
    if not q.is_cuda:
        return f"flash-attn needs CUDA tensors, got {q.device}"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs float16 or bfloat16 tensors, got {q.dtype}"
    if q.shape[3] > _FLASH_MAX_HEAD_DIM:
        return f"flash-attn supports head_dim <= {_FLASH_MAX_HEAD_DIM}, got {q.shape[3]}"
    sq, sk = q.shape[1], k.shape[1]
    if not _flash_expresses(left, right, sq, sk):
        return (
            f"flash-attn cannot express window {(left, right)} with seqlen_q {sq} > "
            f"seqlen_k {sk} + 1 (it bounds a right side >= seqlen_k at seqlen_k)"
        )
    return None


def _to_flash_window(left: int | None, right: int | None) -> tuple[int, int]:
    return (-1 if left is None else left, -1 if right is None else right)


def _flash_expresses(left: int | None, right: int | None, sq: int, sk: int) -> bool:
    """Whether flash-attn, given ``_to_flash_window(left, right)``, masks exactly this window."""
    as_flash = _flash_window(_to_flash_window(left, right), False, sq, sk)
    return _canonical(*as_flash, sq, sk) == _canonical(left, right, sq, sk)


def _triton_can_run(q: torch.Tensor, dropout_p: float) -> str | None:
    """Why our Triton kernel cannot run on ``q`` (None when it can)."""
    if not triton_available():
        return None  # resolve_backend raises with the install hint
    if dropout_p > 0:
        return (
            f"the Triton kernel has no dropout, got dropout_p={dropout_p} (use "
            "backend='flash' or 'torch', or dropout_p=0.0)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton kernel takes float16, bfloat16 or float32, got {q.dtype}"
    if q.shape[3] > _triton_max_head_dim():
        return (
            f"the Triton kernel supports head_dim <= {_triton_max_head_dim()}, got "
            f"head_dim {q.shape[3]} (use backend='flash' or 'torch')"
        )
    return None


def _pick_backend(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: tuple[int | None, int | None] = (None, None),
    dropout_p: float = 0.0,
) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "flash":
        reason = _flash_can_run(q, k, *window)
        if reason is not None:
            raise (RuntimeError if _flash_attn_func() is None else ValueError)(
                f"backend='flash': {reason}"
            )
        return "flash"
    if backend == "auto":
        if not q.is_cuda:
            return "torch"
        if _flash_can_run(q, k, *window) is None:
            return "flash"
        if resolve_backend("auto", q, k, v) == "triton" and _triton_can_run(q, dropout_p) is None:
            return "triton"
        return "torch"
    if backend == "triton":
        resolve_backend("triton", q, k, v)  # raises when Triton cannot run here
        reason = _triton_can_run(q, dropout_p)
        if reason is not None:
            raise ValueError(f"backend='triton': {reason}")
    return backend


def _check_dropout(dropout_p: object) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(
            f"dropout_p must be a float in [0, 1), got {dropout_p!r} (the window goes in "
            "window= or, flash-attn's way, window_size=)"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    return float(dropout_p)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    # A window here is the pre-0.2.0 call, read with a FutureWarning until 0.3.
    dropout_p: float | Sequence[int | None] | None = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    *,
    window: Sequence[int | None] | None = None,
    deterministic: bool = False,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """Softmax attention of ``q`` over the keys inside each query's window.

    The positional arguments are flash-attn's ``flash_attn_func``'s, in its order.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim).
        k, v: (batch, seqlen_k, heads_kv, head_dim), ``heads_q % heads_kv == 0``.
        dropout_p: probability of dropping each attention weight (the survivors are
            scaled by ``1 / (1 - p)``), as flash-attn; pass 0.0 in evaluation. Draws
            from the default generator of the inputs' device. Not on ``"triton"``.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        causal: no keys to the right (``right = 0``), bottom-right aligned.
        window_size: flash-attn's ``(left, right)``, ``-1`` for unbounded, read by
            flash-attn's rules (``_flash_window``); ``causal`` overrides its right side.
        window: ms-kernels' ``(left, right)`` instead (module docstring): taken as
            written, ``None`` or ``-1`` unbounded; give one of the two.
        deterministic: flash-attn's switch for a deterministic backward; the Triton
            and torch paths always are.
        backend: ``"auto"``, ``"flash"``, ``"triton"`` or ``"torch"``.

    Returns:
        (batch, seqlen_q, heads_q, head_dim) in ``q``'s dtype.
    """
    if dropout_p is None or isinstance(dropout_p, (tuple, list)):
        # Before 0.2.0 the fourth positional argument was the window; read it as one
        # for a release, loudly, since flash-attn's order puts dropout_p there.
        if window is not None:
            raise TypeError(f"dropout_p must be a float, got {dropout_p!r} (and window={window!r})")
        warnings.warn(
            "sliding_window_attention: a window as the fourth positional argument is "
            "deprecated and will be refused in 0.3; that place is flash-attn's dropout_p. "
            f"Pass window={dropout_p!r}",
            FutureWarning,
            stacklevel=2,
        )
        window, dropout_p = dropout_p, 0.0
    p = _check_dropout(dropout_p)
    scale = _check_inputs(q, k, v, softmax_scale)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")
    sq, sk = q.shape[1], k.shape[1]
    left, right = _resolve_window(window, window_size, causal, sq, sk)
    chosen = _pick_backend(backend, q, k, v, (left, right), p)
    if chosen == "flash":
        flash = _flash_attn_func()
        assert flash is not None
        return flash(
            q,
            k,
            v,
            dropout_p=p,
            softmax_scale=scale,
            causal=False,  # folded into the window, which _flash_can_run checked
            window_size=_to_flash_window(left, right),
            deterministic=deterministic,
        )
    # The kernels take plain ints: a side wider than both sequences is unbounded.
    unbounded = sq + sk
    left_i = unbounded if left is None else min(left, unbounded)
    right_i = unbounded if right is None else min(right, unbounded)
    if chosen == "triton":
        out: torch.Tensor = _TritonAttention.apply(q, k, v, left_i, right_i, scale)  # type: ignore[no-untyped-call]
        return out
    return _torch_attention(q, k, v, left_i, right_i, scale, dropout_p=p)


class SlidingWindowAttention(nn.Module):
    """``sliding_window_attention`` as a module (no parameters): ``forward(q, k, v)``.

    Validates its arguments on construction, so a bad config fails before the first
    step. ``dropout_p`` applies in training mode only (``model.eval()`` turns it off).
    """

    def __init__(
        self,
        window: Sequence[int | None] | None = None,
        *,
        window_size: Sequence[int] | None = None,
        causal: bool = False,
        softmax_scale: float | None = None,
        dropout_p: float = 0.0,
        backend: AttentionBackend = "auto",
    ) -> None:
        super().__init__()
        if window_size is not None:
            if window is not None:
                _resolve_window(window, window_size, causal, 0, 0)  # raises: both given
            _check_window_pair("window_size", window_size)
            self.window_size: tuple[int, int] | None = (int(window_size[0]), int(window_size[1]))
            self.window: tuple[int | None, int | None] | None = None
        else:
            self.window_size = None
            self.window = _normalize_window(window, causal)
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        self.dropout_p = _check_dropout(dropout_p)
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.backend: AttentionBackend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sliding_window_attention(
            q,
            k,
            v,
            self.dropout_p if self.training else 0.0,
            self.softmax_scale,
            self.causal,
            self.window_size if self.window_size is not None else _UNSET_WINDOW_SIZE,
            window=self.window,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        if self.window_size is not None:
            shown = f"window_size={self.window_size}"
        else:
            shown = f"window={self.window}"
        rest = f"causal={self.causal}, dropout_p={self.dropout_p}, backend={self.backend!r}"
        return f"{shown}, {rest}"
