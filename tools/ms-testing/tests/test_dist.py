"""Tests of the multi-process harness itself: success, raise, hang, SIGKILL, cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ms_testing import RankFailure, launch, run_ranks


def sum_of_ranks(scale: float) -> tuple[int, str, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=dist.group.WORLD)
    return dist.get_rank(), os.environ["RANK"], t.item() * scale


def rank_tensor() -> torch.Tensor:
    return torch.arange(4, dtype=torch.float64) + dist.get_rank()


def raise_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        raise ValueError(f"boom from rank {bad}")
    return dist.get_rank()


def hang_here() -> None:
    while True:
        time.sleep(0.05)


def hang_on_rank(bad: int) -> int:
    if dist.get_rank() == bad:
        hang_here()
    return dist.get_rank()


def hang_on_rank_others_in_barrier(bad: int) -> None:
    if dist.get_rank() == bad:
        hang_here()
    dist.barrier(group=dist.group.WORLD)


def sigkill_on_rank(bad: int) -> None:
    if dist.get_rank() == bad:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier(group=dist.group.WORLD)


def start_grandchild_then_hang(pid_file: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).write_text(str(child.pid))
    hang_here()


def return_unpicklable() -> object:
    return lambda: None


def no_process_group() -> tuple[bool, str]:
    return dist.is_initialized(), os.environ["WORLD_SIZE"]


def environment_seen(names: tuple[str, ...]) -> tuple[dict[str, str | None], int, int]:
    return {n: os.environ.get(n) for n in names}, torch.get_num_threads(), os.getppid()


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_see_the_callers_environment_at_the_call(
    monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    # A forkserver starts at the first launch (or started earlier) with the environment
    # then: one variable set and one removed after it.
    monkeypatch.setenv("MS_TESTING_GONE", "1")
    run_ranks(no_process_group, 1, timeout=60, init_process_group=False)
    monkeypatch.setenv("MS_TESTING_SET_LATE", "late")
    monkeypatch.delenv("MS_TESTING_GONE")
    names = ("MS_TESTING_SET_LATE", "MS_TESTING_GONE", "MS_TESTING_EXTRA")
    for seen, threads, parent in run_ranks(
        environment_seen,
        2,
        args=(names,),
        env={"MS_TESTING_EXTRA": "x", "OMP_NUM_THREADS": "1"},
        timeout=60,
        start_method=start_method,  # type: ignore[arg-type]
    ):
        assert seen == {
            "MS_TESTING_SET_LATE": "late",
            "MS_TESTING_GONE": None,
            "MS_TESTING_EXTRA": "x",
        }
        assert threads == 1
        assert (parent == os.getpid()) == (start_method == "spawn")


def test_an_unknown_start_method_is_refused_naming_it() -> None:
    with pytest.raises(
        ValueError, match="start_method must be 'forkserver' or 'spawn', got 'fork'"
    ):
        run_ranks(no_process_group, 1, start_method="fork")  # type: ignore[arg-type]


def test_values_come_back_in_rank_order() -> None:
    values = run_ranks(sum_of_ranks, world_size=3, args=(2.0,), timeout=60)
    assert values == [(0, "0", 6.0), (1, "1", 6.0), (2, "2", 6.0)]


@pytest.mark.slow
def test_tensors_come_back() -> None:
    values = run_ranks(rank_tensor, world_size=2, timeout=60)
    torch.testing.assert_close(values[1], torch.arange(4, dtype=torch.float64) + 1)


def test_without_process_group() -> None:
    values = run_ranks(no_process_group, world_size=2, timeout=60, init_process_group=False)
    assert values == [(False, "2"), (False, "2")]


@pytest.mark.slow
def test_a_rank_that_raises_is_reported_with_its_traceback() -> None:
    report = launch(raise_on_rank, world_size=3, args=(1,), timeout=60)
    assert not report.ok
    assert [o.status for o in report.outcomes] == ["ok", "raised", "ok"]
    assert report.outcomes[0].value == 0
    error = report.outcomes[1].error or ""
    assert "ValueError: boom from rank 1" in error
    assert "raise_on_rank" in error
    with pytest.raises(RankFailure, match=r"rank 1 raised") as info:
        report.raise_for_failure()
    assert info.value.report is report


@pytest.mark.slow
def test_a_hung_rank_is_named_with_its_stack_within_the_deadline() -> None:
    deadline = 12.0
    start = time.monotonic()
    report = launch(hang_on_rank, world_size=2, args=(1,), timeout=deadline)
    elapsed = time.monotonic() - start
    # The deadline is hard: stack dump and kill add a few seconds at most.
    assert elapsed < deadline + 5, elapsed
    assert report.ranks("hung") == [1]
    assert report.outcomes[0].status == "ok"
    hung = report.outcomes[1]
    assert hung.exitcode == -signal.SIGKILL
    assert "deadline" in (hung.error or "")
    assert hung.stack is not None and "hang_here" in hung.stack
    message = report.describe()
    assert "hung: [1]" in message and "rank 1 hung" in message and "hang_here" in message


@pytest.mark.slow
def test_ranks_blocked_in_a_collective_show_the_collective() -> None:
    report = launch(hang_on_rank_others_in_barrier, world_size=3, args=(2,), timeout=10)
    assert report.ranks("hung") == [0, 1, 2]
    assert "hang_here" in (report.outcomes[2].stack or "")
    for rank in (0, 1):
        assert "barrier" in (report.outcomes[rank].stack or ""), report.outcomes[rank].stack


@pytest.mark.slow
def test_a_sigkilled_rank_is_reported_and_its_peers_do_not_hold_the_run() -> None:
    deadline = 60.0
    report = launch(sigkill_on_rank, world_size=3, args=(0,), timeout=deadline, grace=3.0)
    killed = report.outcomes[0]
    assert killed.status == "died"
    assert killed.exitcode == -signal.SIGKILL
    assert "SIGKILL" in (killed.error or "")
    # The survivors either notice the lost peer (gloo raises) or are cut off after
    # the grace period; neither waits for the full deadline.
    assert {o.status for o in report.outcomes[1:]} <= {"raised", "hung"}
    assert report.elapsed < deadline / 2, report.elapsed


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie no longer runs; PID 1 may reap it late


@pytest.mark.slow
def test_everything_a_hung_rank_started_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    report = launch(start_grandchild_then_hang, world_size=1, args=(str(pid_file),), timeout=10)
    assert report.ranks("hung") == [0]
    pid = int(pid_file.read_text())
    end = time.monotonic() + 5
    while not _is_gone(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert _is_gone(pid), f"grandchild {pid} of the hung rank survived"


@pytest.mark.slow
def test_unpicklable_return_value_is_an_error() -> None:
    report = launch(return_unpicklable, world_size=1, timeout=60)
    assert report.outcomes[0].status == "raised"
    assert "cannot be pickled" in (report.outcomes[0].error or "")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, "world_size must be an int >= 1, got 0"),
        ({"world_size": 2.0}, "world_size must be an int >= 1, got 2.0"),
        ({"world_size": 1, "timeout": 0}, "timeout must be > 0 seconds, got 0"),
        ({"world_size": 1, "grace": -1}, "grace must be >= 0 seconds, got -1"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        launch(sum_of_ranks, **kwargs)  # type: ignore[arg-type]


def test_a_local_function_is_refused() -> None:
    def local() -> None:
        return None

    with pytest.raises(TypeError, match="fn must be a module-level function"):
        launch(local, world_size=1)
