"""The README's example and CLI lines run as written, in order, once, in an empty folder,
so that the README cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).parents[1] / "README.md"

pytestmark = pytest.mark.slow  # trains 200 steps and starts four interpreters


def block(section: str, lang: str) -> str:
    """The first ``lang`` code block under the README heading ``## section``."""
    text = README.read_text()
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {section}' section"
    code = re.search(rf"^```{lang}\n(.*?)^```", m.group(1), re.M | re.S)
    assert code, f"README.md's '## {section}' has no {lang} block"
    return code.group(1)


def test_example_then_cli_lines_run_in_an_empty_folder(tmp_path: Path) -> None:
    example, cli = block("Example", "python"), block("CLI", "bash")
    (tmp_path / "example.py").write_text(example)
    run = subprocess.run(
        [sys.executable, "example.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # The console script installed beside this interpreter, as a user's shell finds it.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    shell = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", cli],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert shell.returncode == 0, f"{shell.stdout[-2000:]}\n{shell.stderr[-3000:]}"
    assert re.search(r"^\s*100\s+committed", shell.stdout, re.M), shell.stdout
    assert re.search(r"^\s*200\s+committed.*latest$", shell.stdout, re.M), shell.stdout
    assert re.search(r"^verified: all \d+ records OK$", shell.stdout, re.M), shell.stdout
    state = torch.load(tmp_path / "out.pt", weights_only=False)
    assert state["step"] == 200 and set(state) == {"model", "optim", "rng", "step"}
