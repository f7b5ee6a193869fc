"""The escalation ladder on real processes and real signals: one that exits on SIGTERM,
one that ignores it, a SIGSTOPped one, and one spinning in C with the GIL held (its
Python SIGTERM handler never runs; faulthandler still dumps its stack)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from ms_health.escalate import escalate, process_state

SETUP = """
import signal, sys, time
from ms_health.escalate import install_dump_handler
dump = install_dump_handler(sys.argv[1])
"""


def _child(body: str, dump: Path) -> subprocess.Popen[str]:
    code = SETUP + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(dump)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def test_a_process_that_handles_sigterm_ends_there_after_dumping_its_stack(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    dump = tmp_path / "stacks.txt"
    proc = _child(
        """
        def on_term(signum, frame):
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        def training_step():
            print("ready", flush=True)
            while True:
                time.sleep(0.01)
        training_step()
        """,
        dump,
    )
    procs.append(proc)
    seen: list[str] = []
    result = escalate(proc.pid, dump_file=dump, on_step=lambda name, t: seen.append(name))
    assert result.outcome == "terminated"
    assert [name for name, _ in result.steps] == seen == ["dump", "SIGTERM"]
    assert "in training_step" in result.dump
    assert proc.wait(timeout=30) == 0


def test_a_process_that_ignores_sigterm_is_killed(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    proc = _child(
        """
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
        """,
        tmp_path / "stacks.txt",
    )
    procs.append(proc)
    result = escalate(proc.pid, term_timeout_s=0.5)
    assert result.outcome == "killed" and result.dump == ""
    assert [name for name, _ in result.steps] == ["SIGTERM", "SIGKILL"]
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_stopped_process_cannot_dump_and_is_killed(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    dump = tmp_path / "stacks.txt"
    proc = _child(
        """
        print("ready", flush=True)
        while True:
            time.sleep(0.01)
        """,
        dump,
    )
    procs.append(proc)
    proc.send_signal(signal.SIGSTOP)
    while process_state(proc.pid) != "T":
        pass
    result = escalate(proc.pid, dump_file=dump, dump_timeout_s=30, term_timeout_s=30)
    assert result.state == "T"  # the evidence that it is the hung one
    assert result.dump == ""
    # Neither the dump nor SIGTERM could act on it: SIGKILL came first.
    assert [name for name, _ in result.steps] == ["SIGKILL"]
    assert result.outcome == "killed"
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_process_spinning_with_the_gil_held_dumps_but_only_dies_by_sigkill(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    dump = tmp_path / "stacks.txt"
    proc = _child(
        """
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
        def spin():
            print("ready", flush=True)
            sum(range(10**15))  # one C call: no Python signal handler runs until it ends
        spin()
        """,
        dump,
    )
    procs.append(proc)
    result = escalate(proc.pid, dump_file=dump, term_timeout_s=1.0)
    assert result.outcome == "killed"
    assert "in spin" in result.dump  # faulthandler's C handler needs no GIL
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_process_that_is_gone_and_bad_arguments(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert escalate(proc.pid).outcome == "gone"
    with pytest.raises(ValueError, match="pid must be an int > 1, got 0"):
        escalate(0)
    with pytest.raises(ValueError, match="is this process"):
        escalate(os.getpid())
    with pytest.raises(ValueError, match="term_timeout_s must be a number >= 0 seconds"):
        escalate(proc.pid, term_timeout_s=-1)


def test_a_dump_request_leaves_the_process_running_and_returns_only_the_new_stacks(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    from ms_health.escalate import request_dump

    dump = tmp_path / "stacks.txt"
    proc = _child(
        """
        def waiting_for_work():
            print("ready", flush=True)
            while True:
                time.sleep(0.01)
        waiting_for_work()
        """,
        dump,
    )
    procs.append(proc)
    first = request_dump(proc.pid, dump)
    second = request_dump(proc.pid, dump)
    assert "in waiting_for_work" in first and "in waiting_for_work" in second
    assert dump.read_text() == first + second  # each answer is that request's own
    assert proc.poll() is None
    proc.send_signal(signal.SIGSTOP)
    try:
        assert request_dump(proc.pid, dump, timeout_s=0.5) == ""  # stopped: no answer
        assert process_state(proc.pid) == "T"
    finally:
        proc.send_signal(signal.SIGCONT)
    with pytest.raises(ValueError, match="timeout_s must be a number >= 0"):
        request_dump(proc.pid, dump, timeout_s=-1)
