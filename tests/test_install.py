"""Each leaf installs alone, with pip, into a fresh venv that holds only the pinned torch."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest
from _fresh_venv import TORCH_PIN, ms_distributions, pip, user_env
from _workspace import LEAVES, ROOT, module_name


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_each_leaf_installs_alone_in_a_fresh_venv(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    pip(python, "install", "--quiet", TORCH_PIN)
    assert ms_distributions(python) == {}
    for leaf in LEAVES:
        # Pin torch as the dev install does, so no leaf can pull a different build.
        pip(python, "install", "--quiet", str(ROOT / "packages" / leaf), TORCH_PIN)
        installed = sorted(ms_distributions(python))
        assert installed == [leaf], f"installing {leaf} pulled other ms packages: {installed}"
        result = subprocess.run(
            [str(python), "-c", f"import {module_name(leaf)} as m; print(m.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,  # not the repository, so nothing is imported from a source tree
            # Without the session's TRITON_INTERPRET: the interpreter needs numpy,
            # which no leaf requires.
            env=user_env(),
        )
        assert result.returncode == 0, f"import {module_name(leaf)} failed:\n{result.stderr}"
        pip(python, "uninstall", "--yes", "--quiet", leaf)
