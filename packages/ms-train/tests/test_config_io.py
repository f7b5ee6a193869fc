"""Config files: the TOML writer reads back to the same config, JSON files work like
TOML ones, and a file's syntax error names the file, line and column."""

from __future__ import annotations

import json
import math
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_train._config_io import section_to_toml, toml_string, toml_value
from ms_train.config import _SECTIONS, PRESETS, Config, ConfigError, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# deadline=None: a per-example time limit would be a timing assertion on a busy machine.
@settings(deadline=None)
@given(st.text())
def test_toml_strings_round_trip(text: str) -> None:
    written = toml_string(text)
    assert tomllib.loads(f"v = {written}")["v"] == text
    assert "\n" not in written  # one line: a basic string, never a multi-line one


@settings(deadline=None)
@given(st.one_of(st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1), st.floats(allow_nan=False)))
def test_toml_scalars_round_trip(value: Any) -> None:
    back = tomllib.loads(f"v = {toml_value(value)}")["v"]
    assert back == value and type(back) is type(value)


def test_toml_nan_and_arrays() -> None:
    assert math.isnan(tomllib.loads(f"v = {toml_value(float('nan'))}")["v"])
    assert tomllib.loads(f"v = {toml_value((1, 'a', [True, 2.5]))}")["v"] == [1, "a", [True, 2.5]]


def test_toml_refuses_what_it_cannot_write() -> None:
    with pytest.raises(
        ConfigError, match=r"train.sample_prompt holds a lone surrogate \(U\+D800\)"
    ):
        toml_value("a\ud800", "train.sample_prompt")
    with pytest.raises(ConfigError, match=r"model.x cannot be written as TOML: .* got dict"):
        toml_value({"a": 1}, "model.x")


def _write(config: Config, suffix: str = ".toml") -> Any:
    """``load_config`` of ``config`` written as a TOML file (or the trainer's JSON)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"config{suffix}"
        if suffix == ".json":
            path.write_text(json.dumps(config.to_dict(), indent=2), encoding="utf-8")
        else:
            path.write_text(config.to_toml(), encoding="utf-8")
        return load_config(path)


# Overrides valid under every preset (gpt-175b has tp 8: d_ff a multiple of 8).
_overrides = st.fixed_dictionaries(
    {},
    optional={
        "model.window": st.one_of(st.none(), st.integers(1, 128)),  # <= every seq_len
        "model.d_ff": st.one_of(st.none(), st.integers(1, 1 << 16).map(lambda k: 8 * k)),
        "model.dropout": st.floats(0.0, 1.0, exclude_max=True),
        "model.init_std": st.floats(1e-300, 1e300),
        "model.tie_embeddings": st.booleans(),
        "model.block": st.sampled_from(["parallel", "serial"]),
        "model.seed": st.integers(-(1 << 63), (1 << 63) - 1),
        "optim.name": st.sampled_from(["lamb", "adamw"]),
        "optim.eps": st.floats(5e-324, 1.0),
        "data.shuffle": st.booleans(),
        "train.steps": st.integers(100_000, 1 << 40),
    },
)


@settings(deadline=None, max_examples=60)
@given(
    st.sampled_from(sorted(PRESETS)),
    _overrides,
    st.text(),
    st.text(),
    st.sampled_from([".toml", ".json"]),
)
def test_any_config_round_trips_through_a_file(
    preset: str, values: dict[str, Any], out_dir: str, prompt: str, suffix: str
) -> None:
    config = load_config(preset=preset)
    sections = {name: attrs.asdict(getattr(config, name)) for name in _SECTIONS}
    for key, value in values.items():
        section, name = key.split(".")
        sections[section][name] = value
    sections["train"].update(out_dir=out_dir, sample_prompt=prompt)
    config = Config(**{name: _SECTIONS[name](**kw) for name, kw in sections.items()})
    assert _write(config, suffix) == config


def test_a_none_over_a_presets_value_reads_back_as_none(tmp_path: Path) -> None:
    config = load_config(preset="tiny", overrides=["model.window=none"])
    assert PRESETS["tiny"]["model"]["window"] == 64 and config.model.window is None
    path = tmp_path / "tiny.toml"
    path.write_text(config.to_toml())
    assert "# window: none" in path.read_text()
    assert load_config(path) == config
    # Under a preset the left-out key takes the preset's value again, which is why the
    # written file says it is meant for --config alone.
    assert load_config(path, preset="tiny").model.window == 64


@attrs.frozen(kw_only=True)
class _Section:
    a: int | None = None
    b: int | None = 3


def test_a_none_that_leaving_out_would_not_give_back_is_refused() -> None:
    assert section_to_toml("s", _Section(a=None, b=1)) == [
        "[s]",
        "# a: none (left out: TOML has no null; none is the default)",
        "b = 1",
    ]
    with pytest.raises(ConfigError, match=r"s.b is None, .* \(s.b has the default 3\)"):
        section_to_toml("s", _Section(b=None))


def test_every_field_that_may_be_none_defaults_to_none() -> None:
    """The writer leaves a None out so that the default applies; a field that can be None
    with another default would make --print-config refuse such a config."""
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for field in attrs.fields(cls):
            if type(None) in typing.get_args(hints[field.name]):
                assert field.default is None, f"{section}.{field.name} may be None"


def test_json_file_works_like_toml(tmp_path: Path) -> None:
    doc = {
        "model": {"vocab_size": 100, "d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "optim": {"name": "adamw", "lr": 1e-3, "min_lr": 0},
    }
    as_json, as_toml = tmp_path / "run.JSON", tmp_path / "run.toml"
    as_json.write_text(json.dumps(doc))
    as_toml.write_text(
        "[model]\nvocab_size = 100\nd_model = 64\nn_layers = 2\nn_heads = 4\nseq_len = 64\n"
        "[optim]\nname = 'adamw'\nlr = 1e-3\nmin_lr = 0\n"
    )
    assert load_config(as_json) == load_config(as_toml)
    overrides = ["model.n_layers=4", "optim.lr=2e-3"]
    assert load_config(as_json, preset="tiny", overrides=overrides) == load_config(
        as_toml, preset="tiny", overrides=overrides
    )
    # JSON has a null: it sets a field to None over a preset's value.
    as_json.write_text(json.dumps({"model": {"window": None}}))
    assert load_config(as_json, preset="tiny").model.window is None
    # A byte-order mark (some Windows editors write one) is not an error in either.
    for path in (as_json, as_toml):
        without = load_config(path, preset="tiny")
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        assert load_config(path, preset="tiny") == without


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.toml", "[model\n", r"bad.toml:1:7: not valid TOML: Expected ']'"),
        ("bad.toml", "[model]\nd_model = 12 8\n", r"bad.toml:2:14: not valid TOML: "),
        ("bad.toml", '[model]\nblock = "par', r"bad.toml:2:\d+: not valid TOML: "),
        ("bad.toml", "[model]\nn_layers =", r"bad.toml:2:11: not valid TOML: .* end of the file"),
        ("bad.json", '{"model": {\n  "d_model": 128,\n}}', r"bad.json:3:1: not valid JSON: "),
        ("bad.json", '{"model": {"d_model": 12 8}}', r"bad.json:1:26: not valid JSON: Expecting"),
        ("bad.json", '{"model": {"d_model": 1, "d_model": 2}}', r"'d_model' appears twice"),
        ("bad.json", "[1, 2]", r"bad.json: a config file holds one JSON object per section, got"),
        ("bad.json", '{"model": 3}', r"bad.json: \[model\] must be a table, got 3"),
        ("bad.json", '{"model": {"n_layers": "four"}}', r"model.n_layers must be an int >= 1"),
        ("bad.json", '{"optim": {"lr": null}}', r"optim.lr must be a number > 0.0, got None"),
        ("bad.json", '{"modle": {}}', r"unknown section in .*bad.json: 'modle'; did you mean"),
    ],
)
def test_file_errors_name_the_file_and_where(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(path, preset="tiny")
    assert "\n" not in str(caught.value)


def test_a_file_without_a_preset_names_the_fields_it_lacks(tmp_path: Path) -> None:
    path = tmp_path / "partial.json"
    path.write_text(json.dumps({"model": {"d_model": 64, "n_layers": 2}}))
    with pytest.raises(
        ConfigError,
        match=r"^model.vocab_size, model.n_heads, model.seq_len must be given \(no default\): "
        r"in the file's \[model\] table, with --set, or by a --preset$",
    ):
        load_config(path)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[train]\nsample_prompt = 'caf\xe9'\n")
    with pytest.raises(ConfigError, match=r"latin1.toml:2: not UTF-8 text"):
        load_config(path)
