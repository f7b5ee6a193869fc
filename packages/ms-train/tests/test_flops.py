"""Model-FLOPs accounting: the MegaScale paper's MFU rows, the Megatron closed form,
sliding-window attention, argument validation, the ``flops`` CLI and the matmul probe."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_train.flops import (
    FlopsPerToken,
    flops_per_token,
    keys_per_query,
    main,
    matmul_peak_flops,
    mfu,
    parse_rate,
)

# MegaScale (arXiv 2402.15627), 175B model on A100s (312 TFLOP/s bf16 peak).
GPT_175B: dict[str, Any] = {"n_layers": 96, "d_model": 12288, "seq_len": 2048, "vocab_size": 64000}
A100_PEAK = 312e12

# (system, batch, GPUs, tokens/s, paper MFU in %)
PAPER_ROWS = [
    ("Megatron-LM", 6144, 3072, 433.6e3, 48.7),
    ("MegaScale", 6144, 3072, 531.9e3, 59.1),
    ("Megatron-LM", 6144, 6144, 851.6e3, 47.8),
    ("MegaScale", 6144, 6144, 1030.9e3, 57.3),
    ("Megatron-LM", 6144, 8192, 1027.9e3, 43.3),
    ("MegaScale", 6144, 8192, 1315.6e3, 54.9),
    ("Megatron-LM", 6144, 12288, 1466.8e3, 41.2),
    ("MegaScale", 6144, 12288, 1984.0e3, 55.2),
    ("Megatron-LM", 768, 256, 39.3e3, 53.0),
    ("MegaScale", 768, 256, 49.0e3, 65.3),
]


def megatron_closed_form(l: int, h: int, s: int, v: int) -> float:  # noqa: E741
    return 72 * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))


@pytest.mark.parametrize(
    ("system", "batch", "gpus", "tokens_per_s", "paper_mfu"),
    PAPER_ROWS,
    ids=[f"{r[0]}-{r[2]}gpus-bs{r[1]}" for r in PAPER_ROWS],
)
def test_paper_mfu_rows(
    system: str, batch: int, gpus: int, tokens_per_s: float, paper_mfu: float
) -> None:
    flops = flops_per_token(**GPT_175B, attention="megatron", window=None)
    value = mfu(
        tokens_per_s=tokens_per_s,
        flops_per_token=flops.total,
        n_gpus=gpus,
        peak_flops_per_gpu=A100_PEAK,
    )
    assert abs(100 * value - paper_mfu) <= 1.0, (system, gpus, 100 * value, paper_mfu)


def test_175b_breakdown() -> None:
    f = flops_per_token(**GPT_175B)
    h, l, s, v = 12288, 96, 2048, 64000  # noqa: E741
    assert f.dense == 3 * l * 24 * h * h
    assert f.attention == 3 * l * 4 * h * s
    assert f.logits == 3 * 2 * h * v
    assert f.total == f.dense + f.attention + f.logits
    assert f.forward == pytest.approx(f.total / 3, rel=1e-15)
    assert f.total == pytest.approx(1.0774e12, rel=1e-4)


@given(
    l=st.integers(1, 200),
    h=st.integers(1, 50_000),
    s=st.integers(1, 1 << 20),
    v=st.integers(1, 1 << 20),
)
def test_default_ffn_equals_megatron_closed_form(l: int, h: int, s: int, v: int) -> None:  # noqa: E741
    f = flops_per_token(n_layers=l, d_model=h, seq_len=s, vocab_size=v)
    assert math.isclose(f.total, megatron_closed_form(l, h, s, v), rel_tol=1e-12)
    explicit = flops_per_token(n_layers=l, d_model=h, seq_len=s, vocab_size=v, d_ff=4 * h)
    assert explicit == f


def test_175b_equals_megatron_closed_form() -> None:
    f = flops_per_token(**GPT_175B)
    assert math.isclose(f.total, megatron_closed_form(96, 12288, 2048, 64000), rel_tol=1e-12)


def test_ffn_width_changes_only_dense() -> None:
    base = flops_per_token(**GPT_175B)
    wide = flops_per_token(**GPT_175B, d_ff=8 * 12288)
    assert wide.attention == base.attention and wide.logits == base.logits
    assert wide.dense - base.dense == 3 * 96 * 2 * 2 * 12288 * 4 * 12288


def test_sliding_window_scales_attention_term() -> None:
    full = flops_per_token(**GPT_175B)
    swa = flops_per_token(**GPT_175B, window=512)
    assert swa.attention == full.attention * 512 / 2048
    assert swa.dense == full.dense and swa.logits == full.logits
    assert swa.total < full.total


def test_exact_convention_full_causal_is_half_plus_diagonal() -> None:
    assert keys_per_query(seq_len=2048, attention="exact") == 2049 / 2
    assert keys_per_query(seq_len=2048) == 2048
    exact = flops_per_token(**GPT_175B, attention="exact")
    full = flops_per_token(**GPT_175B)
    assert exact.attention == pytest.approx(full.attention * 2049 / 4096, rel=1e-15)
    # A window of W over s tokens: ramp of W(W+1)/2 then W keys for the remaining s - W.
    assert keys_per_query(seq_len=8, window=3, attention="exact") == (1 + 2 + 3 * 6) / 8


windows = st.one_of(st.none(), st.integers(1, 10_000))
conventions = st.sampled_from(["megatron", "exact"])


@given(
    l=st.integers(1, 128),
    h=st.integers(1, 20_000),
    s=st.integers(1, 8192),
    v=st.integers(1, 300_000),
    ff=st.one_of(st.none(), st.integers(1, 80_000)),
    w=windows,
    conv=conventions,
)
def test_properties(
    l: int,  # noqa: E741
    h: int,
    s: int,
    v: int,
    ff: int | None,
    w: int | None,
    conv: Any,
) -> None:
    dims: dict[str, Any] = {
        "n_layers": l,
        "d_model": h,
        "seq_len": s,
        "vocab_size": v,
        "d_ff": ff,
    }
    f = flops_per_token(**dims, window=w, attention=conv)
    assert f.total > 0 and f.dense > 0 and f.attention > 0 and f.logits > 0
    full = flops_per_token(**dims, attention=conv)
    # Only the attention term depends on the window, and it never exceeds full attention.
    assert f.dense == full.dense and f.logits == full.logits
    assert f.attention <= full.attention
    # exact <= megatron for the same window.
    exact = flops_per_token(**dims, window=w, attention="exact")
    megatron = flops_per_token(**dims, window=w, attention="megatron")
    assert exact.attention <= megatron.attention
    assert exact.dense == megatron.dense and exact.logits == megatron.logits


@given(s=st.integers(1, 4096), w1=st.integers(1, 5000), w2=st.integers(1, 5000), conv=conventions)
def test_monotone_in_window(s: int, w1: int, w2: int, conv: Any) -> None:
    lo, hi = sorted((w1, w2))
    dims: dict[str, Any] = {"n_layers": 2, "d_model": 64, "seq_len": s, "vocab_size": 100}
    small = flops_per_token(**dims, window=lo, attention=conv)
    large = flops_per_token(**dims, window=hi, attention=conv)
    full = flops_per_token(**dims, window=None, attention=conv)
    assert small.total <= large.total <= full.total
    assert small.attention <= large.attention <= full.attention


@given(s=st.integers(1, 4096), extra=st.integers(0, 4096), conv=conventions)
def test_window_at_least_seq_len_is_full_attention(s: int, extra: int, conv: Any) -> None:
    dims: dict[str, Any] = {"n_layers": 3, "d_model": 96, "seq_len": s, "vocab_size": 500}
    assert flops_per_token(**dims, window=s + extra, attention=conv) == flops_per_token(
        **dims, attention=conv
    )


@settings(max_examples=200)
@given(s=st.integers(1, 3000), w=st.one_of(st.none(), st.integers(1, 4000)))
def test_exact_closed_form_matches_sum(s: int, w: int | None) -> None:
    window = s if w is None else w
    pairs = sum(min(i + 1, window) for i in range(s))
    assert keys_per_query(seq_len=s, window=w, attention="exact") == pairs / s
    assert keys_per_query(seq_len=s, window=w, attention="megatron") == min(window, s)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_layers": 0}, r"n_layers must be an int >= 1, got 0"),
        ({"d_model": -5}, r"d_model must be an int >= 1, got -5"),
        ({"seq_len": 2048.0}, r"seq_len must be an int >= 1, got 2048\.0"),
        ({"vocab_size": True}, r"vocab_size must be an int >= 1, got True"),
        ({"d_ff": 0}, r"d_ff must be an int >= 1, got 0"),
        ({"window": 0}, r"window must be None or an int >= 1, got 0"),
        ({"window": "512"}, r"window must be None or an int >= 1, got '512'"),
        ({"attention": "full"}, r"attention must be one of \['megatron', 'exact'\], got 'full'"),
    ],
)
def test_flops_per_token_errors_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        flops_per_token(**{**GPT_175B, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens_per_s": 0.0}, r"tokens_per_s must be a finite number > 0, got 0\.0"),
        ({"tokens_per_s": math.inf}, r"tokens_per_s must be a finite number > 0"),
        ({"flops_per_token": -1.0}, r"flops_per_token must be a finite number > 0, got -1\.0"),
        ({"n_gpus": 0}, r"n_gpus must be an int >= 1, got 0"),
        ({"n_gpus": 2.0}, r"n_gpus must be an int >= 1, got 2\.0"),
        ({"peak_flops_per_gpu": math.nan}, r"peak_flops_per_gpu must be a finite number > 0"),
    ],
)
def test_mfu_errors_name_the_argument(kwargs: dict[str, Any], match: str) -> None:
    good: dict[str, Any] = {
        "tokens_per_s": 1e6,
        "flops_per_token": 1e12,
        "n_gpus": 8,
        "peak_flops_per_gpu": 312e12,
    }
    with pytest.raises(ValueError, match=match):
        mfu(**{**good, **kwargs})


def test_mfu_value() -> None:
    assert mfu(tokens_per_s=2.0, flops_per_token=3.0, n_gpus=2, peak_flops_per_gpu=6.0) == 0.5


def test_flops_per_token_is_frozen() -> None:
    f = FlopsPerToken(dense=1.0, attention=2.0, logits=3.0)
    assert f.total == 6.0 and f.forward == 2.0
    with pytest.raises(AttributeError):
        f.dense = 5.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("text", "value"),
    [("1984.0k", 1_984_000.0), ("1.98M", 1_980_000.0), ("433600", 433_600.0), ("4e5", 4e5)],
)
def test_parse_rate(text: str, value: float) -> None:
    assert parse_rate(text) == pytest.approx(value, rel=1e-15)


@pytest.mark.parametrize("text", ["", "fast", "-5k", "0", "1.5x", "k"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="expected a positive number"):
        parse_rate(text)


CLI_175B = ["--layers", "96", "--hidden", "12288", "--heads", "128", "--seq", "2048"]
CLI_175B += ["--vocab", "64000"]
CLI_12288 = [*CLI_175B, "--tokens-per-s", "1984.0k", "--gpus", "12288", "--peak-tflops", "312"]


def expected_mfu_12288() -> float:
    total = flops_per_token(**GPT_175B).total
    return mfu(tokens_per_s=1984e3, flops_per_token=total, n_gpus=12288, peak_flops_per_gpu=312e12)


def test_cli_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(CLI_12288) == 0
    out = capsys.readouterr().out
    expected = 100 * expected_mfu_12288()
    assert f"MFU: {expected:.2f}%" in out
    assert abs(expected - 55.2) <= 1.0
    for word in ("dense", "attention", "logits", "total", "per sequence", "attention share"):
        assert word in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*CLI_12288, "--json", "--window", "512"]) == 0
    report = json.loads(capsys.readouterr().out)
    full = flops_per_token(**GPT_175B)
    swa = flops_per_token(**GPT_175B, window=512)
    assert report["flops_per_token"]["total"] == swa.total
    assert report["flops_per_token"]["attention"] == full.attention / 4
    assert report["flops_per_sequence"] == swa.total * 2048
    assert report["model"]["keys_per_query"] == 512
    expected = mfu(
        tokens_per_s=1984e3, flops_per_token=swa.total, n_gpus=12288, peak_flops_per_gpu=312e12
    )
    assert report["throughput"]["mfu"] == pytest.approx(expected, rel=1e-12)


def test_cli_json_without_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*CLI_175B, "--json", "--attention", "exact"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["throughput"] is None
    assert report["model"]["keys_per_query"] == 2049 / 2


@pytest.mark.parametrize(
    ("extra", "option"),
    [
        (["--tokens-per-s", "lots"], "--tokens-per-s"),
        (["--layers", "0"], "--layers"),
        (["--window", "-3"], "--window"),
        (["--attention", "full"], "--attention"),
        (["--peak-tflops", "0"], "--peak-tflops"),
        (["--heads", "100"], "--heads"),
        (["--gpus", "8"], "--tokens-per-s"),
    ],
)
def test_cli_bad_option_exits_2(
    extra: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*CLI_175B, *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err and option in err, err


def test_matmul_peak_flops_cpu() -> None:
    value = matmul_peak_flops("cpu", n=256, seconds=0.1)
    assert math.isfinite(value) and value > 0


def test_matmul_peak_flops_validates() -> None:
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        matmul_peak_flops("cpu", n=0)
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        matmul_peak_flops("cpu", seconds=0.0)


def test_matmul_peak_flops_cuda_unavailable() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA is unavailable"):
        matmul_peak_flops("cuda", n=8, seconds=0.01)


def test_model_flops_per_token_reads_the_model_config() -> None:
    from ms_train.config import load_config
    from ms_train.flops import model_flops_per_token

    m = load_config(preset="gpt-175b", overrides=["model.window=512"]).model
    for attention in ("megatron", "exact"):
        assert model_flops_per_token(m, attention=attention) == flops_per_token(
            n_layers=96,
            d_model=12288,
            seq_len=2048,
            vocab_size=64000,
            window=512,
            attention=attention,
        )
