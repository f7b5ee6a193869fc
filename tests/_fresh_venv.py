"""Helpers of the fresh-install tests: pip and a user's environment in a fresh venv."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from _workspace import ROOT

# The dev/CI torch, which lies on the machine's disk; a fresh venv given a looser
# requirement would fetch a multi-GB CUDA build.
TORCH_PIN = next(
    line.strip()
    for line in (ROOT / "requirements" / "dev.txt").read_text().splitlines()
    if line.startswith("torch==")
)


def user_env() -> dict[str, str]:
    """This process's environment less what the test session or make adds to it.

    The root conftest turns on Triton's interpreter, which a user's environment
    does not have; an inherited make jobserver or PYTHONPATH would leak the session
    into the command under test.
    """
    leaked = ("TRITON_INTERPRET", "PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in leaked}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip(python: Path, *args: str, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(python), "-m", "pip", *args],
        capture_output=True,
        text=True,
        env=user_env(),
        cwd=cwd,
        timeout=900,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, f"pip {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def ms_distributions(python: Path) -> dict[str, str]:
    """Name -> version of every installed ms-* distribution of the venv's python."""
    out = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m\n"
            "for d in m.distributions(): print(d.metadata['Name'], d.version)",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=user_env(),
    ).stdout
    pairs = (line.split() for line in out.splitlines() if line.strip())
    return {name: version for name, version in pairs if name.lower().startswith("ms-")}
