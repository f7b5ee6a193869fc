"""Resumed training continues bit-identically: a model with dropout, AdamW and data drawn
from the torch RNG, trained in one process with a save at step 4, and resumed from that
checkpoint in a fresh process, gives exactly the same losses (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SUPPORT = Path(__file__).parent / "_ckpt_support.py"
pytestmark = pytest.mark.slow  # two training runs, each in a fresh interpreter


def train(root: Path, *extra: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(SUPPORT), "train", str(root), "8", "4", *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    uninterrupted = train(tmp_path)
    assert len(uninterrupted) == 8 and len(set(uninterrupted)) == 8
    resumed = train(tmp_path, "resume")
    assert resumed == uninterrupted[4:]
