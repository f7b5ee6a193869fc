"""Configuration: presets, TOML files, --set overrides, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ms_train.config import PRESETS, ConfigError, load_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name: str) -> None:
    cfg = load_config(preset=name)
    assert cfg.model.d_model % cfg.model.n_heads == 0


def test_the_175b_preset_is_the_papers_model_and_layout() -> None:
    cfg = load_config(preset="gpt-175b")
    m, p = cfg.model, cfg.parallel
    assert (m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size) == (
        96,
        12288,
        128,
        2048,
        64000,
    )
    assert (p.tp, p.pp, p.virtual_stages) == (8, 8, 6)
    assert cfg.layout(12288) == (192, 32)  # DP 192; batch 6144 = 192 ranks x 32 micro-batches


def test_default_is_tiny_and_file_then_overrides_apply_in_order(tmp_path: Path) -> None:
    assert load_config() == load_config(preset="tiny")
    path = tmp_path / "run.toml"
    path.write_text(
        "[model]\nvocab_size = 100\nd_model = 64\nn_layers = 2\nn_heads = 4\nseq_len = 64\n"
        "[optim]\nname = 'adamw'\nlr = 1e-3\n"
    )
    cfg = load_config(path, overrides=["model.n_layers=6", "optim.lr=2e-3", "model.window=none"])
    assert cfg.model.n_layers == 6 and cfg.model.d_model == 64 and cfg.model.window is None
    assert cfg.optim.name == "adamw" and cfg.optim.lr == 2e-3
    # A file on top of a preset changes only what it names.
    cfg = load_config(path, preset="tiny")
    assert cfg.model.d_model == 64 and cfg.train.steps == PRESETS["tiny"]["train"]["steps"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.n_layer=3",
            r"unknown key in --set: 'model.n_layer'; did you mean 'model.n_layers'",
        ),
        ("modle.n_layers=3", r"unknown section in --set: 'modle'; did you mean 'model'"),
        ("model.n_layers=3.5", r"model.n_layers must be an int >= 1, got 3.5"),
        ("model.d_model=true", r"model.d_model must be an int >= 1, got True"),
        ("model.n_heads=5", r"model.n_heads must divide model.d_model: 128 is not a multiple of 5"),
        ("model.window=-1", r"model.window must be None .* got -1"),
        ("model.window=0", r"model.window must be None .* got 0"),
        ("model.block=fancy", r"model.block must be one of \['parallel', 'serial'\], got 'fancy'"),
        ("optim.lr=abc", r"optim.lr must be a number > 0.0, got 'abc'"),
        ("optim.min_lr=1.0", r"optim.min_lr \(1.0\) must not exceed optim.lr"),
        ("parallel.tp=3", r"parallel.tp \(3\) must divide model.n_heads \(4\)"),
        ("parallel.pp=3", r"model.n_layers \(4\) must split evenly into parallel.pp"),
        ("parallel.replicated_chunks=-1", r"parallel.replicated_chunks must be an int >= 0"),
        (
            "parallel.replicated_chunks=7",
            r"parallel.replicated_chunks \(7\) must not exceed the model's 6 ZeRO chunks",
        ),
        (
            "data.global_batch=12",
            r"data.global_batch \(12\) must be a multiple of data.micro_batch",
        ),
        ("model.n_layers", r"--set takes section.field=value"),
    ],
)
def test_errors_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


def test_layout_checks_the_world_size() -> None:
    cfg = load_config(overrides=["data.global_batch=16", "data.micro_batch=8"])
    assert cfg.layout(1) == (1, 2) and cfg.layout(2) == (2, 1)
    with pytest.raises(
        ConfigError,
        match=r"data.global_batch \(16\) must be a multiple of data.micro_batch x dp = 8 x 4",
    ):
        cfg.layout(4)
    tp = load_config(overrides=["parallel.tp=2"])
    with pytest.raises(
        ConfigError,
        match=r"world size \(3\) must be a multiple of parallel.tp x parallel.pp = 2 x 1",
    ):
        tp.layout(3)


def test_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(tmp_path / "missing.toml")
    partial = tmp_path / "partial.toml"
    partial.write_text("[train]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"\[model\] section is required"):
        load_config(partial)
    with pytest.raises(ConfigError, match="unknown preset 'gpt-17b'; did you mean 'gpt-175b'"):
        load_config(preset="gpt-17b")


@given(st.integers(1, 64), st.integers(1, 4), st.sampled_from(["parallel", "serial"]))
def test_overrides_round_trip(layers: int, heads_log: int, block: str) -> None:
    heads = 2**heads_log
    cfg = load_config(
        overrides=[f"model.n_layers={layers}", f"model.n_heads={heads}", f"model.block={block}"]
    )
    assert (cfg.model.n_layers, cfg.model.n_heads, cfg.model.block) == (layers, heads, block)
    assert cfg.model.head_dim * heads == cfg.model.d_model


def test_replicated_chunks_is_for_zero_only() -> None:
    with pytest.raises(
        ConfigError, match=r"parallel.replicated_chunks \(1\) applies to the zero engine only"
    ):
        load_config(overrides=["parallel.engine=ddp", "parallel.replicated_chunks=1"])


@pytest.mark.parametrize("tie", [True, False])
def test_replicated_chunks_bound_is_the_models_zero_chunks(tie: bool) -> None:
    """The bound the config checks is the number of chunks ZeRO finds in the model."""
    from ms_parallel import default_chunks
    from ms_train.model import GPT

    cfg = load_config(overrides=[f"model.tie_embeddings={str(tie).lower()}"])
    n = cfg.model.n_layers + 2
    assert len(default_chunks(GPT(cfg.model, device="meta"))) == n
    load_config(
        overrides=[f"model.tie_embeddings={str(tie).lower()}", f"parallel.replicated_chunks={n}"]
    )
