"""``ms-train --version``, ``--print-config`` and ``ms-train config``."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ms_train
from ms_train._config_doc import attribute_docs
from ms_train.cli import main
from ms_train.config import _SECTIONS, PRESETS, load_config


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------------- --version


REPO = Path(__file__).resolve().parents[3]


def _workspace_packages() -> dict[str, str]:
    """``{name: version}`` of every package under packages/, from its _version.py."""
    out = {}
    for version_file in sorted(REPO.glob("packages/*/src/ms_*/_version.py")):
        found = re.search(r'__version__ = "([^"]+)"', version_file.read_text())
        assert found, version_file
        out[version_file.parents[2].name] = found[1]
    return out


def test_version_lists_every_ms_package_and_torch_without_a_config() -> None:
    # No config is read: a file that is not there and a --set that is wrong do not matter.
    code, out, err = _run(["--version", "--config", "/no/such/config.toml", "--set", "x=1"])
    assert code == 0 and err == ""
    assert out.splitlines()[0].split() == ["ms-train", ms_train.__version__]
    rows = dict(line.split(maxsplit=1) for line in out.splitlines())
    packages = _workspace_packages()
    assert len(packages) == 7 and "ms-train" in packages  # the workspace is all here
    for name, version in packages.items():
        assert rows.pop(name) == version, name
    assert rows.pop("torch") == torch.__version__
    assert rows.pop("Python") == ".".join(map(str, sys.version_info[:3]))
    # What else may show: the workspace's test helpers, and the optional kernel libraries.
    assert set(rows) <= {"ms-testing", "triton", "flash-attn"}, rows


@pytest.mark.slow
def test_version_of_the_installed_command(tmp_path: Path) -> None:
    command = Path(sys.executable).parent / "ms-train"
    proc = subprocess.run(
        [str(command), "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["ms-train", ms_train.__version__]
    assert "ms-ckpt" in proc.stdout and "torch" in proc.stdout


# ------------------------------------------------------------------------- --print-config


def _set_text(value: Any) -> str:
    """A --set value: TOML syntax, and ``none`` for None."""
    if value is None:
        return "none"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string for this alphabet
    return json.dumps(value) if type(value) is bool else repr(value)


# Printable text (no controls, no surrogates): what a shell passes to --set quoted.
_text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=20)

_overrides = st.fixed_dictionaries(
    {},
    optional={
        # At most every preset's seq_len: a longer window is refused.
        "model.window": st.one_of(st.none(), st.integers(1, 128)),
        "model.d_ff": st.one_of(st.none(), st.integers(1, 4096).map(lambda k: 8 * k)),
        "model.dropout": st.floats(0.0, 1.0, exclude_max=True),
        "model.tie_embeddings": st.booleans(),
        "model.block": st.sampled_from(["parallel", "serial"]),
        "optim.name": st.sampled_from(["lamb", "adamw"]),
        "optim.lr": st.floats(1.0, 10.0),
        "optim.min_lr": st.floats(0.0, 1e-4),
        "optim.weight_decay": st.floats(0.0, 1e3),
        "data.shuffle": st.booleans(),
        "data.seed": st.integers(0, (1 << 63) - 1),
        "train.steps": st.integers(2000, 1 << 40),
        "train.precision": st.sampled_from(["auto", "bf16", "fp32"]),
        "train.out_dir": _text,
        "train.sample_prompt": _text,
        "checkpoint.resume": st.booleans(),
    },
)


@settings(deadline=None, max_examples=60)
@given(st.sampled_from(sorted(PRESETS)), _overrides)
def test_print_config_reads_back_to_the_same_config(preset: str, values: dict[str, Any]) -> None:
    sets = [f"{key}={_set_text(value)}" for key, value in values.items()]
    expected = load_config(preset=preset, overrides=sets)
    argv = ["--preset", preset, "--print-config"]
    for item in sets:
        argv += ["--set", item]
    code, out, err = _run(argv)
    assert code == 0, err
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "printed.toml"
        path.write_text(out, encoding="utf-8")
        assert load_config(path) == expected
        # A printed config prints the same again: nothing is lost on the way.
        assert _run(["--config", str(path), "--print-config"])[1] == out


def test_print_config_of_a_json_file_and_the_default(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(load_config(overrides=["model.window=none"]).to_dict()))
    code, out, _ = _run(["--config", str(path), "--print-config"])
    assert code == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    assert load_config(printed) == load_config(path)
    assert _run(["--print-config"])[1] == _run(["--preset", "tiny", "--print-config"])[1]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.toml", "[model]\nd_model = 12 8\n", r"bad.toml:2:14: not valid TOML"),
        ("bad.json", '{"model": {\n  "d_model": 128,\n}}', r"bad.json:3:1: not valid JSON"),
        ("bad.json", '{"model": {"n_layers": "four"}}', r"model.n_layers must be an int"),
        ("bad.toml", "[model]\nn_layers = 'four'\n", r"model.n_layers must be an int"),
    ],
)
@pytest.mark.parametrize("extra", [["--print-config"], []])
def test_config_file_errors_are_one_line_and_exit_2(
    tmp_path: Path, name: str, text: str, message: str, extra: list[str]
) -> None:
    path = tmp_path / name
    path.write_text(text)
    # Training (no --print-config) stops at the config, before any process group or data.
    code, out, err = _run(["--preset", "tiny", "--config", str(path), *extra])
    assert code == 2 and out == ""
    assert re.fullmatch(rf"ms-train: error: .*{message}.*\n", err), err


# ------------------------------------------------------------------------- ms-train config


def test_config_lists_every_field_of_every_section_with_help() -> None:
    code, out, _ = _run(["config", "--json"])
    assert code == 0
    listing = json.loads(out)
    assert list(listing) == list(_SECTIONS) == [f.name for f in attrs.fields(type(load_config()))]
    text = _run(["config"])[1]
    for section, cls in _SECTIONS.items():
        assert listing[section]["summary"]
        fields = {f["key"]: f for f in listing[section]["fields"]}
        assert list(fields) == [f"{section}.{f.name}" for f in attrs.fields(cls)]
        for field in attrs.fields(cls):
            row = fields[f"{section}.{field.name}"]
            assert row["help"] and row["type"], f"{section}.{field.name} has no help or type"
            assert row["required"] == (field.default is attrs.NOTHING)
            if not row["required"]:
                assert row["default"] == field.default
            assert f"\n  {row['key']}: {row['type']} " in text
        # The docstring documents no field that is not there (a renamed or removed one).
        assert set(attribute_docs(cls)) <= {f.name for f in attrs.fields(cls)}
    assert "model.window: int | none = none" in text
    assert 'model.block: "parallel" | "serial" = "parallel"' in text
    assert "model.vocab_size: int (required)" in text


def test_config_names_sections_and_refuses_unknown_ones() -> None:
    code, out, _ = _run(["config", "optim", "train"])
    assert code == 0 and out.startswith("[optim]") and "\n[train]" in out and "model." not in out
    code, out, err = _run(["config", "optm"])
    assert code == 2 and out == ""
    assert err == (
        "ms-train config: error: unknown section 'optm'; did you mean 'optim'? "
        "(known: model, data, optim, parallel, train, checkpoint)\n"
    )


def test_docstring_entries_are_the_help_of_new_fields() -> None:
    @attrs.frozen
    class Section:
        """A section someone adds.

        Attributes:
            grace: seconds a rank gets to finish its step after SIGTERM, then the
                launcher kills it (``0``: none).
            beta1, beta2: the moment coefficients.
            forgotten_in_docstring_but_named_like_a_field_elsewhere: x.
        Returns:
            nothing: this block is not attributes.
        """

        grace: float = 30.0
        beta1: float = 0.9
        beta2: float = 0.95
        eps: float = 1e-8

    docs = attribute_docs(Section)
    assert docs["grace"] == (
        "seconds a rank gets to finish its step after SIGTERM, then the launcher kills it "
        "(0: none)."
    )
    assert docs["beta1"] == docs["beta2"] == "beta1, beta2: the moment coefficients."
    assert "eps" not in docs and "nothing" not in docs
