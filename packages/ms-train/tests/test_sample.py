"""The sample at the end of a run is text, whichever tokenizer the data was built with."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from ms_data import build_shards, get_tokenizer
from ms_data.build import BuildConfig
from ms_train.config import load_config
from ms_train.trainer import Trainer


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_on_a_hugging_face_tokenizer_samples_text(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    import json as json_mod
    import textwrap

    sources = [json_mod.__file__, textwrap.__file__]
    # A byte-level BPE trained here on the corpus itself: no download.
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train(sources, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    shards = tmp_path / "shards"
    build_shards(sources, shards, BuildConfig(tokenizer=str(path)), progress=False)

    overrides = [
        f"model.vocab_size={get_tokenizer(path).vocab_size}",
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=2",
        "model.seq_len=32",
        "model.window=16",
        "data.micro_batch=4",
        "data.global_batch=4",
        f"data.shards={shards}",
        f"data.tokenizer={path}",
        "optim.warmup_steps=1",
        "train.steps=2",
        "train.sample_tokens=16",
        "checkpoint.every=0",
        f"train.out_dir={tmp_path / 'run'}",
    ]
    config = load_config(None, preset="tiny", overrides=overrides)
    with Trainer(config, peak_flops=1e9, stream=io.StringIO()) as t:
        sample = t.train().sample
    assert sample is not None and sample.startswith("def")  # the prompt, decoded
    assert not re.fullmatch(r"[\d ]+", sample), sample  # not a list of token ids
    assert (tmp_path / "run" / "sample.txt").read_text() == sample + "\n"
