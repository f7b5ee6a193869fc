"""ms_kernels.attention: the window convention, the torch path, backend choice, input checks.

The Triton kernel's own numerics are in test_attention_triton.py; here it is reached
through the public API only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_kernels import (
    SlidingWindowAttention,
    attention_reference,
    hf_window,
    sliding_window_attention,
    window_mask,
)
from ms_kernels.attention import _pick_backend, _torch_attention

SIDES = (0, 1, 3, 200, None)  # 200 is wider than any drawn sequence


def _brute_mask(sq: int, sk: int, left: int | None, right: int | None) -> torch.Tensor:
    """The flash-attn rule, one pair at a time: i + Sk - Sq - left <= j <= i + Sk - Sq + right."""
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            lo_ok = left is None or j >= i + sk - sq - left
            hi_ok = right is None or j <= i + sk - sq + right
            mask[i, j] = lo_ok and hi_ok
    return mask


def _reference64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> Any:
    """Float64 masked softmax written out; a query with no key gets zeros."""
    group = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) / q.shape[3] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True).clamp_min(-1e300))
    total = weights.sum(-1, keepdim=True)
    return ((weights / torch.where(total > 0, total, 1.0)) @ vh).transpose(1, 2)


@st.composite
def _cases(draw: Any) -> dict[str, Any]:
    hkv = draw(st.sampled_from((1, 2)))
    return {
        "batch": draw(st.sampled_from((0, 1, 2))),
        "sq": draw(st.integers(1, 70)),
        "sk": draw(st.integers(1, 70)),
        "hkv": hkv,
        "hq": hkv * draw(st.sampled_from((1, 2, 3))),
        "d": draw(st.sampled_from((8, 64, 128))),
        "left": draw(st.sampled_from(SIDES)),
        "right": draw(st.sampled_from(SIDES)),
        "causal": draw(st.booleans()),
        "chunk": draw(st.sampled_from((1, 5, 16, 256))),
        "dtype": draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16))),
        "strided": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _qkv(case: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v and an upstream gradient; ``strided`` slices them out of packed buffers."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, sq, sk, hq, hkv, d = (case[n] for n in ("batch", "sq", "sk", "hq", "hkv", "d"))
    if case["strided"]:  # a fused qkv projection's output, split without copies
        packed = torch.randn(b, sk, hq + 2 * hkv, d, generator=gen)
        q = torch.randn(b, sq, 2 * hq, d, generator=gen)[:, :, ::2]
        k, v = packed[:, :, hq : hq + hkv], packed[:, :, hq + hkv :]
    else:
        q = torch.randn(b, sq, hq, d, generator=gen)
        k = torch.randn(b, sk, hkv, d, generator=gen)
        v = torch.randn(b, sk, hkv, d, generator=gen)
    dout = torch.randn(b, sq, hq, d, generator=gen)
    return q, k, v, dout


def _scales(q: Any, k: Any, v: Any, dout: Any) -> dict[str, float | None]:
    """The size errors in each result are relative to (None: ``check_close``'s default).

    dq and dk are sums of ``P * (dO.v - rowsum(dO * O))`` times k or q: the two terms in
    the bracket cancel (exactly, for a query with one key), and the rounding error of
    each is about eps * |dO| |v|, so that size, not the small result, is the scale.
    """
    if q.numel() == 0 or k.numel() == 0:
        return dict.fromkeys(("out", "dq", "dk", "dv"))
    cancel = q.shape[3] ** -0.5 * dout.norm(dim=-1).max() * v.norm(dim=-1).max()
    return {
        "out": None,
        "dq": 1.0 + (cancel * k.abs().max()).item(),
        "dk": 1.0 + (cancel * q.abs().max()).item(),
        "dv": None,
    }


def _forward_backward(fn: Any, q: Any, k: Any, v: Any, dout: Any, dtype: Any) -> list[Any]:
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype), allow_unused=True)
    return [out.detach(), *grads]


@settings(max_examples=120)
@given(case=_cases())
def test_torch_path_matches_float64_reference(case: dict[str, Any], check_close: Any) -> None:
    q, k, v, dout = _qkv(case)
    left, right = case["left"], 0 if case["causal"] else case["right"]
    window = (left, right)
    mask = _brute_mask(case["sq"], case["sk"], left, right)
    dtype = case["dtype"]

    def ours(q: Any, k: Any, v: Any) -> Any:
        unbounded = case["sq"] + case["sk"]
        lft = unbounded if left is None else left
        rgt = unbounded if right is None else right
        return _torch_attention(q, k, v, lft, rgt, case["d"] ** -0.5, case["chunk"])

    got = _forward_backward(ours, q, k, v, dout, dtype)
    ref = _forward_backward(lambda *t: _reference64(*t, mask), q, k, v, dout, torch.float64)
    lowp = _forward_backward(
        lambda q, k, v: attention_reference(q, k, v, window), q, k, v, dout, dtype
    )
    scales = _scales(q, k, v, dout)
    for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, lowp, ref, strict=True):
        check_close(name, g, lo, r, scale=scales[name])
    # The public entry point (default chunk) gives the same numbers as the chunked core.
    public = sliding_window_attention(
        q.to(dtype), k.to(dtype), v.to(dtype), window, causal=case["causal"], backend="torch"
    )
    check_close("public out", public, lowp[0], ref[0])


@settings(max_examples=40)
@given(case=_cases())
def test_torch_path_matches_sdpa_with_full_mask(case: dict[str, Any]) -> None:
    """Against torch's own SDPA, float64, outputs and gradients.

    SDPA gives NaN for a query with no key, so only layouts where every query has one
    are drawn (Sq <= Sk: the key at i + Sk - Sq is always inside the window).
    """
    case = {**case, "sq": min(case["sq"], case["sk"]), "batch": max(case["batch"], 1)}
    q, k, v, dout = _qkv(case)
    window = (case["left"], 0 if case["causal"] else case["right"])
    mask = window_mask(case["sq"], case["sk"], window, causal=case["causal"])
    group = case["hq"] // case["hkv"]

    def sdpa(q: Any, k: Any, v: Any) -> Any:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(1, 2)

    def ours(q: Any, k: Any, v: Any) -> Any:
        return sliding_window_attention(q, k, v, window, causal=case["causal"], backend="torch")

    for name, a, b in zip(
        ("out", "dq", "dk", "dv"),
        _forward_backward(ours, q, k, v, dout, torch.float64),
        _forward_backward(sdpa, q, k, v, dout, torch.float64),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize(("sq", "sk"), [(1, 1), (5, 9), (9, 5), (17, 17)])
@pytest.mark.parametrize("left", SIDES)
@pytest.mark.parametrize("right", SIDES)
def test_window_mask_is_the_flash_attn_rule(
    sq: int, sk: int, left: int | None, right: int | None
) -> None:
    assert torch.equal(window_mask(sq, sk, (left, right)), _brute_mask(sq, sk, left, right))


@pytest.mark.parametrize("tokens", [1, 2, 5, 64])
def test_hf_window_holds_exactly_w_tokens_including_the_current_one(tokens: int) -> None:
    assert hf_window(tokens) == (tokens - 1, 0)
    seq = 70
    counts = window_mask(seq, seq, hf_window(tokens)).sum(dim=1)
    expected = torch.clamp(torch.arange(seq) + 1, max=tokens)
    assert torch.equal(counts, expected)


def test_causal_is_right_zero_bottom_right_aligned() -> None:
    # Sq < Sk (decoding with a cache): the last query sees every key.
    assert torch.equal(window_mask(3, 5, causal=True), window_mask(3, 5, (None, 0)))
    assert window_mask(3, 5, causal=True)[-1].all()
    assert window_mask(3, 5, causal=True).sum().item() == 3 + 4 + 5


def test_queries_with_no_key_get_zeros_and_zero_gradients() -> None:
    q, k, v = (torch.randn(1, n, 2, 8, dtype=torch.float64, requires_grad=True) for n in (6, 3, 3))
    out = sliding_window_attention(q, k, v[:, :3], causal=True, backend="torch")
    # Sq=6 > Sk=3 causal: query i sees keys j <= i - 3, so queries 0..2 see nothing.
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    assert out[:, 3:].abs().sum() > 0
    out.sum().backward()
    assert q.grad is not None and torch.equal(q.grad[:, :3], torch.zeros_like(q.grad[:, :3]))


def test_torch_path_never_reads_keys_outside_the_window() -> None:
    """Keys no query chunk can reach are NaN: the chunks must not touch them (O(S*W))."""
    seq, left, chunk = 300, 7, 16
    q, k, v = (torch.randn(1, seq, 2, 16, dtype=torch.float64) for _ in range(3))

    def attend(q: Any, k: Any, v: Any) -> Any:
        return _torch_attention(q, k, v, left, 0, 0.25, chunk)

    clean = _forward_backward(attend, q, k, v, torch.ones_like(q), q.dtype)
    # The last 60 queries (absolute positions 240..299) see keys from 233 on; poison the rest.
    k2, v2 = k.clone(), v.clone()
    k2[:, :233], v2[:, :233] = float("nan"), float("nan")
    tail = q[:, 240:]
    out, dq, dk, dv = _forward_backward(attend, tail, k2, v2, torch.ones_like(tail), q.dtype)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert torch.equal(dk[:, :233], torch.zeros_like(dk[:, :233]))
    assert torch.equal(dv[:, :233], torch.zeros_like(dv[:, :233]))
    torch.testing.assert_close(out, clean[0][:, 240:], rtol=0, atol=1e-12)
    torch.testing.assert_close(dq, clean[1][:, 240:], rtol=0, atol=1e-12)


def test_torch_path_is_bitwise_deterministic() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 90, 4, 32, generator=gen) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    runs = [
        _forward_backward(
            lambda q, k, v: sliding_window_attention(q, k, v, (9, 2), backend="torch"),
            q,
            k,
            v,
            torch.ones_like(q),
            torch.float32,
        )
        for _ in range(2)
    ]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("shape", "window", "causal", "dtype"),
    [
        ((1, 40, 4, 1, 64), (5, 0), False, torch.float32),
        ((2, 33, 2, 2, 128), None, True, torch.float16),
        ((1, 21, 3, 3, 64), (0, 0), False, torch.float32),
    ],
)
def test_triton_backend_through_the_public_api(
    shape: tuple[int, ...], window: Any, causal: bool, dtype: torch.dtype, check_close: Any
) -> None:
    b, s, hq, hkv, d = shape
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, s, hq, d, generator=gen)
    k, v = (torch.randn(b, s, hkv, d, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    mask = window_mask(s, s, window, causal=causal)

    def run(backend: str) -> Any:
        return lambda q, k, v: sliding_window_attention(
            q, k, v, window, causal=causal, backend=backend
        )

    got = _forward_backward(run("triton"), q, k, v, dout, dtype)
    ref = _forward_backward(lambda *t: _reference64(*t, mask), q, k, v, dout, torch.float64)
    lowp = _forward_backward(
        lambda q, k, v: attention_reference(q, k, v, window, causal=causal), q, k, v, dout, dtype
    )
    scales = _scales(q, k, v, dout)
    for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, lowp, ref, strict=True):
        check_close(name, g, lo, r, scale=scales[name])


def test_auto_is_torch_on_cpu_whatever_the_environment() -> None:
    # The suite runs with TRITON_INTERPRET=1; auto must still choose torch for CPU tensors.
    q = torch.randn(1, 4, 2, 8)
    assert _pick_backend("auto", q, q, q) == "torch"
    auto = sliding_window_attention(q, q, q, (1, 0))
    assert torch.equal(auto, sliding_window_attention(q, q, q, (1, 0), backend="torch"))


def test_module_matches_functional_and_validates_on_construction() -> None:
    q, k, v = (torch.randn(2, 12, 2, 16) for _ in range(3))
    module = SlidingWindowAttention(hf_window(4), causal=True, backend="torch")
    assert torch.equal(module(q, k, v), sliding_window_attention(q, k, v, (3, 0), backend="torch"))
    assert "window=(3, 0)" in repr(module)
    assert list(module.state_dict()) == []
    with pytest.raises(ValueError, match="window"):
        SlidingWindowAttention((-1, 0))
    with pytest.raises(ValueError, match="backend"):
        SlidingWindowAttention(backend="cuda")  # type: ignore[arg-type]


def _t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"q": _t(1, 4, 2, 8, dtype=torch.int32)}, TypeError, r"q must have a floating-point"),
        ({"k": _t(1, 4, 2, 8, dtype=torch.int64)}, TypeError, r"k must have a floating-point"),
        ({"q": _t(4, 2, 8)}, ValueError, r"q must be 4-D .* got shape \(4, 2, 8\)"),
        ({"v": _t(1, 5, 2, 8)}, ValueError, r"k and v must have the same shape"),
        ({"k": _t(2, 4, 2, 8), "v": _t(2, 4, 2, 8)}, ValueError, r"batch and head_dim"),
        ({"k": _t(1, 4, 3, 8), "v": _t(1, 4, 3, 8)}, ValueError, r"multiple of k/v heads"),
        ({"q": _t(1, 4, 2, 8, dtype=torch.float64)}, TypeError, r"share a dtype"),
        ({"window": (-1, 0)}, ValueError, r"left an int >= 0 or None .* got \(-1, 0\)"),
        ({"window": (2, -3)}, ValueError, r"right an int >= 0"),
        ({"window": (2.5, 0)}, ValueError, r"left an int >= 0"),
        ({"window": 4}, ValueError, r"window must be \(left, right\) or None, got 4"),
        ({"window": (4, 1), "causal": True}, ValueError, r"causal=True means window right = 0"),
        ({"softmax_scale": -1.0}, ValueError, r"softmax_scale must be finite and > 0"),
        ({"backend": "cudnn"}, ValueError, r"backend must be one of"),
        (
            {"k": _t(1, 4, 2, 8, device="meta"), "v": _t(1, 4, 2, 8, device="meta")},
            ValueError,
            r"one device",
        ),
    ],
)
def test_bad_input_names_the_argument(kwargs: dict[str, Any], error: type, match: str) -> None:
    args: dict[str, Any] = {"q": _t(1, 4, 2, 8), "k": _t(1, 4, 2, 8), "v": _t(1, 4, 2, 8)}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        sliding_window_attention(**args)


def test_hf_window_rejects_a_window_without_the_current_token() -> None:
    with pytest.raises(ValueError, match=r"tokens must be an int >= 1 .* got 0"):
        hf_window(0)


def test_triton_backend_refuses_a_head_dim_it_cannot_handle() -> None:
    from ms_kernels._attention_triton import MAX_HEAD_DIM

    q = _t(1, 4, 2, MAX_HEAD_DIM + 8)
    with pytest.raises(ValueError, match=rf"head_dim <= {MAX_HEAD_DIM}, got head_dim"):
        sliding_window_attention(q, q, q, backend="triton")
    x = _t(1, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        sliding_window_attention(x, x, x, backend="triton")


def test_flash_backend_unavailable_raises_with_install_hint() -> None:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        q = _t(1, 4, 2, 8)
        with pytest.raises(RuntimeError, match=r"pip install 'ms-kernels\[flash\]'"):
            sliding_window_attention(q, q, q, backend="flash")
    else:  # flash-attn installed: a CPU tensor is the reason it cannot run
        q = _t(1, 4, 2, 8)
        with pytest.raises(ValueError, match="CUDA"):
            sliding_window_attention(q, q, q, backend="flash")


# --- GPU only: flash-attn and the Triton kernel in bf16 against the torch path ------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [(255, 0), (64, 64), None])
def test_gpu_backends_match_the_torch_path(
    backend: str, dtype: torch.dtype, window: Any, check_close: Any
) -> None:
    if backend == "flash":
        pytest.importorskip("flash_attn")
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hkv, d = 2, 1000, 8, 2, 128
    q = torch.randn(b, s, hq, d, generator=gen)
    k, v = (torch.randn(b, s, hkv, d, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    mask = window_mask(s, s, window)
    cuda = [t.cuda() for t in (q, k, v, dout)]

    def run(backend: str) -> Any:
        return lambda q, k, v: sliding_window_attention(q, k, v, window, backend=backend)

    def naive(q: Any, k: Any, v: Any) -> Any:
        return attention_reference(q, k, v, window)

    got = [t.cpu() for t in _forward_backward(run(backend), *cuda, dtype)]
    lowp = [t.cpu() for t in _forward_backward(naive, *cuda, dtype)]
    ref = _forward_backward(lambda *t: _reference64(*t, mask), q, k, v, dout, torch.float64)
    scales = _scales(q, k, v, dout)
    for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, lowp, ref, strict=True):
        check_close(name, g, lo, r, scale=scales[name])
