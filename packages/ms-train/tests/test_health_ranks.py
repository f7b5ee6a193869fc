"""The node agent's view of the launcher's ranks: real child processes read from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ms_health.escalate import process_state
from ms_train import _procs
from ms_train._health_launch import _Ranks

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def wait_until_zombie(pid: int) -> None:
    deadline = time.monotonic() + 60
    while process_state(pid) != "Z":
        assert time.monotonic() < deadline, f"pid {pid} did not die"
        time.sleep(0.01)


Spawn = Callable[..., "subprocess.Popen[bytes]"]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    started: list[subprocess.Popen[bytes]] = []

    def start(**env: str) -> subprocess.Popen[bytes]:
        drop = ("RANK", "TORCHELASTIC_RESTART_COUNT")
        base = {k: v for k, v in os.environ.items() if k not in drop}
        proc = subprocess.Popen(SLEEP, env={**base, **env})
        started.append(proc)
        # Until it has exec'd, a child has this process's environment (no RANK): the
        # agent would see it at its next report; the test waits for that moment.
        deadline = time.monotonic() + 60
        while b"time.sleep" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, f"pid {proc.pid} did not exec"
            time.sleep(0.005)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=60)


def test_ranks_are_the_children_with_a_rank_and_follow_their_life(spawn: Spawn) -> None:
    table = _Ranks()
    assert table.ranks() == {} and table.restart_round() == 0
    zero = spawn(RANK="0", TORCHELASTIC_RESTART_COUNT="2")
    one = spawn(RANK="1", TORCHELASTIC_RESTART_COUNT="2")
    helper = spawn()  # a child of the launcher that is not a rank (a diagnostics run)
    assert {zero.pid, one.pid, helper.pid} <= set(_procs.children())
    assert table.ranks() == {0: zero.pid, 1: one.pid}
    assert table.restart_round() == 2
    one.kill()
    # dead but not reaped yet (the elastic agent reaps its workers on its next look):
    # no live rank already, though its pid and environment were known
    wait_until_zombie(one.pid)
    assert table.ranks() == {0: zero.pid}
    one.wait(timeout=60)
    assert table.ranks() == {0: zero.pid}  # reaped: gone
    again = spawn(RANK="1", TORCHELASTIC_RESTART_COUNT="3")  # the next round's rank 1
    assert table.ranks() == {0: zero.pid, 1: again.pid}
    assert table.restart_round() == 3


def test_a_cached_pid_that_is_another_process_now_is_read_again(spawn: Spawn) -> None:
    table = _Ranks()
    proc = spawn(RANK="5")
    assert table.ranks() == {5: proc.pid}
    start = _procs.starttime(proc.pid)
    assert start is not None
    # The entry of this very process is what is read: the cache is used...
    table._known[proc.pid] = (start, 9, 7)
    assert table.ranks() == {9: proc.pid} and table.restart_round() == 7
    # ...but as if the pid had been reused by a process started at another time, the
    # start time no longer matches, and the environment is read again.
    table._known[proc.pid] = (0, 9, 7)
    assert table.ranks() == {5: proc.pid} and table.restart_round() == 0


def test_a_launcher_with_a_rank_of_its_own_reads_every_time(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its children show its RANK until they exec: nothing it reads can be kept.
    monkeypatch.setenv("RANK", "3")
    table = _Ranks()
    proc = spawn(RANK="5")
    assert table.ranks() == {5: proc.pid}
    start = _procs.starttime(proc.pid)
    table._known[proc.pid] = (start, 9, 7)  # a matching entry: still never consulted
    assert table.ranks() == {5: proc.pid}
