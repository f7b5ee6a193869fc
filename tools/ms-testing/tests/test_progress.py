"""Progress tails metrics.jsonl as a job appends to it, unfinished lines included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ms_testing.progress import Progress


def test_new_steps_are_seen_once_in_order_and_a_half_written_line_waits(tmp_path: Path) -> None:
    watch = Progress(tmp_path)
    assert watch.poll() == 0 and watch.furthest == 0  # no file yet
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"step": 1, "loss": 5.0}) + "\n" + '{"step": 2, "lo')
    assert watch.poll() == 1 and watch.furthest == 1
    t1 = watch.seen[0][1]
    with open(path, "a") as f:
        f.write('ss": 4.0}\n' + json.dumps({"step": 1, "loss": 5.0}) + "\n")  # a restart
    assert watch.poll() == 2
    assert [s for s, _, _ in watch.seen] == [1, 2, 1]
    assert watch.furthest == 2
    assert watch.first_beyond(1, after=t1) == watch.seen[1][1]
    assert watch.first_beyond(2, after=t1) is None
    assert watch.wait_for(2, timeout=1) == watch.seen[1][1]
    with pytest.raises(TimeoutError, match=r"no step 3 in 0\.1 s"):
        watch.wait_for(3, timeout=0.1)


def test_a_rewritten_file_is_read_again_from_the_start(tmp_path: Path) -> None:
    """A resumed ms-train run replaces metrics.jsonl with its records up to the resume
    step, then appends: the new steps are seen."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    watch = Progress(tmp_path)
    assert watch.poll() == 4
    tmp = tmp_path / "new"
    tmp.write_text(json.dumps({"step": 1}) + "\n")
    tmp.replace(path)
    with open(path, "a") as f:
        f.write(json.dumps({"step": 2}) + "\n")
    assert watch.poll() == 2
    assert [s for s, _, _ in watch.seen] == [1, 2, 3, 4, 1, 2]
