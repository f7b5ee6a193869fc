"""The MFU peak: datasheet values, the best of several measurements, where it came from,
and the warning for an MFU over 100%."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_train._peak import Peak, measured_peak, over_peak_warning, table_peak
from ms_train.config import Config, load_config
from ms_train.report import Progress, format_mfu
from ms_train.trainer import Trainer


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA A100 80GB PCIe", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L4", 121),
        ("NVIDIA A10", 125),
    ],
)
def test_known_gpus_in_bf16_take_the_datasheet_peak(name: str, tflops: int) -> None:
    peak = table_peak(name, torch.bfloat16)
    assert peak is not None and peak.source == "table"
    assert peak.flops == tflops * 1e12 and name in peak.detail


def test_no_table_value_for_fp32_or_an_unknown_device() -> None:
    assert table_peak("NVIDIA H100 80GB HBM3", None) is None  # fp32: measured instead
    assert table_peak("NVIDIA H100 80GB HBM3", torch.float16) is None
    assert table_peak("Some Future GPU", torch.bfloat16) is None


def test_the_measured_peak_is_the_best_of_its_tries() -> None:
    peak = measured_peak("cpu", dtype=None, n=128, tries=3, seconds=0.05)
    assert peak.source == "measured"
    found = re.search(
        r"best of 3 x 0.05 s of 128x128 fp32 matmuls at start \(tries "
        r"([\d,.]+)-([\d,.]+) GFLOP/s\)",
        peak.detail,
    )
    assert found, peak.detail
    low, high = (float(x.replace(",", "")) for x in found.groups())
    assert low <= high and round(peak.flops / 1e9, 1) == high  # the best, not the mean
    with pytest.raises(ValueError, match="tries must be >= 1, got 0"):
        measured_peak("cpu", dtype=None, n=8, tries=0)


@pytest.mark.parametrize("source", ["measured", "given", "table"])
def test_an_mfu_over_100_percent_gets_a_warning_naming_the_peak(source: str) -> None:
    peak = Peak(1e9, source, "how")  # type: ignore[arg-type]
    assert over_peak_warning(1.0, peak) is None and over_peak_warning(0.5, peak) is None
    warning = over_peak_warning(2.468, peak)
    assert warning is not None and "\n" not in warning
    assert warning.startswith("ms-train: warning: MFU 246.8% is over 100% of the peak")
    assert f"1.0 GFLOP/s per rank, {source}: how" in warning and "--peak-tflops" in warning


def test_progress_line_and_summary_mark_an_mfu_over_100_percent() -> None:
    progress = Progress(10, stream=io.StringIO())
    over = progress.line(5, {"loss": 2.5, "eval_loss": 2.75, "mfu": 2.468}, 1.0)
    assert "loss 2.5000 | eval 2.7500" in over and "MFU 246.8% (!)" in over
    assert "(!)" not in progress.line(5, {"mfu": 0.5}, 1.0)
    assert format_mfu(0.266, 190e9, "measured") == "26.6% of 190.0 GFLOP/s per rank (measured)"
    assert "over 100%, the peak is too low" in format_mfu(2.468, 1e9, "given")
    assert format_mfu(float("nan"), 1e9, None) == "n/a"


# -- the trainer: where the peak came from, and the warning in a real run -------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json as json_mod
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    build_shards([json_mod.__file__, textwrap.__file__], out, BuildConfig(), progress=False)
    return out


def _config(corpus: Path, out: Path, *extra: str) -> Config:
    small = [
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.window=16",
        "data.micro_batch=4",
        "data.global_batch=4",
        "optim.warmup_steps=1",
        "train.log_every=1",
        "train.sample_tokens=0",
        "checkpoint.every=0",
        "checkpoint.resume=false",
    ]
    overrides = [*small, f"data.shards={corpus}", f"train.out_dir={out}", *extra]
    return load_config(None, preset="tiny", overrides=overrides)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_summary_says_where_the_peak_came_from(corpus: Path, tmp_path: Path) -> None:
    stream = io.StringIO()
    with Trainer(_config(corpus, tmp_path / "m", "train.steps=2"), stream=stream) as trainer:
        measured = trainer.train()
    assert measured.peak_flops_source == "measured"
    assert measured.peak_flops_detail.startswith("best of 5 x 0.2 s of 1024x1024 fp32")
    saved = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert (saved["peak_flops_source"], saved["peak_flops_detail"]) == (
        "measured",
        measured.peak_flops_detail,
    )
    text = stream.getvalue()
    assert "per rank (measured)" in text
    assert re.search(rf"\npeak +{re.escape(measured.peak_flops_detail)}\n", text), text

    with Trainer(
        _config(corpus, tmp_path / "g", "train.steps=2"), peak_flops=5e18, stream=io.StringIO()
    ) as trainer:
        given = trainer.train()
    assert (given.peak_flops, given.peak_flops_source) == (5e18, "given")
    assert json.loads((tmp_path / "g" / "summary.json").read_text())["peak_flops_source"] == "given"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_with_an_mfu_over_100_percent_says_why_once(corpus: Path, tmp_path: Path) -> None:
    stream = io.StringIO()
    config = _config(corpus, tmp_path, "train.steps=3")
    with Trainer(config, peak_flops=1e3, stream=stream) as trainer:  # 1 kFLOP/s: far too low
        summary = trainer.train()
    text = stream.getvalue()
    assert summary.mfu > 1.0
    assert text.count("ms-train: warning: MFU") == 1, text
    assert "given: peak_flops= / --peak-tflops); the value given" in text
    assert text.count("(!)") == 3  # every progress line marks it
    assert "over 100%, the peak is too low" in text  # the summary table too
