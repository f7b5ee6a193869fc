"""train.tensorboard: an install hint before training without the package; with it,
event files that hold the run's metrics, read back with TensorBoard's own reader."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_train import cli
from ms_train.config import Config, load_config
from ms_train.errors import JobError
from ms_train.report import read_metrics
from ms_train.trainer import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json as json_mod
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    build_shards([json_mod.__file__, textwrap.__file__], out, BuildConfig(), progress=False)
    return out


def _overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.window=16",
        "data.micro_batch=4",
        "data.global_batch=4",
        "data.eval_fraction=0.5",  # one of the two documents
        "optim.warmup_steps=1",
        "train.log_every=1",
        "train.sample_tokens=0",
        "train.tensorboard=true",
        "checkpoint.every=0",
        f"data.shards={corpus}",
        f"train.out_dir={out}",
        *extra,
    ]


def _config(corpus: Path, out: Path, *extra: str) -> Config:
    return load_config(None, preset="tiny", overrides=_overrides(corpus, out, *extra))


def test_tensorboard_without_the_package_stops_before_training(
    corpus: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # None in sys.modules makes `import tensorboard` fail as if it were not installed.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    hint = (
        r"train.tensorboard = true needs the 'tensorboard' package.*"
        r"pip install 'ms-train\[tensorboard\]'"
    )
    with pytest.raises(JobError, match=hint):
        Trainer(_config(corpus, tmp_path / "run"))
    argv = ["--preset", "tiny"]
    for item in _overrides(corpus, tmp_path / "run"):
        argv += ["--set", item]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("ms-train: error: train.tensorboard = true needs") and err.count("\n") == 1
    )
    assert not (tmp_path / "run").exists()  # nothing was trained or written


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_event_files_hold_the_metrics(corpus: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    config = _config(corpus, out, "train.steps=4", "train.eval_every=2")
    with Trainer(config, peak_flops=1e9, stream=io.StringIO()) as trainer:
        trainer.train()
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    records = read_metrics(out / "metrics.jsonl")
    expected = {
        "loss/train": "loss",
        "loss/eval": "eval_loss",
        "optim/lr": "lr",
        "optim/grad_norm": "grad_norm",
        "throughput/tokens_per_s": "tokens_per_s",
        "throughput/mfu": "mfu",
    }
    assert set(events.Tags()["scalars"]) == set(expected)
    for tag, key in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = [(r["step"], r[key]) for r in records if key in r]
        assert (
            [s for s, _ in got]
            == [s for s, _ in want]
            == ([2, 4] if key == "eval_loss" else [1, 2, 3, 4])
        )
        for (_, a), (_, b) in zip(got, want, strict=True):
            assert a == pytest.approx(b, rel=1e-6), tag  # stored as float32
