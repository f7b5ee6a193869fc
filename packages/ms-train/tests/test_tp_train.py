"""``ms-train --preset tiny`` under tensor parallelism: at TP 2 and at DP 2 x TP 2 it logs
the losses and gradient norms of one process over 20 steps, with LAMB and with AdamW;
and a TP 2 checkpoint resumes at TP 1, a TP 1 checkpoint at DP 2 x TP 2, with the
uninterrupted run's losses (fp32 tolerance: another split sums in another order)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ms_data import build_shards
from ms_data.build import BuildConfig
from ms_testing.dist import run_ranks
from ms_train.config import Config, load_config
from ms_train.trainer import Trainer

pytestmark = pytest.mark.slow

STEPS, SAVED = 20, 10
LAMB: list[str] = []  # the preset's: LAMB at lr 1e-2
# AdamW at the preset's LAMB rate (1e-2) with eps 1e-8 is chaotic here: two orders of
# the same sums part by 1e-2 in the gradient norm within 12 steps even at DP 2 without
# TP (measured). A rate and eps at which it is not make the comparison mean something.
ADAMW = ["optim.name=adamw", "optim.lr=1e-3", "optim.eps=1e-6"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import argparse
    import textwrap

    out = tmp_path_factory.mktemp("corpus") / "shards"
    build_shards(
        [argparse.__file__, textwrap.__file__], out, BuildConfig(tokenizer="bytes"), progress=False
    )
    return out


def _config(corpus: Path, out: Path, tp: int, extra: list[str], steps: int = STEPS) -> Config:
    overrides = [
        f"data.shards={corpus}",
        f"train.out_dir={out}",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.sample_tokens=0",
        f"checkpoint.every={SAVED}",
        f"parallel.tp={tp}",
        *extra,
    ]
    return load_config(None, preset="tiny", overrides=overrides)


def _train(config: Config) -> list[tuple[int, float, float]]:
    with Trainer(config, peak_flops=1e9, stream=io.StringIO()) as trainer:
        trainer.train()
    from ms_train.report import read_metrics

    rows = read_metrics(Path(config.train.out_dir) / "metrics.jsonl")
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows]


def _rank(config: Config) -> list[tuple[int, float, float]] | None:
    rows = _train(config)
    return rows if dist.get_rank() == 0 else None


def _run(config: Config, nproc: int) -> list[tuple[int, float, float]]:
    if nproc == 1:
        return _train(config)
    got = run_ranks(_rank, nproc, args=(config,), timeout=240)[0]
    assert got is not None
    return got


def _same(got: list[Any], want: list[Any], rel: float = 1e-4) -> None:
    assert [s for s, _, _ in got] == [s for s, _, _ in want]
    for (s, loss, norm), (_, w_loss, w_norm) in zip(got, want, strict=True):
        assert loss == pytest.approx(w_loss, rel=rel), f"step {s} loss"
        assert norm == pytest.approx(w_norm, rel=rel), f"step {s} grad norm"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("optim", [LAMB, ADAMW], ids=["lamb", "adamw"])
def test_tp_logs_the_losses_and_norms_of_one_process(
    corpus: Path, tmp_path: Path, optim: list[str]
) -> None:
    one = _run(_config(corpus, tmp_path / "one", 1, optim), 1)
    assert [s for s, _, _ in one] == list(range(1, STEPS + 1))
    layouts = [(2, "tp2"), (4, "dp2xtp2")] if optim is LAMB else [(4, "dp2xtp2")]
    for nproc, name in layouts:
        _same(_run(_config(corpus, tmp_path / name, 2, optim), nproc), one)
    if optim is not LAMB:
        return
    # Resume across TP sizes from the step-10 checkpoints of the runs above.
    for saved, nproc, tp, name in [("tp2", 1, 1, "tp2-to-1"), ("one", 4, 2, "1-to-dp2xtp2")]:
        out = tmp_path / name
        shutil.copytree(tmp_path / saved / "ckpt", out / "ckpt")
        for step in (STEPS,):  # the final step's checkpoint goes: resume from step 10
            shutil.rmtree(out / "ckpt" / f"step-{step:08d}")
        (out / "ckpt" / "latest").write_text(f"step-{SAVED:08d}")
        rest = _run(_config(corpus, out, tp, optim), nproc)
        _same(rest, one[SAVED:])


@pytest.mark.timeout(600)
def test_tp_with_dropout_draws_the_masks_of_one_process(corpus: Path, tmp_path: Path) -> None:
    # A replica's TP ranks are seeded alike (by their DP rank) and each draws the whole
    # tensor's mask: TP 2 trains with the masks of one process, so with its losses.
    extra = ["model.dropout=0.1", "checkpoint.every=0"]
    one = _run(_config(corpus, tmp_path / "one", 1, extra, steps=6), 1)
    # (test_tp_model shows that the masks move the loss; here they are the same masks)
    _same(_run(_config(corpus, tmp_path / "tp2", 2, extra, steps=6), 2), one)
