"""rank_processes: a rank's forked child is not a second process of that rank; JobWatch:
the segments a job held are told from another job's."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid

import pytest

from ms_testing.jobs import JobWatch, process_starttime, rank_processes, tag_env, wait_gone

MARK = "ms_testing_fake_rank"

# Forks a child that keeps the parent's command line and environment (as a checkpoint
# writer does between fork and exec), prints both pids, then sleeps.
FORKING = f"""
import os, sys, time  # {MARK}
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(os.getpid(), child, flush=True)
time.sleep(60)
"""

# A process that starts a rank: the rank counts, and its parent counts only if it has a
# RANK of its own (a launcher has none; a rank 4 starting rank 3 is two ranks).
LAUNCHING = f"""
import os, subprocess, sys, time  # {MARK}
rank = subprocess.Popen([sys.executable, "-c", "import time  # {MARK}\\ntime.sleep(60)"],
                        env={{**os.environ, "RANK": sys.argv[1]}})
print(rank.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_a_forked_child_is_not_counted_and_a_launched_rank_is() -> None:
    tag = f"jobs-{uuid.uuid4().hex[:8]}"
    env = tag_env(tag)
    env.pop("RANK", None)
    forking = subprocess.Popen(
        [sys.executable, "-c", FORKING], env={**env, "RANK": "2"}, stdout=subprocess.PIPE, text=True
    )
    launching = subprocess.Popen(
        [sys.executable, "-c", LAUNCHING, "3"], env=env, stdout=subprocess.PIPE, text=True
    )
    rank4 = subprocess.Popen(
        [sys.executable, "-c", LAUNCHING, "5"],
        env={**env, "RANK": "4"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        rank2, child = (int(v) for v in forking.stdout.readline().split())
        rank3 = int(launching.stdout.readline())
        rank5 = int(rank4.stdout.readline())
        want = {2: [rank2], 3: [rank3], 4: [rank4.pid], 5: [rank5]}
        deadline = time.monotonic() + 30
        while (found := rank_processes(tag, module=MARK)) != want:
            assert time.monotonic() < deadline, (found, want, child)
            time.sleep(0.05)
        assert child != rank2
    finally:
        for pid in wait_gone(tag, timeout=0):
            os.kill(pid, 9)
        for proc in (forking, launching, rank4):
            proc.wait(10)
        assert not wait_gone(tag, timeout=10)


# Creates a /dev/shm file, keeps it open and prints its name, then sleeps.
HOLDING = """
import os, sys, time, uuid
name = f"ms_data_jobwatch_{uuid.uuid4().hex[:8]}"
f = open(f"/dev/shm/{name}", "wb")
print(name, flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_job_watch_owns_what_the_job_held_and_its_pid_named_buffers_only() -> None:
    tag = f"jobs-{uuid.uuid4().hex[:8]}"
    ours = subprocess.Popen(
        [sys.executable, "-c", HOLDING], env=tag_env(tag), stdout=subprocess.PIPE, text=True
    )
    other = subprocess.Popen(
        [sys.executable, "-c", HOLDING],
        env=tag_env("someone-else"),
        stdout=subprocess.PIPE,
        text=True,
    )
    made: list[str] = []
    try:
        with JobWatch(tag, interval=0.05) as watch:
            mine, theirs = ours.stdout.readline().strip(), other.stdout.readline().strip()
            made += [mine, theirs]
            deadline = time.monotonic() + 20
            while mine not in watch.segments:
                assert time.monotonic() < deadline, watch.segments
                time.sleep(0.05)
            ours_start, other_start = process_starttime(ours.pid), process_starttime(other.pid)
            assert ours_start is not None and other_start is not None
            ours.kill()
            ours.wait(10)
            # ckpt names of one of the job's processes, of a process that was never its,
            # and of an earlier process with the job's pid (a recycled pid)
            by_maker = f"ms_ckpt_4026531836_{ours.pid}_{ours_start}_ab"
            stranger = f"ms_ckpt_4026531836_{other.pid}_{other_start}_ab"
            recycled = f"ms_ckpt_4026531836_{ours.pid}_{ours_start - 1}_ab"
            names = {mine, theirs, by_maker, stranger, recycled}
            assert watch.owned(names) == sorted([mine, by_maker])
            assert ours.pid in watch.pids and other.pid not in watch.pids
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait(10)
        for name in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


class _FailingWatch(JobWatch):
    def sample(self) -> None:
        raise OSError("cannot read /proc")


def _watch_then(body_error: Exception | None) -> None:
    with _FailingWatch("jobs-failing", interval=0.01) as watch:
        time.sleep(0.1)
        with pytest.raises(RuntimeError, match="stopped sampling"):
            watch.owned(["ms_data_x"])
        if body_error is not None:
            raise body_error


def test_job_watch_raises_its_sampling_error_and_never_hides_the_body_s() -> None:
    with pytest.raises(RuntimeError, match="stopped sampling") as caught:
        _watch_then(None)
    assert isinstance(caught.value.__cause__, OSError)
    with pytest.raises(ValueError, match="the body's own"):
        _watch_then(ValueError("the body's own error"))
