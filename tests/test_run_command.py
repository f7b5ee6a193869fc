"""The README's run command, ``make run``, in a short mode: a few steps of the tiny
preset on 2 data-parallel ranks through torchrun, on the embedded corpus built from
scratch; a second run reuses what the first left, a third with more steps resumes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from _workspace import ROOT


def _make_run(tmp: Path, steps: int) -> subprocess.CompletedProcess[str]:
    # Not the test run's own make: no inherited jobserver or level.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["MS_TRAIN_CACHE"] = str(tmp / "cache")  # the corpus is built, not reused
    overrides = [
        f"train.steps={steps}",
        "optim.warmup_steps=2",
        "checkpoint.every=3",
        "train.log_every=1",
        "train.sample_tokens=40",
        f"train.out_dir={tmp / 'run'}",
    ]
    run_args = " ".join(f"--set {o}" for o in overrides)
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "run", f"RUN_ARGS={run_args}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is one of the README's needs")
def test_make_run_trains_then_reuses_then_resumes(tmp_path: Path) -> None:
    first = _make_run(tmp_path, steps=6)
    assert first.returncode == 0, first.stdout + first.stderr
    out = tmp_path / "run"
    for name in ("metrics.jsonl", "loss.png", "sample.txt", "summary.json", "config.json"):
        assert (out / name).is_file(), name
    assert "2 rank(s) on cpu" in first.stdout and "starting fresh" in first.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["start_step"], summary["end_step"], summary["world_size"]) == (0, 6, 2)
    losses = [loss for _, loss in summary["loss_history"]]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert (tmp_path / "cache").is_dir()  # the demo corpus was built there

    again = _make_run(tmp_path, steps=6)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "already reaches train.steps = 6; nothing to train" in again.stdout

    longer = _make_run(tmp_path, steps=8)
    assert longer.returncode == 0, longer.stdout + longer.stderr
    assert "resumed from step 6" in longer.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()]
    assert steps == list(range(1, 9))
