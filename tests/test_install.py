"""Each leaf installs alone, with pip, into a fresh venv that holds only the pinned torch."""

from __future__ import annotations

import os
import subprocess
import venv
from pathlib import Path

import pytest
from _workspace import LEAVES, ROOT, module_name

TORCH_PIN = next(
    line.strip()
    for line in (ROOT / "requirements" / "dev.txt").read_text().splitlines()
    if line.startswith("torch==")
)


def _pip(python: Path, *args: str) -> str:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    result = subprocess.run(
        [str(python), "-m", "pip", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _ms_distributions(python: Path) -> list[str]:
    out = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; "
            "print('\\n'.join(sorted(d.metadata['Name'] for d in m.distributions())))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [name for name in out.split() if name.lower().startswith("ms-")]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_each_leaf_installs_alone_in_a_fresh_venv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    _pip(python, "install", "--quiet", TORCH_PIN)
    assert _ms_distributions(python) == []
    for leaf in LEAVES:
        # Pin torch as the dev install does, so no leaf can pull a different build.
        _pip(python, "install", "--quiet", str(ROOT / "packages" / leaf), TORCH_PIN)
        assert _ms_distributions(python) == [leaf], f"installing {leaf} pulled other ms packages"
        result = subprocess.run(
            [str(python), "-c", f"import {module_name(leaf)} as m; print(m.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,  # not the repository, so nothing is imported from a source tree
            # A user's environment: the root conftest turns on Triton's interpreter for
            # the test session, and the interpreter needs numpy, which no leaf requires.
            env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        )
        assert result.returncode == 0, f"import {module_name(leaf)} failed:\n{result.stderr}"
        _pip(python, "uninstall", "--yes", "--quiet", leaf)
