"""Held-out evaluation: a split the training stream never holds, evaluated without
changing training, the same on every rank and after a resume, and reported."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ms_data import ShardWriter
from ms_testing.dist import run_ranks
from ms_train.config import Config, ConfigError, load_config
from ms_train.report import read_metrics
from ms_train.trainer import Trainer

EOS = 256  # the byte tokenizer's end of document, which the trainer packs with
# The embedding stays under 65,536 elements, below LAMB's compiled step (slow to build).
N_DOCS, DOC_LEN = 40, 40


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 documents whose token ids are all different (and not the eos), so every token
    of a batch names the one document it came from."""
    out = tmp_path_factory.mktemp("unique") / "shards"
    out.mkdir()
    ids = np.random.default_rng(0).permutation(np.arange(EOS + 1, EOS + 1 + N_DOCS * DOC_LEN))
    for s in range(2):
        with ShardWriter(out / f"shard-{s}.mss", "uint16") as w:
            for d in range(s * N_DOCS // 2, (s + 1) * N_DOCS // 2):
                w.add_document(ids[d * DOC_LEN : (d + 1) * DOC_LEN])
    return out


def _config(corpus: Path, out: Path, *extra: str) -> Config:
    small = [
        f"model.vocab_size={EOS + 1 + N_DOCS * DOC_LEN}",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.window=16",
        "data.micro_batch=2",
        "data.global_batch=4",
        "data.eval_fraction=0.1",
        "optim.warmup_steps=2",
        "train.log_every=1",
        "train.sample_tokens=0",
        "checkpoint.every=0",
    ]
    overrides = [*small, f"data.shards={corpus}", f"train.out_dir={out}", *extra]
    return load_config(None, preset="tiny", overrides=overrides)


def _doc_tokens(corpus: Path) -> list[set[int]]:
    from ms_data import Corpus

    c = Corpus(str(corpus))
    return [set(c.read_document(d).tolist()) for d in range(c.n_docs)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_training_stream_never_holds_a_held_out_document(corpus: Path, tmp_path: Path) -> None:
    config = _config(corpus, tmp_path, "train.eval_every=1", "train.eval_batches=3")
    docs = _doc_tokens(corpus)
    with Trainer(config, peak_flops=1e9, stream=io.StringIO()) as trainer:
        assert trainer.dataset is not None and trainer.evaluator is not None
        held = set(trainer.dataset.held_out_documents.tolist())
        assert len(held) == 4  # 10% of 40 documents
        per_epoch = trainer.dataset.samples_per_epoch
        assert per_epoch is not None
        # Two epochs and more of what the node loader gives this (only) rank.
        batches = [next(trainer.loader) for _ in range(2 * per_epoch // 2 + 2)]
        evaluated = trainer.evaluator._my_batches()
    trained = {int(t) for b in batches for t in b.flatten()} - {EOS}
    held_tokens = set().union(*(docs[d] for d in held))
    assert not trained & held_tokens
    assert trained == set().union(*docs) - held_tokens  # every other document is trained on
    assert len(evaluated) == 3 * 4 // 2  # 3 global batches of 4, in micro-batches of 2
    assert {int(t) for b in evaluated for t in b.flatten()} - {EOS} <= held_tokens


def _train(config: Config, stream: io.StringIO | None = None) -> dict[str, Any]:
    with Trainer(config, peak_flops=1e9, stream=stream or io.StringIO()) as trainer:
        s = trainer.train()
        training = trainer.model.training
    return {
        "losses": s.loss_history,
        "final": s.final_loss,
        "evals": s.eval_history,
        "eval": s.eval_loss,
        "training": training,
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_evaluating_leaves_training_exactly_as_it_was(corpus: Path, tmp_path: Path) -> None:
    """With dropout on, an evaluation that drew from the RNG or left the model in eval
    mode would change every later training loss."""
    common = ["train.steps=6", "model.dropout=0.1"]
    off = _train(_config(corpus, tmp_path / "off", *common))
    stream = io.StringIO()
    on_config = _config(corpus, tmp_path / "on", *common, "train.eval_every=2")
    on = _train(on_config, stream)
    assert on["losses"] == off["losses"]  # exactly
    assert on["training"] and off["training"]
    assert [s for s, _ in on["evals"]] == [2, 4, 6] and off["evals"] == []
    assert on["eval"] == on["evals"][-1][1] and 0 < on["eval"] < 20
    assert on["final"] == on["losses"][-1][1] == off["final"]
    records = read_metrics(tmp_path / "on" / "metrics.jsonl")
    assert [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r] == on["evals"]
    saved = json.loads((tmp_path / "on" / "summary.json").read_text())
    assert saved["eval_loss"] == on["eval"] and saved["final_loss"] == on["final"]
    text = stream.getvalue()
    assert "eval: every 2 steps and at the end, on 4 held-out documents" in text
    assert f"eval {on['evals'][0][1]:.4f}" in text  # in the progress line
    assert re.search(rf"\nheld-out loss +{on['eval']:.4f} \(step 6\)\n", text)  # summary

    # A new process resuming the last checkpoint evaluates the same sequences alike.
    with Trainer(on_config, peak_flops=1e9, stream=io.StringIO()) as again:
        assert again.resume() == 6 and again.evaluator is not None
        assert again.evaluator.loss(again.model, again._autocast) == on["eval"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_held_out_loss_is_the_same_on_every_rank_and_in_one_process(
    corpus: Path, tmp_path: Path
) -> None:
    extra = ["train.steps=4", "train.eval_every=2", "checkpoint.resume=false"]
    env = {"OMP_NUM_THREADS": "1"}
    one = run_ranks(
        _train, 1, args=(_config(corpus, tmp_path / "one", *extra),), timeout=180, env=env
    )[0]
    two = run_ranks(
        _train, 2, args=(_config(corpus, tmp_path / "two", *extra),), timeout=180, env=env
    )
    assert two[0]["evals"] == two[1]["evals"]  # one all-reduced mean on every rank
    assert [s for s, _ in two[0]["evals"]] == [2, 4]
    torch.testing.assert_close(
        torch.tensor([v for _, v in two[0]["evals"]]),
        torch.tensor([v for _, v in one["evals"]]),
        rtol=2e-5,
        atol=2e-5,
    )


def test_eval_needs_a_held_out_split(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"train.eval_every = 5 needs a held-out split .*"
        r"data.eval_fraction > 0",
    ):
        _config(corpus, tmp_path, "train.eval_every=5", "data.eval_fraction=0")
    with pytest.raises(ConfigError, match=r"data.eval_fraction must be a float in \[0, 1\)"):
        _config(corpus, tmp_path, "data.eval_fraction=1.5")
    config = _config(corpus, tmp_path, "train.eval_every=5")
    with pytest.raises(ConfigError, match=r"a loader given to the Trainer has none"):
        Trainer(config, loader=iter([torch.zeros(2, 33, dtype=torch.long)]))


def test_the_loss_plot_draws_the_held_out_loss_as_a_second_curve(tmp_path: Path) -> None:
    from ms_train.report import plot_loss

    records = [{"step": s, "loss": 5.0 - 0.1 * s} for s in range(1, 11)]
    with_eval = [
        r | {"eval_loss": 4.0 - 0.1 * r["step"]} if r["step"] % 5 == 0 else r for r in records
    ]
    assert plot_loss(records, tmp_path / "train.png")
    assert plot_loss(with_eval, tmp_path / "both.png")
    import matplotlib.image

    train = matplotlib.image.imread(tmp_path / "train.png")
    both = matplotlib.image.imread(tmp_path / "both.png")
    assert train.shape == both.shape and (train != both).any()
