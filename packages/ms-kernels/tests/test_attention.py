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
from ms_kernels.attention import (
    _flash_expresses,
    _pick_backend,
    _to_flash_window,
    _torch_attention,
)

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


@pytest.mark.slow
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
        q.to(dtype), k.to(dtype), v.to(dtype), window=window, causal=case["causal"], backend="torch"
    )
    check_close("public out", public, lowp[0], ref[0])


@pytest.mark.slow
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
        return sliding_window_attention(
            q, k, v, window=window, causal=case["causal"], backend="torch"
        )

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


@pytest.mark.slow
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
            lambda q, k, v: sliding_window_attention(q, k, v, window=(9, 2), backend="torch"),
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


@pytest.mark.slow
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
            q, k, v, window=window, causal=causal, backend=backend
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
    auto = sliding_window_attention(q, q, q, window=(1, 0))
    assert torch.equal(auto, sliding_window_attention(q, q, q, window=(1, 0), backend="torch"))


def test_module_matches_functional_and_validates_on_construction() -> None:
    q, k, v = (torch.randn(2, 12, 2, 16) for _ in range(3))
    module = SlidingWindowAttention(hf_window(4), causal=True, backend="torch")
    expected = sliding_window_attention(q, k, v, window=(3, 0), backend="torch")
    assert torch.equal(module(q, k, v), expected)
    assert "window=(3, 0)" in repr(module)
    assert list(module.state_dict()) == []
    with pytest.raises(ValueError, match="window"):
        SlidingWindowAttention((-2, 0))
    with pytest.raises(ValueError, match="window_size"):
        SlidingWindowAttention(window_size=(3, -5))
    with pytest.raises(ValueError, match="dropout_p"):
        SlidingWindowAttention(dropout_p=1.0)
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
        ({"window": (-2, 0)}, ValueError, r"left an int >= 0, or -1 or None .* got \(-2, 0\)"),
        ({"window": (2, -3)}, ValueError, r"right an int >= 0"),
        ({"window": (2.5, 0)}, ValueError, r"left an int >= 0"),
        ({"window": 4}, ValueError, r"window must be \(left, right\), got 4"),
        ({"window_size": (0, -2)}, ValueError, r"window_size must be .* right an int >= 0"),
        ({"window_size": 5}, ValueError, r"window_size must be \(left, right\), got 5"),
        ({"window": (3, 0), "window_size": (3, 0)}, ValueError, r"not both"),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\), got 1.0"),
        ({"dropout_p": -0.1}, ValueError, r"dropout_p must be in \[0, 1\)"),
        ({"dropout_p": "0.1"}, TypeError, r"dropout_p must be a float"),
        ({"deterministic": 1}, TypeError, r"deterministic must be a bool, got 1"),
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
        return lambda q, k, v: sliding_window_attention(q, k, v, window=window, backend=backend)

    def naive(q: Any, k: Any, v: Any) -> Any:
        return attention_reference(q, k, v, window)

    got = [t.cpu() for t in _forward_backward(run(backend), *cuda, dtype)]
    lowp = [t.cpu() for t in _forward_backward(naive, *cuda, dtype)]
    ref = _forward_backward(lambda *t: _reference64(*t, mask), q, k, v, dout, torch.float64)
    scales = _scales(q, k, v, dout)
    for name, g, lo, r in zip(("out", "dq", "dk", "dv"), got, lowp, ref, strict=True):
        check_close(name, g, lo, r, scale=scales[name])


# --- flash-attn's calling convention: positional order, window_size, -1, dropout ----------


def _flash_rule_mask(sq: int, sk: int, window_size: tuple[int, int], causal: bool) -> Any:
    """flash-attn 2's reading of ``window_size``, step by step as its flash_api.cpp has it."""
    left, right = window_size
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    if sq == 1:
        causal = False  # flash-attn drops causal for a single query
    if causal:
        right = 0
    if left < 0 and right < 0:
        return torch.ones(sq, sk, dtype=torch.bool)
    if left < 0:
        left = sk
    if right < 0:
        right = sk
    return _brute_mask(sq, sk, left, right)


WINDOW_SIZES = [(-1, -1), (-1, 0), (3, -1), (3, 0), (0, 0), (2, 5), (-1, 4), (100, 100), (4, 100)]


@pytest.mark.parametrize(
    ("sq", "sk"),
    [
        (14, 3),
        *(pytest.param(*s, marks=pytest.mark.slow) for s in [(9, 9), (5, 12), (12, 5), (1, 7)]),
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_window_size_follows_flash_attn(sq: int, sk: int, causal: bool) -> None:
    gen = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(2, sq, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, sk, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    for window_size in WINDOW_SIZES:
        mask = _flash_rule_mask(sq, sk, window_size, causal)
        assert torch.equal(window_mask(sq, sk, causal=causal, window_size=window_size), mask)
        out = sliding_window_attention(
            q, k, v, causal=causal, window_size=window_size, backend="torch"
        )
        torch.testing.assert_close(
            out, _reference64(q, k, v, mask), rtol=1e-12, atol=1e-12, msg=str(window_size)
        )


def test_flash_backend_runs_only_windows_flash_attn_reads_the_same_way() -> None:
    # The flash backend hands flash-attn our window with -1 for None; flash-attn reads a
    # right side >= Sk (or -1 beside a bounded left) as Sk, which is narrower than ours
    # when Sq > Sk + 1. Dispatch must never accept a window that it masks differently.
    sides = (None, 0, 1, 3, 6, 9)
    for sq in range(1, 8):
        for sk in range(1, 8):
            for left in sides:
                for right in sides:
                    ours = window_mask(sq, sk, (left, right))
                    theirs = window_mask(sq, sk, window_size=_to_flash_window(left, right))
                    same = torch.equal(ours, theirs)
                    ok = _flash_expresses(left, right, sq, sk)
                    assert same or not ok, (sq, sk, left, right)
                    assert ok or sq > sk + 1, (sq, sk, left, right)  # no needless refusal


def test_flash_attn_positional_order_and_minus_one() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 30, 2, 16, generator=gen) for _ in range(3))
    # flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size): transformers
    # passes (W, W) with causal=True, and causal cuts the right side to 0.
    ported = sliding_window_attention(q, k, v, 0.0, 0.3, True, (4, 4), backend="torch")
    ours = sliding_window_attention(
        q, k, v, window=(4, 0), softmax_scale=0.3, causal=True, backend="torch"
    )
    assert torch.equal(ported, ours)
    # -1 is unbounded in either convention.
    full = sliding_window_attention(q, k, v, window=(None, None), backend="torch")
    assert torch.equal(sliding_window_attention(q, k, v, window=(-1, -1), backend="torch"), full)
    assert torch.equal(
        sliding_window_attention(q, k, v, window_size=(-1, -1), backend="torch"), full
    )
    assert torch.equal(window_mask(30, 30, (-1, 2)), window_mask(30, 30, (None, 2)))


def test_a_window_in_dropout_p_place_is_read_as_a_window_with_a_warning() -> None:
    q = torch.randn(1, 12, 2, 8)
    with pytest.warns(FutureWarning, match=r"Pass window=\(3, 0\)"):
        old_style = sliding_window_attention(q, q, q, (3, 0), backend="torch")
    assert torch.equal(old_style, sliding_window_attention(q, q, q, window=(3, 0), backend="torch"))


@pytest.mark.parametrize("chunk", [256, 7])
def test_dropout_drops_attention_weights_and_rescales_like_flash_attn(chunk: int) -> None:
    # v is the identity (head_dim = Sk, v_j = e_j), so out[i, j] is the weight query i
    # gives key j after dropout: either 0 or P_ij / (1 - p), P the softmax weight.
    sq, sk, p = 40, 48, 0.25
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, sq, 2, sk, generator=gen, dtype=torch.float64)
    k = torch.randn(1, sk, 1, sk, generator=gen, dtype=torch.float64)
    v = torch.eye(sk, dtype=torch.float64).view(1, sk, 1, sk)
    mask = _brute_mask(sq, sk, 10, 3)
    weights = _reference64(q, k, v, mask)
    torch.manual_seed(0)
    out = _torch_attention(q, k, v, 10, 3, sk**-0.5, chunk, dropout_p=p)
    kept = out != 0
    torch.testing.assert_close(out[kept] * (1 - p), weights[kept], rtol=1e-12, atol=0)
    inside = mask.view(1, sq, 1, sk).expand_as(out)
    assert not kept[~inside].any()  # nothing outside the window
    n = int(inside.sum())
    dropped = 1 - int(kept[inside].sum()) / n
    assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5, dropped


def test_dropout_backward_is_the_gradient_of_the_forward() -> None:
    # Reseeding before every call fixes the dropout masks, so the forward is a function
    # whose derivative gradcheck can take; chunks of 3 make the backward redraw
    # several chunks' masks.
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 7, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(1, 9, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )

    def attend(q: Any, k: Any, v: Any) -> Any:
        torch.manual_seed(5)
        return _torch_attention(q, k, v, 3, 1, 0.5, 3, dropout_p=0.3)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    # And the dropout is real: the masks change the result.
    assert not torch.allclose(attend(q, k, v), _torch_attention(q, k, v, 3, 1, 0.5, 3))


def test_dropout_follows_torch_manual_seed_and_zero_is_off() -> None:
    q = torch.randn(1, 20, 2, 8)

    def run(seed: int, p: float) -> Any:
        torch.manual_seed(seed)
        return sliding_window_attention(q, q, q, p, window=(5, 0), backend="torch")

    assert torch.equal(run(1, 0.2), run(1, 0.2))
    assert not torch.equal(run(1, 0.2), run(2, 0.2))
    assert torch.equal(run(1, 0.0), sliding_window_attention(q, q, q, window=(5, 0)))


def test_dropout_refused_by_the_triton_backend_and_module_drops_only_in_training() -> None:
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match=r"no dropout, got dropout_p=0.1"):
        sliding_window_attention(q, q, q, 0.1, backend="triton")
    module = SlidingWindowAttention((4, 0), dropout_p=0.5, backend="torch")
    plain = sliding_window_attention(q, q, q, window=(4, 0), backend="torch")
    assert not torch.equal(module(q, q, q), plain)
    assert torch.equal(module.eval()(q, q, q), plain)
    flash_style = SlidingWindowAttention(window_size=(4, 4), causal=True, backend="torch")
    assert torch.equal(flash_style(q, q, q), plain)
    assert "window_size=(4, 4)" in repr(flash_style)


# --- keys outside every window are never read, on any backend ----------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_keys_outside_the_window_never_reach_any_result(backend: str) -> None:
    # Sq 100 against Sk 300, window (20, 0): queries see keys 180..299 only. Keys 0..179
    # are NaN; with 64-key tiles the block 128..191 holds both kinds.
    sq, sk, cut = 100, 300, 180
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, sq, 2, 16, generator=gen)
    k, v = (torch.randn(1, sk, 1, 16, generator=gen) for _ in range(2))
    dout = torch.randn(1, sq, 2, 16, generator=gen)

    def attend(q: Any, k: Any, v: Any) -> Any:
        return sliding_window_attention(q, k, v, window=(20, 0), backend=backend)

    clean = _forward_backward(attend, q, k, v, dout, torch.float32)
    k2, v2 = k.clone(), v.clone()
    k2[:, :cut], v2[:, :cut] = float("nan"), float("nan")
    out, dq, dk, dv = _forward_backward(attend, q, k2, v2, dout, torch.float32)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert torch.equal(dk[:, :cut], torch.zeros_like(dk[:, :cut]))
    assert torch.equal(dv[:, :cut], torch.zeros_like(dv[:, :cut]))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), clean, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
@settings(max_examples=60)
@given(case=_cases())
def test_torch_path_ignores_nan_in_keys_no_query_sees(case: dict[str, Any]) -> None:
    case = {**case, "batch": 1}
    q, k, v, dout = _qkv(case)
    left, right = case["left"], 0 if case["causal"] else case["right"]
    unseen = ~_brute_mask(case["sq"], case["sk"], left, right).any(0)

    def attend(q: Any, k: Any, v: Any) -> Any:
        unbounded = case["sq"] + case["sk"]
        lft = unbounded if left is None else left
        rgt = unbounded if right is None else right
        return _torch_attention(q, k, v, lft, rgt, 0.3, case["chunk"])

    clean = _forward_backward(attend, q, k, v, dout, torch.float64)
    k2, v2 = k.clone(), v.clone()
    k2[:, unseen], v2[:, unseen] = float("nan"), float("inf")
    got = _forward_backward(attend, q, k2, v2, dout, torch.float64)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, clean, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
